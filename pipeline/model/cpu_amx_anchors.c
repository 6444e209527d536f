/* Decode phase A on AMX tiles (`amx_item`, bfloat16), and the AMX pieces prefill on AMX shares with it
 * (cpu_amx_prefill.c): the tiles' configuration, the values transposed for them (`pack_vt`), the
 * queries (`amx_queries`), the softmax's maximum (`column_max`). Included by cpu_decode.c after
 * cpu_anchors.c (not built alone); native_build.py hashes it into the library's name. */
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
