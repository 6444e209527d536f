/* Decode phase A of cpu_decode.c as matrix products: the rows reading one anchor against its keys,
 * in AVX-512 registers (`block_item`) or, for bfloat16, on AMX tiles (`amx_item`). Included by
 * cpu_decode.c after its Decode job and helpers (not built alone); native_build.py hashes
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
