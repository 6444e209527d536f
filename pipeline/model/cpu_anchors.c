/* Decode phase A of cpu_attention.c as matrix products: the rows reading one anchor against its keys,
 * in AVX-512 registers (`block_item`) or, for bfloat16, on AMX tiles (`amx_item`). Included by
 * cpu_attention.c after its Decode job and helpers (not built alone); pipeline/native.py hashes
 * both files into the library's name. */
/* ---------------------------------------------------------------------------------------------
 * Decode phase A as matrix products: up to 48 lanes (rows x the query heads of one key head, three
 * vectors) against the anchor's keys, KC keys at a time:
 *   scores [KC][lanes] = keys . queries^T, register tiles of 8 keys x 48 lanes (14 x 32, 16 x 16;
 *     each key element broadcast to every lane vector; bfloat16: AVX-512 BF16 dot products of
 *     pairs, exact products summed in float32);
 *   the softmax over the chunk, each lane's running maximum and sum (and its outputs) rescaled
 *     once per chunk, not once per key;
 *   outputs [lanes][D] += weights^T . values, register tiles of RB lanes x D (each weight
 *     broadcast to D/16 vectors of values), values widened to float32 once per chunk. */
/* RB lanes of CB accumulators each (CB of the D/16 vectors of a row at a time: all with AVX-512),
 * CB registers of values and a weight: at most VREGS registers */
enum { CB = VREGS >= 32 ? D / W : 2 };
enum { NK = 16, KC = 112, LANES = 3 * W, RB = (VREGS - 1 - CB) / CB < 16 ? (VREGS - 1 - CB) / CB : 16 };
/* keys a register tile of scores for nv lane vectors (nv x keys accumulators, at most 28 with AVX-512,
 * a third of the registers with AVX2); KC is a multiple of each */
#define KEYS(nv) (VREGS >= 32 ? ((nv) == 3 ? 8 : (nv) == 2 ? 14 : 16) : ((nv) == 3 ? 4 : (nv) == 2 ? 4 : 14))
/* lines of keys and values (float32) a step of a tile's scores loop fetches ahead: a tile's keys' lines
 * and as many of values come in D steps, so one line a step for 8 keys, two for 14 or 16 (a burst at
 * the tile's start held up its FMAs, as it did the 8-key tile's before: BENCHMARKS.md) */
#define LINES(nv) ((KEYS(nv) + 7) / 8)
enum { KA = 128, PACK = 256 }; /* AMX (below): keys per chunk; keys per packing item */

typedef struct {
    float qt[D * LANES];  /* [D][lanes] queries, scaled; bfloat16: [D/2][lanes] pairs of elements */
    float s[KC * LANES];  /* [key][lanes] scores, then weights */
    float o[LANES * D];   /* [lanes][D] weighted values, not yet divided by the sum */
    float v[KC * D];      /* bfloat16: the chunk's values as float32 */
    float k[NK * D];      /* the last keys of a slice, padded with zeros to a whole tile */
    vf m[3], sum[3];
} Block;

#if defined(__AVX512BF16__)
enum { DOT_BF16 = 1 };
#else
enum { DOT_BF16 = 0 }; /* bfloat16 keys and queries widened to float32 instead */
#endif

/* Scores of KEYS(nv) keys (rows of D at k, in the KV dtype) for `nv` lane vectors, into
 * s[j][lanes]; top[u]: each lane's maximum, over the first `real` keys too. */
