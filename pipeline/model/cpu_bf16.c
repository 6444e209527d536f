/* The prefill tile of cpu_attention.c in bfloat16 on AVX-512 BF16 dot products (AMD since Zen 4,
 * Intel since Cooper Lake), where the float32 tile widens every key and value to float32 first and
 * multiplies 16 pairs a vector. The same tile (16 query rows as vector lanes against 16 keys at a
 * time, online softmax), with float32 accumulation:
 *   scores [16 keys][lanes] = keys . queries^T, each lane's queries in pairs of elements, each key's
 *     pair broadcast: the products of bfloat16 are exact in float32, summed in float32 (the
 *     queries unscaled, the scale applied to the sums);
 *   the softmax in float32 as in the float32 tile; the weights rounded to bfloat16 (as PyTorch's
 *     bfloat16 flash attention and matmuls round them), their sum taken before rounding;
 *   outputs [D][lanes] += values^T . weights, the weights of each pair of keys interleaved per
 *     lane, the values of the pair interleaved per dimension once per 16 keys.
 * Included by cpu_prefill.c, after cpu_tiles.c's Tile and helpers and `tile_out` (not built alone); native_build.py
 * hashes it into the library's name. */
#if defined(__AVX512BF16__)
enum { TILE_BF16 = 1 };

/* Whether the dot products beat widening: AMD's run at their FMA's instruction rate, twice its
 * multiply-adds; Intel's Xeon here (family 6, model 207) ran them at a quarter of its FMA's rate,
 * half its multiply-adds, and its tile widening bfloat16 was the faster (BENCHMARKS.md). */
static int bf16_dots_fast(void) { return __builtin_cpu_is("amd"); }

typedef int32_t pair_t __attribute__((may_alias, aligned(2))); /* two bfloat16 read as one lane */

typedef struct {
    int32_t qp[D / 2 * W]; /* [D/2][16 lanes] queries in pairs of elements, unscaled */
    float ot[D * W];       /* [D][16] values weighted by e^(score - m), not yet divided by sum */
    int32_t vp[W / 2 * D]; /* [8 pairs of keys][D] the values of keys 2p and 2p + 1, per dimension */
    uint16_t k[W * D];     /* the last keys of a run, padded with zeros to 16 */
    vf m, sum, pos;        /* as in Tile */
} TileBf;
_Static_assert(sizeof(TileBf) <= sizeof(Tile), "the prefill pass's scratch is sized for a Tile");

/* dst[2i] = a[i], dst[2i + 1] = b[i] over 16-bit elements: the low 16 of each (ILV_LO), the high 16
 * (ILV_HI); ILV: the same within one vector (a's 16 elements, then b's) */
static const uint16_t ILV_LO[32] __attribute__((aligned(64))) = {
    0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t ILV_HI[32] __attribute__((aligned(64))) = {
    16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
static const uint16_t ILV[32] __attribute__((aligned(64))) = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* Lane l is query head head[l] of token tok[l], at own index pos[l] (ascending). */
static void tile_bf16_start(TileBf *t, const void *q, int64_t q_tok, int64_t q_head, const int64_t *tok,
                            const int64_t *head, const float *pos) {
    for (int l = 0; l < W; l++) {
        const pair_t *src = (const pair_t *)((const uint16_t *)q + tok[l] * q_tok + head[l] * q_head);
        for (int p = 0; p < D / 2; p++) t->qp[p * W + l] = src[p];
    }
    memcpy(&t->pos, pos, sizeof t->pos);
    t->m = SPLAT(-1e30f), t->sum = SPLAT(0.0f);
    memset(t->ot, 0, sizeof t->ot);
}

/* 32 values from row p (fewer past D: zeros), or zeros for a row past the keys. */
static inline __attribute__((always_inline)) __m512i row32(const uint16_t *row, int i, int real) {
    __mmask32 m = !real ? 0 : D - i >= 32 ? 0xffffffffu : (__mmask32)((1u << (D - i)) - 1);
    return _mm512_maskz_loadu_epi16(m, row + i);
}

/* The tile's lanes against keys/values [0, len) of one head; `causal`: lane l sees keys <= pos[l]. */
static void tile_bf16_keys(TileBf *t, const uint16_t *keys, const uint16_t *values, int64_t len, int causal,
                           float scale) {
    float first = t->pos[0];
    const __m512i lo = _mm512_load_si512(ILV_LO), hi = _mm512_load_si512(ILV_HI), ilv = _mm512_load_si512(ILV);
    for (int64_t j0 = 0; j0 < len; j0 += W) {
        int n = len - j0 < W ? (int)(len - j0) : W;
        const pair_t *k = (const pair_t *)(keys + j0 * D);
        if (n < W) { /* padded: no test for the end among the dot products */
            memset(t->k, 0, sizeof t->k);
            memcpy(t->k, keys + j0 * D, (size_t)n * D * 2);
            k = (const pair_t *)t->k;
        }
        vf s[W];
        for (int j = 0; j < W; j++) s[j] = SPLAT(0.0f);
        for (int p = 0; p < D / 2; p++) {
            __m512bh qv = (__m512bh)_mm512_loadu_si512(t->qp + p * W);
            for (int j = 0; j < W; j++)
                s[j] = (vf)_mm512_dpbf16_ps((__m512)s[j], qv, (__m512bh)_mm512_set1_epi32(k[j * D / 2 + p]));
        }
        for (int j = 0; j < W; j++) s[j] *= scale;
        vf rescale = fold_scores(s, n, causal, j0, first, t->pos, &t->m, &t->sum);
        int pairs = (n + 1) / 2;
        __m512i wp[W / 2]; /* lane l: (weight of key 2p, of key 2p + 1) as bfloat16 */
        for (int p = 0; p < pairs; p++)
            wp[p] = _mm512_permutexvar_epi16(ilv, (__m512i)_mm512_cvtne2ps_pbh((__m512)s[2 * p + 1], (__m512)s[2 * p]));
        for (int p = 0; p < pairs; p++) { /* vp[p][dim]: (value of key 2p, of key 2p + 1); zeros past the keys */
            const uint16_t *a = values + (j0 + 2 * p) * D, *b = a + D;
            for (int i = 0; i < D; i += 32) {
                __m512i va = row32(a, i, 1), vb = row32(b, i, 2 * p + 1 < n);
                _mm512_storeu_si512(t->vp + p * D + i, _mm512_permutex2var_epi16(va, lo, vb));
                if (D - i > W) _mm512_storeu_si512(t->vp + p * D + i + W, _mm512_permutex2var_epi16(va, hi, vb));
            }
        }
        for (int c = 0; c < D / W; c++) { /* ot [16 dims][16 lanes] += values^T x weights, a pair of keys a step */
            vf o[W];
            for (int i = 0; i < W; i++) o[i] = ld(t->ot, (W * c + i) * W, 0) * rescale;
            for (int p = 0; p < pairs; p++)
                for (int i = 0; i < W; i++)
                    o[i] = (vf)_mm512_dpbf16_ps((__m512)o[i], (__m512bh)wp[p],
                                                (__m512bh)_mm512_set1_epi32(t->vp[p * D + W * c + i]));
            for (int i = 0; i < W; i++) st(t->ot + (W * c + i) * W, o[i]);
        }
    }
}

#else
enum { TILE_BF16 = 0 }; /* bfloat16 widened to float32 by the float32 tile instead */
static int bf16_dots_fast(void) { return 0; }
#endif