static inline __attribute__((always_inline)) void block_scores(const Block *b, const void *k, float *s, int nv,
                                                               int dot, float scale, int real, vf *top,
                                                               const char *pk, int k_lines, const char *pv,
                                                               int v_lines) {
    const int nk = KEYS(nv), per = LINES(nv);
    vf acc[3][NK];
#pragma GCC unroll 16
    for (int j = 0; j < nk; j++)
        for (int u = 0; u < nv; u++) acc[u][j] = SPLAT(0.0f);
    if (!dot) {
        const float *kf = k;
        for (int i = 0; i < D; i++) {
            /* LINES(nv) lines of the keys and values to come per step, spread over the tile's FMAs */
            for (int l = per * i; l < per * (i + 1); l++)
                if (l < k_lines) _mm_prefetch(pk + 64 * l, _MM_HINT_T1);
                else if (l - k_lines < v_lines) _mm_prefetch(pv + 64 * (l - k_lines), _MM_HINT_T1);
            vf q[3];
            for (int u = 0; u < nv; u++) {
                q[u] = ld(b->qt, i * LANES + W * u, 0);
                IN_REG(q[u]);
            }
#pragma GCC unroll 16
            for (int j = 0; j < nk; j++) {
                vf kj = SPLAT(kf[j * D + i]);
                for (int u = 0; u < nv; u++) acc[u][j] += q[u] * kj;
            }
        }
    }
#if defined(__AVX512BF16__)
    else {
        const int32_t *kp = k; /* pairs of bfloat16 */
        const int32_t *qp = (const int32_t *)b->qt;
        for (int p = 0; p < D / 2; p++) {
            __m512bh q[3];
            for (int u = 0; u < nv; u++) q[u] = (__m512bh)_mm512_loadu_si512(qp + p * LANES + W * u);
#pragma GCC unroll 16
            for (int j = 0; j < nk; j++) {
                __m512bh kj = (__m512bh)_mm512_set1_epi32(kp[j * D / 2 + p]);
                for (int u = 0; u < nv; u++) acc[u][j] = (vf)_mm512_dpbf16_ps((__m512)acc[u][j], q[u], kj);
            }
        }
    }
#endif
#pragma GCC unroll 16
    for (int j = 0; j < nk; j++)
        for (int u = 0; u < nv; u++) {
            if (dot) /* the queries were not scaled: bfloat16 products stay exact */
                acc[u][j] *= scale;
            if (j < real) top[u] = vmax(top[u], acc[u][j]);
            st(s + j * LANES + W * u, acc[u][j]);
        }
}

/* o[r0..r0+rb) += weights s[0..n)[r] x values vf32 [n][D] (float32 rows). */
static inline __attribute__((always_inline)) void block_values(float *o, const float *s, const float *v, int n,
                                                               int r0, int rb) {
    for (int c0 = 0; c0 < D / W; c0 += CB) {
        vf acc[RB][CB];
        for (int r = 0; r < rb; r++)
            for (int c = 0; c < CB; c++) acc[r][c] = ld(o, (r0 + r) * D + W * (c0 + c), 0);
        for (int j = 0; j < n; j++) {
            vf x[CB];
            for (int c = 0; c < CB; c++) {
                x[c] = ld(v, j * D + W * (c0 + c), 0);
                IN_REG(x[c]);
            }
            for (int r = 0; r < rb; r++) {
                vf p = SPLAT(s[j * LANES + r0 + r]);
                for (int c = 0; c < CB; c++) acc[r][c] += p * x[c];
            }
        }
        for (int r = 0; r < rb; r++)
            for (int c = 0; c < CB; c++) st(o + (r0 + r) * D + W * (c0 + c), acc[r][c]);
    }
}

/* Every real lane's outputs: tiles of RB lanes, then the rest (each count its own unrolled code). */
static void block_all_values(float *o, const float *s, const float *v, int n, int real) {
    int r0 = 0;
    for (; r0 + RB <= real; r0 += RB) block_values(o, s, v, n, r0, RB);
    switch (real - r0) {
#define TAIL(x) case x: if (x < RB) block_values(o, s, v, n, r0, x < RB ? x : 1); break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8)
        TAIL(9) TAIL(10) TAIL(11) TAIL(12) TAIL(13) TAIL(14) TAIL(15)
#undef TAIL
        default: break;
    }
}

static void block_item(const void *arg, int w, void *scratch) {
    const Decode *job = arg;
    Block *b = scratch;
    int64_t h = job->items[ITEM * w + 2], slice = job->items[ITEM * w + 4], tok[LANES], head[LANES], j0, j1;
    int real = item_lanes(job, w, LANES, tok, head), nv = (real + W - 1) / W, bf16 = job->bf16;
    int dot = bf16 && DOT_BF16;
    for (int l = 0; l < LANES; l++) /* queries transposed: qt[i][lane], or pairs of elements qt[i/2][lane] */
        for (int c = 0; c < D / W; c++) {
            int64_t at = tok[l] * job->q_tok + head[l] * job->q_head + W * c;
            if (dot) {
                const int32_t *src = (const int32_t *)((const uint16_t *)job->q + at);
                for (int i = 0; i < W / 2; i++) ((int32_t *)b->qt)[(W / 2 * c + i) * LANES + l] = src[i];
            } else {
                vf x = ld(job->q, at, bf16) * job->scale;
                for (int i = 0; i < W; i++) b->qt[(W * c + i) * LANES + l] = x[i];
            }
        }
    int64_t t0 = tok[0], len = job->anc_len[t0], es = bf16 ? 2 : 4;
    slice_keys(job, slice, len, &j0, &j1);
    const char *keys = (const char *)job->anc_k[t0] + h * len * D * es;
    const char *values = (const char *)job->anc_v[t0] + h * len * D * es;
    memset(b->o, 0, sizeof b->o);
    for (int u = 0; u < 3; u++) b->m[u] = SPLAT(-1e30f), b->sum[u] = SPLAT(0.0f);
    float widened[NK * D] __attribute__((aligned(64)));
    const int nk = KEYS(nv);
    for (int64_t c0 = j0; c0 < j1; c0 += KC) {
        int n = j1 - c0 < KC ? (int)(j1 - c0) : KC;
        vf top[3] = {b->m[0], b->m[1], b->m[2]};
        for (int jb = 0; jb < n; jb += nk) {
            const void *k = keys + (c0 + jb) * D * es;
            /* while this tile's scores compute: the next chunk's keys and this chunk's values, a
             * tile's worth each, a line per step of the scores' loop (all at the tile's start, they
             * held up its FMAs; BENCHMARKS.md) */
            int64_t ahead = c0 + KC + jb, mine = c0 + jb;
            int64_t ka = ahead < j1 ? ahead : j1, kb = ahead + nk < j1 ? ahead + nk : j1;
            int64_t vb = mine + nk < j1 ? mine + nk : j1;
            const char *pk = keys + ka * D * es, *pv = values + mine * D * es;
            int kl = (int)(((kb - ka) * D * es + 63) / 64), vl = (int)(((vb - mine) * D * es + 63) / 64);
            if (dot || kl + vl > LINES(nv) * D) { /* more lines than the steps take (bfloat16's loop has D / 2): up front */
                prefetch_rows(keys, ka, kb, D * es, 0);
                prefetch_rows(values, mine, vb, D * es, 0);
                kl = vl = 0;
            }
            if (n - jb < nk) { /* the slice's last keys: padded, so that every tile has its keys */
                memset(b->k, 0, sizeof b->k);
                memcpy(b->k, k, (size_t)(n - jb) * D * es);
                k = b->k;
            }
            if (bf16 && !dot) { /* no BF16 dot products on this CPU: keys widened */
                for (int i = 0; i < nk * D; i += W) st(widened + i, ld(k, i, 1));
                k = widened;
            }
            if (nv == 3)
                block_scores(b, k, b->s + jb * LANES, 3, dot, job->scale, n - jb, top, pk, kl, pv, vl);
            else if (nv == 2)
                block_scores(b, k, b->s + jb * LANES, 2, dot, job->scale, n - jb, top, pk, kl, pv, vl);
            else
                block_scores(b, k, b->s + jb * LANES, 1, dot, job->scale, n - jb, top, pk, kl, pv, vl);
        }
        for (int u = 0; u < nv; u++) { /* the chunk's softmax, lane by lane; earlier chunks rescaled */
            float *s = b->s + W * u;
            vf rescale = exp_neg(b->m[u] - top[u]), sum = b->sum[u] * rescale;
            for (int j = 0; j < n; j++) {
                vf e = exp_neg(ld(s, j * LANES, 0) - top[u]);
                st(s + j * LANES, e);
                sum += e;
            }
            b->m[u] = top[u], b->sum[u] = sum;
            for (int l = 0; l < W && W * u + l < real; l++)
                if (rescale[l] != 1.0f)
                    for (int c = 0; c < D / W; c++)
                        st(b->o + (W * u + l) * D + W * c, ld(b->o, (W * u + l) * D + W * c, 0) * rescale[l]);
        }
        const float *v = (const float *)(values + c0 * D * es);
        if (bf16) {
            for (int i = 0; i < n * D; i += W) st(b->v + i, ld(values, c0 * D + i, 1));
            v = b->v;
        }
        block_all_values(b->o, b->s, v, n, real);
    }
    for (int l = 0; l < real; l++) {
        float *dst = state_of(job, slice, tok[l], head[l]);
        memcpy(dst, b->o + l * D, sizeof(float) * D);
        dst[D] = b->m[l / W][l % W], dst[D + 1] = b->sum[l / W][l % W];
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
/* ---------------------------------------------------------------------------------------------
 * Decode phase A on AMX tiles (bfloat16, head size a multiple of 32; Intel since Sapphire Rapids):
 * the same matrix products on 16 x 16 tiles of float32 sums, transposed so that the softmax runs
 * down vectors of 16 rows as in `block_item`, KA keys at a time:
 *   scores^T [keys][rows] = keys [keys][D] (read in place) . queries^T (pairs of elements);
 *   the softmax (float32), the weights rounded to bfloat16 (as PyTorch's bfloat16 matmuls and
 *     flash attention round them) in pairs of keys;
 *   outputs^T [D][rows] += values^T [D][keys] . weights^T, the values transposed once per call
 *     (`pack_item`) for all the rows reading them. */
enum { HAVE_AMX = 1 };

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux lends a process the tile registers only once it asks (5.16+); 0 where it does not. */
static int amx_usable(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* Each key head's values transposed, [D][len rounded up to 32] with zeros past len. */
static int64_t padded(int64_t len) { return (len + 31) / 32 * 32; }

/* Keys [k0, k1) (multiples of 32, k1 <= padded(len)) of one head's values [len][D] (`src`)
 * transposed into vt [D][padded(len)], zeros past len: the A tiles of outputs^T += values^T . weights^T.
 * Shared by decode's anchors (`pack_item`) and prefill on AMX (cpu_amx_prefill.c). */
static void pack_vt(const uint16_t *src, int64_t len, uint16_t *vt, int64_t k0, int64_t k1) {
    const int32_t *values = (const int32_t *)src; /* pairs of dims */
    int64_t lp = padded(len);
    /* 32 keys x 2 dims at a time: the pairs (dim d, d + 1) of 16 keys gathered twice, then split
     * into dim d's 32 keys (the even halves) and dim d + 1's (the odd) */
    __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                    30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                      _mm512_set1_epi32(D / 2));
    for (int64_t j0 = k0; j0 < k1; j0 += 32) {
        __mmask16 m0 = len - j0 >= 16 ? 0xffff : len - j0 <= 0 ? 0 : (__mmask16)((1u << (len - j0)) - 1);
        __mmask16 m1 = len - j0 >= 32 ? 0xffff : len - j0 <= 16 ? 0 : (__mmask16)((1u << (len - j0 - 16)) - 1);
        for (int p = 0; p < D / 2; p++) {
            __m512i at = _mm512_add_epi32(rows, _mm512_set1_epi32(p));
            __m512i g0 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m0, at, values + j0 * (D / 2), 4);
            __m512i g1 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m1, at, values + (j0 + 16) * (D / 2), 4);
            _mm512_storeu_si512(vt + 2 * p * lp + j0, _mm512_permutex2var_epi16(g0, even, g1));
            _mm512_storeu_si512(vt + (2 * p + 1) * lp + j0, _mm512_permutex2var_epi16(g0, odd, g1));
        }
    }
}

static void pack_item(const void *arg, int w, void *scratch) {
    const Decode *job = arg;
    (void)scratch;
    const int64_t *it = job->pack_items + 4 * w;
    int64_t g = it[0], h = it[1], k0 = it[2], t = it[3], len = job->anc_len[t], lp = padded(len);
    pack_vt((const uint16_t *)job->anc_v[t] + h * len * D, len, job->packed + job->packed_at[g] + h * lp * D, k0,
            k0 + PACK < lp ? k0 + PACK : lp);
}

enum { AL = 4 * W }; /* rows an item: four tiles of 16, so that four tiles of sums are in flight */

typedef struct {
    uint16_t qt[AL * D];     /* [rows / 16][D/2][16][2] queries^T in pairs of elements (tiles B) */
    float s[KA * AL];        /* [keys][rows] scores */
    uint16_t pt[2 * KA * AL]; /* [part][rows / 16][keys / 2][16][2] weights^T in pairs of keys (tiles B),
                               * in two parts: rounded to bfloat16, and what that rounding left */
    float ot[D * AL];        /* [D][rows] weighted values, not yet divided by the sum */
    uint16_t k[W * D];       /* the slice's last keys, padded with zeros to 16 */
    vf m[4], sum[4];
} Amx;


/* Queries^T for the tiles (`QT` layout: [rows / 16][D/2][16][2], pairs of elements) of `lanes` rows
 * (a multiple of 16), row l being query head head[l] of token tok[l] of q (bfloat16, strides in
 * elements, even): 16 rows' pairs at a time, transposed in registers (`transpose16`). */
static void amx_queries(uint16_t *qt, const void *q, int64_t q_tok, int64_t q_head, const int64_t *tok,
                        const int64_t *head, int lanes) {
    const int32_t *q32 = q;
    for (int l0 = 0; l0 < lanes; l0 += W) /* qt[rg][pair][row in rg] = (q[2 pair], q[2 pair + 1]) */
        for (int p0 = 0; p0 < D / 2; p0 += W) {
            __m512 r[16];
            for (int l = 0; l < W; l++)
                r[l] = _mm512_loadu_ps((const float *)q32 + (tok[l0 + l] * q_tok + head[l0 + l] * q_head) / 2 + p0);
            transpose16(r);
            for (int p = 0; p < W; p++) _mm512_storeu_ps((float *)qt + ((l0 / W) * (D / 2) + p0 + p) * W, r[p]);
        }
}

/* The rows of a 16-row vector that see key `key`: all, unless `causal` and the key comes after
 * `first` (the smallest of the rows' own indices `pos`), then those with pos >= key. */
static inline __attribute__((always_inline)) __mmask16 rows_seeing(int causal, int64_t key, float first, vf pos) {
    return causal && key > first ? _mm512_cmp_ps_mask((__m512)pos, _mm512_set1_ps((float)key), _CMP_GE_OQ) : 0xffff;
}

/* The maximum of `from` and the scores s[j * AL] (j < n, 16 rows a vector) each row sees
 * (`rows_seeing` key c0 + j), in four chains: one chain waits on each max's latency, and the
 * maximum is exact in any order. Shared by decode's anchors and prefill (cpu_amx_prefill.c). */
static inline __attribute__((always_inline)) __m512 column_max(const float *s, int n, __m512 from, int causal,
                                                               int64_t c0, float first, vf pos) {
    __m512 m0 = from, m1 = from, m2 = from, m3 = from;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        m0 = _mm512_mask_max_ps(m0, rows_seeing(causal, c0 + j, first, pos), m0, (__m512)ld(s, j * AL, 0));
        m1 = _mm512_mask_max_ps(m1, rows_seeing(causal, c0 + j + 1, first, pos), m1, (__m512)ld(s, (j + 1) * AL, 0));
        m2 = _mm512_mask_max_ps(m2, rows_seeing(causal, c0 + j + 2, first, pos), m2, (__m512)ld(s, (j + 2) * AL, 0));
        m3 = _mm512_mask_max_ps(m3, rows_seeing(causal, c0 + j + 3, first, pos), m3, (__m512)ld(s, (j + 3) * AL, 0));
    }
    for (; j < n; j++) m0 = _mm512_mask_max_ps(m0, rows_seeing(causal, c0 + j, first, pos), m0, (__m512)ld(s, j * AL, 0));
    return _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
}

/* Eight tiles of 16 rows of 64 bytes: the four sums, two A and two B tiles of the products below. */
static void amx_configure(void) {
    TileConfig cfg = {.palette = 1};
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
}

/* The two matrix products on tiles, each as 2 x 2 blocks: four tiles of sums (0-3), two A tiles (4,
 * 5) and two B tiles (6, 7) loaded per step, each used twice, and no tile reloaded while the product
 * before reads it (one A and four B tiles a step waited on the tile the last product read). Shared
 * by decode's anchors (`amx_item`) and prefill (cpu_amx_prefill.c). */

/* s [key][AL] = scores^T of keys [n][D] (read in place, whole blocks of 16; the last block, when
 * partial, through `pad` [W][D]) for the `nv` tiles of 16 rows of queries^T `qt` (`QT` layout). */
static void amx_scores(const uint16_t *keys, int n, const uint16_t *qt, int nv, float *s, uint16_t *pad) {
    int blocks = (n + W - 1) / W;
    for (int kb = 0; kb < blocks; kb += 2) {
        const uint16_t *k0 = keys + (int64_t)kb * W * D, *k1 = k0 + W * D;
        int two = kb + 1 < blocks;
        if ((kb + 1) * W > n) { /* past the end: zeros, and no read past the buffer */
            memset(pad, 0, sizeof(uint16_t) * W * D);
            memcpy(pad, k0, sizeof(uint16_t) * (size_t)(n - kb * W) * D);
            k0 = pad;
        } else if (two && (kb + 2) * W > n) {
            memset(pad, 0, sizeof(uint16_t) * W * D);
            memcpy(pad, k1, sizeof(uint16_t) * (size_t)(n - (kb + 1) * W) * D);
            k1 = pad;
        }
        for (int u = 0; u < nv; u += 2) {
            int pair = u + 1 < nv;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int ds = 0; ds < D / 32; ds++) {
                _tile_loadd(4, k0 + ds * 32, 2 * D);
                _tile_loadd(6, qt + (u * (D / 2) + ds * 16) * 2 * W, 64);
                if (two) _tile_loadd(5, k1 + ds * 32, 2 * D);
                if (pair) _tile_loadd(7, qt + ((u + 1) * (D / 2) + ds * 16) * 2 * W, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (pair) _tile_dpbf16ps(1, 4, 7);
                if (two) _tile_dpbf16ps(2, 5, 6);
                if (two && pair) _tile_dpbf16ps(3, 5, 7);
            }
            float *dst = s + (int64_t)kb * W * AL + W * u;
            _tile_stored(0, dst, 4 * AL);
            if (pair) _tile_stored(1, dst + W, 4 * AL);
            if (two) _tile_stored(2, dst + W * AL, 4 * AL);
            if (two && pair) _tile_stored(3, dst + W * AL + W, 4 * AL);
        }
    }
}

/* ot [D][AL] += values^T (vt [D][lp], keys c0 .. c0 + 32 pairs) . weights^T for the `nv` row tiles
 * (`pt` in the `PT` layout; `parts` of them, `part` apart, each added). */
static void amx_outputs(float *ot, const uint16_t *vt, int64_t lp, int64_t c0, int pairs, const uint16_t *pt,
                        int nv, int parts, int64_t part) {
    for (int db = 0; db < D / W; db += 2) { /* D a multiple of 32: pairs of 16 dims */
        for (int u = 0; u < nv; u += 2) {
            int pair = u + 1 < nv;
            float *o0 = ot + (int64_t)db * W * AL + W * u, *o1 = o0 + W * AL;
            _tile_loadd(0, o0, 4 * AL);
            if (pair) _tile_loadd(1, o0 + W, 4 * AL);
            _tile_loadd(2, o1, 4 * AL);
            if (pair) _tile_loadd(3, o1 + W, 4 * AL);
            for (int ks = 0; ks < pairs; ks++) {
                _tile_loadd(4, vt + (int64_t)db * W * lp + c0 + ks * 32, 2 * lp);
                _tile_loadd(5, vt + (int64_t)(db + 1) * W * lp + c0 + ks * 32, 2 * lp);
                for (int p = 0; p < parts; p++) {
                    const uint16_t *b = pt + p * part + (u * (KA / 2) + ks * 16) * 2 * W;
                    _tile_loadd(6, b, 64);
                    if (pair) _tile_loadd(7, b + KA / 2 * 2 * W, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (pair) _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    if (pair) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, o0, 4 * AL);
            if (pair) _tile_stored(1, o0 + W, 4 * AL);
            _tile_stored(2, o1, 4 * AL);
            if (pair) _tile_stored(3, o1 + W, 4 * AL);
        }
    }
}

static void amx_item(const void *arg, int w, void *scratch) {
    const Decode *job = arg;
    Amx *b = scratch;
    const int64_t *it = job->items + ITEM * w;
    int64_t h = it[2], slice = it[4], g = it[5], tok[AL], head[AL], j0, j1;
    int real = item_lanes(job, w, AL, tok, head), nv = (real + W - 1) / W;
    amx_queries(b->qt, job->q, job->q_tok, job->q_head, tok, head, W * nv);
    int64_t len = job->anc_len[tok[0]], lp = padded(len);
    slice_keys(job, slice, len, &j0, &j1);
    const uint16_t *keys = (const uint16_t *)job->anc_k[tok[0]] + h * len * D;
    const uint16_t *vt = job->packed + job->packed_at[g] + h * lp * D;
    memset(b->ot, 0, sizeof b->ot);
    for (int u = 0; u < 4; u++) b->m[u] = SPLAT(-1e30f), b->sum[u] = SPLAT(0.0f);
    amx_configure();
#define PT(rg, ks) (b->pt + ((rg) * (KA / 2) + (ks) * 16) * 2 * W)
    for (int64_t c0 = j0; c0 < j1; c0 += KA) {
        int n = j1 - c0 < KA ? (int)(j1 - c0) : KA, pairs = (n + 31) / 32;
        amx_scores(keys + c0 * D, n, b->qt, nv, b->s, b->k);
        for (int u = 0; u < nv; u++) { /* the chunk's softmax, 16 rows a vector; earlier chunks rescaled */
            const float *s = b->s + W * u;
            vf top = b->m[u] * (1.0f / job->scale); /* the maximum unscaled (scale > 0) */
            top = (vf)column_max(s, n, (__m512)top, 0, 0, 0.0f, SPLAT(0.0f));
            top *= job->scale;
            vf rescale = exp_neg(b->m[u] - top), sum = b->sum[u] * rescale;
            for (int j = 0; j < 32 * pairs; j += 2) {
                vf e0 = j < n ? exp_neg(ld(s, j * AL, 0) * job->scale - top) : SPLAT(0.0f);
                vf e1 = j + 1 < n ? exp_neg(ld(s, (j + 1) * AL, 0) * job->scale - top) : SPLAT(0.0f);
                sum += e0 + e1;
                /* each row's pair (e0, e1) in two bfloat16 parts: the top 16 bits of each, then
                 * the rest (exact in float32) rounded to bfloat16; bit operations, no shuffles */
                __m512i top16 = _mm512_set1_epi32((int)0xffff0000), b0 = (__m512i)e0, b1 = (__m512i)e1;
                __m512i r0 = (__m512i)(e0 - (vf)_mm512_and_si512(b0, top16));
                __m512i r1 = (__m512i)(e1 - (vf)_mm512_and_si512(b1, top16));
                r0 = _mm512_add_epi32(r0, _mm512_set1_epi32(0x8000)), r1 = _mm512_add_epi32(r1, _mm512_set1_epi32(0x8000));
                /* 0xca: the second operand's bits where the first (top16) has ones, else the third's */
                _mm512_storeu_si512(PT(u, 0) + j * W, _mm512_ternarylogic_epi32(top16, b1, _mm512_srli_epi32(b0, 16), 0xca));
                _mm512_storeu_si512(PT(u, 0) + KA * AL + j * W,
                                    _mm512_ternarylogic_epi32(top16, r1, _mm512_srli_epi32(r0, 16), 0xca));
            }
            b->m[u] = top, b->sum[u] = sum;
            if (_mm512_cmp_ps_mask((__m512)rescale, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))
                for (int i = 0; i < D; i++) st(b->ot + i * AL + W * u, ld(b->ot, i * AL + W * u, 0) * rescale);
        }
        amx_outputs(b->ot, vt, lp, c0, pairs, b->pt, nv, 2, KA * AL);
    }
#undef PT
    _tile_release();
    for (int l = 0; l < real; l++) {
        float *dst = state_of(job, slice, tok[l], head[l]);
        for (int i = 0; i < D; i++) dst[i] = b->ot[i * AL + l];
        dst[D] = b->m[l / W][l % W], dst[D + 1] = b->sum[l / W][l % W];
    }
}
#else
enum { HAVE_AMX = 0 };
static int amx_usable(void) { return 0; }
#endif
