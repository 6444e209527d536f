/* batchgen's attention kernels for CPUs: every token of a forward against its row's cached prefix
 * (the anchor, shared with other rows) and then its own keys, in one pass, final (no partial
 * softmaxes to merge).
 *
 * Why kernels of our own: PyTorch's CPU kernels run this at 76-95 GFLOP/s in prefill (padded
 * batches of suffixes, a second call per anchor, gathers and a log-sum-exp merge around them) and
 * read a decoding row's keys at 8-9 GB/s (each row a tiny GEMM). Here:
 * - decode (one query per row): the rows reading one anchor as matrix products against it, the
 *   queries of 48 rows x query heads (64 on AMX tiles, bfloat16) by its keys, then their weights
 *   by its values, the anchor read once per such tile; then each (row, key head) against its own
 *   keys, read once for all the query heads that share them, and merged with its anchor's part;
 * - prefill (a run of tokens continuing one sequence): 16 query rows (tokens x the query heads of
 *   one key head) at a time, a GEMM-style register tile against 16 keys at a time, online softmax
 *   (flash attention), causal by own index, no padding.
 *
 * Built by pipeline/native.py with the machine's C compiler (-march=native) for one head layout
 * (-DBATCHGEN_G query heads per key head, -DBATCHGEN_D head size): plain C with GCC/Clang vector
 * extensions of W floats, no Python or torch headers: W = 16 for CPUs with AVX-512, W = 8 for AVX2
 * with FMA (the tiles then have half the lanes and keys; 16-float vectors there live in memory);
 * elsewhere the entry points refuse and the engine keeps PyTorch's kernels. AVX-512 BF16 dot products and AMX tiles
 * where -march=native has them, AMX only once Linux lends this process its tile registers
 * (`amx_usable`). Threads come from torch's OpenMP runtime
 * when built with -fopenmp (its threads still spin after torch's last op: new threads would fight
 * them for the cores), else from pthreads.
 *
 * Layouts (elements of the KV dtype, float32 or bfloat16, row-major):
 *   q           [T, Hq, D] with strides (q_tok, q_head, 1)
 *   own k/v     [rows, Hkv, cap, D] contiguous: a batch's row slots, or a prefix being prefilled
 *   anchor k/v  [1, Hkv, len, D]    contiguous, or none (pointer 0)
 *   out         [T, Hq, D] float32, contiguous
 * Scores, softmax and sums in float32, as PyTorch's kernels compute them (AMX: the weights meet the
 * values as two bfloat16 parts, 16 bits of their 24). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(BATCHGEN_G) || !defined(BATCHGEN_D)
#error "build with -DBATCHGEN_G=<query heads per key head> -DBATCHGEN_D=<head size>"
#endif
#define G BATCHGEN_G
#define D BATCHGEN_D
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define BATCHGEN_SIMD 1 /* the kernels are built: for AVX-512, or for AVX2 with FMA */
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
enum { W = 16 }; /* floats per vector; keys per prefill tile */
#else
/* AVX2: vectors of 8 floats, and tiles of 8 lanes and 8 keys (vectors of 16 would live in memory:
 * GCC keeps a vector type the CPU has no registers for on the stack, and the kernels ran at 6
 * GFLOP/s) */
enum { W = 8 };
#endif
/* prefill_attention's kernels (native.PREFILL): float32 on the wide tile (bfloat16 widened onto the
 * 16-lane one), AVX-512 BF16 dot products, AMX tiles, and the 16-lane tile for either (the reference);
 * with AVX2 the tiles have half the lanes */
enum { PREFILL_WIDEN = 0, PREFILL_DOTS = 1, PREFILL_AMX = 2, PREFILL_TILE16 = 3 };
_Static_assert(D % 16 == 0 && D <= 128 && G >= 1 && G <= 8, "head size 16-128 in steps of 16, 1-8 query heads a key head");

#if defined(BATCHGEN_SIMD)
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
#endif

#if defined(__AVX512F__)
#define IN_REG(v) ((void)0) /* 32 registers: GCC keeps them (see the AVX2 build's) */
enum { VREGS = 32 }; /* vector registers */
#define SPLAT(x) ((vf)_mm512_set1_ps(x)) /* not (vf){0} + x: that adds 0.0f before broadcasting */

/* a * b + c rounded once, written out: where a tile writes `c += a * b`, GCC contracts it or not
 * case by case (it did not in a partial block's scores), and the tiles must round alike */
static inline __attribute__((always_inline)) vf fma16(vf a, vf b, vf c) {
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
static inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
/* s where key <= pos, else -1e30 (no weight): the causal mask of a block's key */
static inline __attribute__((always_inline)) vf causal_cut(vf s, float key, vf pos) {
    return (vf)_mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_set1_ps(key), (__m512)pos, _CMP_GT_OQ), (__m512)s,
                                    _mm512_set1_ps(-1e30f));
}
static inline __attribute__((always_inline)) float reduce_max(vf a) { return _mm512_reduce_max_ps((__m512)a); }
static inline __attribute__((always_inline)) float reduce_add(vf a) { return _mm512_reduce_add_ps((__m512)a); }
/* y * 2^n, 0 where x < -87 (exp_neg's last step) */
static inline __attribute__((always_inline)) vf scale_pow2(vf y, vf n, vf x) {
    __mmask16 tiny = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    return (vf)_mm512_maskz_scalef_ps(~tiny, (__m512)y, (__m512)n);
}
#elif defined(BATCHGEN_SIMD)
/* v in a register from here on: GCC otherwise folds a vector used by several FMAs into each one as a
 * memory operand, and a tile's loads (2 per FMA) bound it on AVX2 (the values do not change) */
#define IN_REG(v) __asm__("" : "+x"(v))
enum { VREGS = 16 };
#define SPLAT(x) ((vf)_mm256_set1_ps(x))
static inline __attribute__((always_inline)) vf fma16(vf a, vf b, vf c) {
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
static inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
static inline __attribute__((always_inline)) vf causal_cut(vf s, float key, vf pos) {
    __m256 after = _mm256_cmp_ps(_mm256_set1_ps(key), (__m256)pos, _CMP_GT_OQ);
    return (vf)_mm256_blendv_ps((__m256)s, _mm256_set1_ps(-1e30f), after);
}
static inline __attribute__((always_inline)) float reduce_max(vf a) {
    __m128 m = _mm_max_ps(_mm256_extractf128_ps((__m256)a, 1), _mm256_castps256_ps128((__m256)a));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline __attribute__((always_inline)) float reduce_add(vf a) { /* halves, then pairs */
    float h[4];
    for (int i = 0; i < 4; i++) h[i] = a[4 + i] + a[i];
    return (h[0] + h[2]) + (h[1] + h[3]);
}
/* y * 2^n with 2^n built in the exponent bits (n >= -126 wherever x >= -87: a normal power of two,
 * so the product is rounded once, as vscalefps rounds it) */
static inline __attribute__((always_inline)) vf scale_pow2(vf y, vf n, vf x) {
    vi tiny = x < SPLAT(-87.0f);
    vf p = (vf)((__builtin_convertvector(n, vi) + 127) << 23);
    return (vf)((vi)(y * p) & ~tiny);
}
#endif

#if defined(BATCHGEN_SIMD)
/* W elements from p[i] as float32: plain, or bfloat16 widened (its bits are float32's top half). */
static inline __attribute__((always_inline)) vf ld(const void *p, int64_t i, int bf16) {
    vf f;
    if (!bf16) {
        memcpy(&f, (const float *)p + i, sizeof f);
    } else {
        vh h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&f, &u, sizeof f);
    }
    return f;
}

static inline __attribute__((always_inline)) void st(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* e^x for x <= 0, 0 below -87 (Cephes' expf: range reduction by ln 2, degree-6 polynomial; n
 * rounded by adding and taking away 1.5 x 2^23, the power of two applied by vscalefps: fewer
 * instructions, and fewer that only one port runs, than vrndscaleps and building the exponent). */
static inline __attribute__((always_inline)) vf exp_neg(vf x) {
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* x / ln 2 to the nearest integer */
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
            + 1.6666665459e-1f) * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    return scale_pow2(y, n, x);
}

/* Rows [from, to) of `row` bytes each into L2 (or L1: `near`), ahead of their use: an anchor or a
 * row's own keys stream from memory once per step, and the hardware prefetchers stop at each 4 KB
 * page, so a kernel that reads them only as it needs them waits on memory (BENCHMARKS.md). */
static inline __attribute__((always_inline)) void prefetch_rows(const char *base, int64_t from, int64_t to,
                                                                int64_t row, int near) {
    for (int64_t i = from * row; i < to * row; i += 64)
        if (near) _mm_prefetch(base + i, _MM_HINT_T0);
        else _mm_prefetch(base + i, _MM_HINT_T1);
}

/* One parallel pass: `item` over work items 0..items-1, shared out as threads come for them; each
 * thread has `scratch` bytes of its own. */
typedef struct {
    void (*item)(const void *job, int w, void *scratch);
    const void *job;
    size_t scratch;
    int items, next, done;
} Pass;

static void *worker(void *arg) {
    Pass *p = arg;
    void *scratch = aligned_alloc(64, (p->scratch + 63) / 64 * 64);
    if (!scratch) return NULL; /* this thread takes no items: the others do them */
    for (int w; (w = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED)) < p->items;) {
        p->item(p->job, w, scratch);
        __atomic_fetch_add(&p->done, 1, __ATOMIC_RELAXED);
    }
    free(scratch);
    return NULL;
}

/* Runs a pass on `threads` threads (the caller's among them); 0 when every item was done. */
static int run(void (*item)(const void *, int, void *), const void *job, int items, size_t scratch, int threads) {
    Pass p = {item, job, scratch, items, 0, 0};
    threads = threads < 1 ? 1 : threads > items ? items : threads;
    if (threads < 1) return 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    worker(&p);
#else
    pthread_t ids[threads];
    int started = 0;
    for (; started < threads - 1; started++)
        if (pthread_create(&ids[started], NULL, worker, &p)) break;
    worker(&p);
    for (int i = 0; i < started; i++) pthread_join(ids[i], NULL);
#endif
    return p.done != items;
}

/* ---------------------------------------------------------------------------------------------
 * The tile: 16 query rows (vector lanes: tokens x the query heads of one key head) against 16 keys
 * at a time, a GEMM-style register tile, with an online softmax (flash attention). */
typedef struct {
    float qt[D * W]; /* [D][16] queries, scaled */
    float ot[D * W]; /* [D][16] values weighted by e^(score - m), not yet divided by sum */
    float tmp[W * D]; /* 16 keys or values widened from bfloat16 */
    vf m, sum, pos;  /* running maximum and sum of weights; each lane's own index (causal part) */
} Tile;

#if defined(__AVX512F__)
/* r[i][j] becomes r[j][i]: 16 rows of 16 floats transposed in registers (pairs of rows interleaved,
 * then fours, then 128-bit lanes across rows 0-7 and 8-15, then across the halves). */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
        r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
    }
}
#endif

/* A tile's queries, scaled, as qt [D][lanes]: lane l is query head head[l] of token tok[l]. With
 * AVX-512, 16 lanes' vectors at a time transposed in registers (element by element, the transposes
 * took 7% of a few-shot prefill tile's time, and writing the outputs back 6%; BENCHMARKS.md). */
static void tile_queries(float *qt, int lanes, const void *q, int64_t q_tok, int64_t q_head, const int64_t *tok,
                         const int64_t *head, float scale, int bf16) {
#if defined(__AVX512F__)
    if (lanes % W == 0) {
        for (int g = 0; g < lanes; g += W)
            for (int c = 0; c < D / W; c++) {
                __m512 r[W];
                for (int l = 0; l < W; l++)
                    r[l] = (__m512)(ld(q, tok[g + l] * q_tok + head[g + l] * q_head + W * c, bf16) * scale);
                transpose16(r);
                for (int i = 0; i < W; i++) st(qt + (W * c + i) * lanes + g, (vf)r[i]);
            }
        return;
    }
#endif
    for (int l = 0; l < lanes; l++)
        for (int c = 0; c < D / W; c++) {
            vf x = ld(q, tok[l] * q_tok + head[l] * q_head + W * c, bf16) * scale;
            for (int i = 0; i < W; i++) qt[(W * c + i) * lanes + l] = x[i];
        }
}

/* Lane l is query head head[l] of token tok[l], at own index pos[l] (ascending). */
static void tile_start(Tile *t, const void *q, int64_t q_tok, int64_t q_head, const int64_t *tok,
                       const int64_t *head, const float *pos, float scale, int bf16) {
    tile_queries(t->qt, W, q, q_tok, q_head, tok, head, scale, bf16);
    memcpy(&t->pos, pos, sizeof t->pos);
    t->m = SPLAT(-1e30f), t->sum = SPLAT(0.0f);
    memset(t->ot, 0, sizeof t->ot);
}

/* Keys or values j0..j0+n of a [len, D] head as float32 rows: in place, or widened into tmp. */
static inline __attribute__((always_inline)) const float *rows_f32(const char *head, int64_t j0, int n, int bf16,
                                                                  float *tmp) {
    if (!bf16) return (const float *)head + j0 * D;
    for (int i = 0; i < n * D; i += W) st(tmp + i, ld(head, j0 * D + i, 1));
    return tmp;
}

enum { NB = 4 }; /* blocks of W keys the prefill tiles fold into their softmax at a time */

/* A group of nb blocks of W keys' scores (block b's at s[b * stride + j], lanes: the tile's queries;
 * its keys j0 + W b + j, the first n[b] of them real) into the running softmax: keys past the end
 * and, when `causal`, keys after a lane's position `pos` get no weight; s becomes the keys' weights,
 * the maximum `m` (one for the group) and the weights' `sum` move on; returns the factor the
 * earlier keys' weighted values must be scaled by (to the new maximum): once a group, not once a
 * block (a multiply between blocks held up the weighted values' chains; BENCHMARKS.md). Shared by
 * the prefill tiles (the bfloat16 dot products' a block at a time). */
static inline __attribute__((always_inline)) vf fold_group(vf *s, int stride, const int *n, int nb, int causal,
                                                           int64_t j0, float first, vf pos, vf *m, vf *sum) {
    vf top = *m;
    for (int b = 0; b < nb; b++) {
        vf *sb = s + b * stride, t[W];
        for (int j = 0; j < W; j++) {
            int64_t key = j0 + W * b + j;
            if (j >= n[b])
                sb[j] = SPLAT(-1e30f);
            else if (causal && key > first)
                sb[j] = causal_cut(sb[j], (float)key, pos);
            t[j] = sb[j];
        }
        /* the maximum as a tree (exact in any order): the exponentials wait on it */
        for (int half = W / 2; half >= 1; half /= 2)
            for (int j = 0; j < half; j++) t[j] = vmax(t[j], t[j + half]);
        top = vmax(top, t[0]);
    }
    vf rescale = exp_neg(*m - top);
    *m = top;
    *sum *= rescale;
    for (int b = 0; b < nb; b++)
        for (int j = 0; j < W; j++) {
            vf *x = s + b * stride + j;
            *x = exp_neg(*x - top);
            *sum += *x;
        }
    return rescale;
}

/* One block's scores s[j] (n real) into the running softmax, as fold_group. */
static inline __attribute__((always_inline)) vf fold_scores(vf *s, int n, int causal, int64_t j0, float first,
                                                            vf pos, vf *m, vf *sum) {
    return fold_group(s, W, &n, 1, causal, j0, first, pos, m, sum);
}

/* The scores s[j] of a block's n keys (lanes: the tile's queries; keys j >= n repeat key 0, masked
 * later). Called with n = W as a constant for whole blocks, so that the compiler drops the clamp. */
static inline __attribute__((always_inline)) void tile_scores(vf *s, const float *qt, const float *k, int n) {
    for (int j = 0; j < W; j++) s[j] = SPLAT(0.0f);
    for (int i = 0; i < D; i++) {
        vf qi = ld(qt, i * W, 0);
        for (int j = 0; j < W; j++) s[j] = fma16(qi, SPLAT(k[(j < n ? j : 0) * D + i]), s[j]);
    }
}

/* ot [D dims][16 lanes] = ot * rescale + the block's n values^T x weights s (n = W a constant for
 * whole blocks: loops of fixed trips). */
static inline __attribute__((always_inline)) void tile_values(float *ot, const vf *s, const float *v, int n,
                                                               vf rescale) {
    for (int c = 0; c < D / W; c++) {
        vf o[W];
        for (int i = 0; i < W; i++) o[i] = ld(ot, (W * c + i) * W, 0) * rescale;
        for (int j = 0; j < n; j++)
            for (int i = 0; i < W; i++) o[i] = fma16(s[j], SPLAT(v[j * D + W * c + i]), o[i]);
        for (int i = 0; i < W; i++) st(ot + (W * c + i) * W, o[i]);
    }
}

/* The tile's lanes against keys/values [0, len) of one head; `causal`: lane l sees keys <= pos[l].
 * NB blocks' scores, then their softmax as one group, then their values (the group's rescale with
 * the first block's; x * 1 is x after it: the wide tile's bits). */
static void tile_keys(Tile *t, const char *keys, const char *values, int64_t len, int causal, int bf16) {
    float first = t->pos[0];
    for (int64_t j0 = 0; j0 < len; j0 += NB * W) {
        vf s[NB][W];
        int n[NB], nb = 0;
        for (; nb < NB && j0 + nb * W < len; nb++) {
            int64_t jb = j0 + nb * W;
            n[nb] = len - jb < W ? (int)(len - jb) : W;
            const float *k = rows_f32(keys, jb, n[nb], bf16, t->tmp);
            /* a whole block with n a constant: no key index to clamp, loops of fixed trips */
            if (n[nb] == W)
                tile_scores(s[nb], t->qt, k, W);
            else
                tile_scores(s[nb], t->qt, k, n[nb]);
        }
        vf rescale = fold_group(s[0], W, n, nb, causal, j0, first, t->pos, &t->m, &t->sum);
        for (int b = 0; b < nb; b++) {
            const float *v = rows_f32(values, j0 + b * W, n[b], bf16, t->tmp);
            vf r = b ? SPLAT(1.0f) : rescale;
            if (n[b] == W)
                tile_values(t->ot, s[b], v, W, r);
            else
                tile_values(t->ot, s[b], v, n[b], r);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * The float32 prefill tile, wide: NH vectors of 16 query rows (48 lanes with AVX-512's 32
 * registers, 32 with AVX2's 16) against the same blocks of 16 keys. Each key element broadcast
 * (scores) and each value element broadcast (weighted values) feeds NH FMAs, one per vector of
 * lanes: 9 loads per 24 FMAs where two vectors have 10 per 16 and the 16-lane tile 17 per 16, and
 * loads bound the tile on a core with two 512-bit FMA ports (BENCHMARKS.md). A segment's last rows
 * take the narrowest tile that holds them (`wide_lanes`: 2 vectors, or the 16-lane tile for one),
 * so few lanes are wasted on rows past its end. Each vector is the 16-lane tile's lanes with the
 * tile's every operation in its order (scores a chain over the dimensions, the softmax folded per
 * block of 16 keys, the values scaled then summed key by key), so its outputs are the same bits as
 * 16-lane tiles'; the multiply-adds are written out so that no contraction differs. The functions
 * take the vectors in use, `nh` (2 or NH), as a constant: each is inlined into `wide_pass_2` and
 * `wide_pass_3`, whose loops then have fixed trips. */
#if defined(__AVX512F__)
#define NH 3
#else
#define NH 2
#endif
enum { PW = NH * W, KH = VREGS >= 32 ? 8 : 4 }; /* lanes of the widest tile; keys (scores) and dimensions (values) per register block */
typedef struct {
    float qt[D * PW]; /* [D][nh W] queries, scaled: vector h in lanes 16h..16h+15 */
    float ot[D * PW]; /* [D][nh W] weighted values, not yet divided by sum */
    vf m[NH], sum[NH], pos[NH]; /* per vector, as in Tile */
} WideTile;

/* Lanes of the tile for a segment's rows from here on (`left` of them): all NH vectors while the
 * rows fill them, else the fewest vectors that hold them (W: the 16-lane tile). */
static int wide_lanes(int64_t left) { return left >= PW ? PW : (int)((left + W - 1) / W) * W; }

static inline __attribute__((always_inline)) void wide_start(WideTile *t, int nh, const float *q, int64_t q_tok,
                                                             int64_t q_head, const int64_t *tok, const int64_t *head,
                                                             const float *pos, float scale) {
    tile_queries(t->qt, nh * W, q, q_tok, q_head, tok, head, scale, 0);
    for (int h = 0; h < nh; h++) {
        memcpy(&t->pos[h], pos + W * h, sizeof(vf));
        t->m[h] = SPLAT(-1e30f), t->sum[h] = SPLAT(0.0f);
    }
    memset(t->ot, 0, sizeof(float) * D * nh * W);
}

/* Every vector's scores s[h][j] of a block's n keys, KH keys at a time (nh KH accumulators); keys
 * j >= n repeat key 0, masked later (n = W a constant for whole blocks). Prefetches into L1
 * meanwhile, one line a step: kl lines at pk in the first KH keys' loop, vl at pv in the second
 * (each at most D). */
static inline __attribute__((always_inline)) void wide_scores(vf s[NH][W], int nh, const float *qt, const float *k,
                                                              int n, const char *pk, int kl, const char *pv, int vl) {
    for (int j0 = 0; j0 < W; j0 += KH) {
        vf a[NH][KH];
        for (int h = 0; h < nh; h++)
            for (int j = 0; j < KH; j++) a[h][j] = SPLAT(0.0f);
        for (int i = 0; i < D; i++) {
            if (j0 == 0 && i < kl) _mm_prefetch(pk + 64 * i, _MM_HINT_T0);
            if (j0 == KH && i < vl) _mm_prefetch(pv + 64 * i, _MM_HINT_T0);
            vf q[NH];
            for (int h = 0; h < nh; h++) {
                q[h] = ld(qt, i * nh * W + W * h, 0);
                IN_REG(q[h]);
            }
            for (int j = 0; j < KH; j++) {
                vf kj = SPLAT(k[(j0 + j < n ? j0 + j : 0) * D + i]);
                for (int h = 0; h < nh; h++) a[h][j] = fma16(q[h], kj, a[h][j]);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int j = 0; j < KH; j++) s[h][j0 + j] = a[h][j];
    }
}

/* ot = ot * r[h] (per vector) + the values^T x weights of nb blocks of n[b] keys (values v: the
 * blocks' rows one after another), KH dimensions at a time, ot read and written once a group: the
 * 16-lane tile's multiply-adds in its order (the same bits). */
static inline __attribute__((always_inline)) void wide_values(float *ot, int nh, vf s[][NH][W], const float *v,
                                                              const int *n, int nb, const vf *r) {
    for (int c = 0; c < D / KH; c++) {
        vf o[NH][KH];
        for (int h = 0; h < nh; h++)
            for (int i = 0; i < KH; i++) o[h][i] = ld(ot, (KH * c + i) * nh * W + W * h, 0) * r[h];
        for (int b = 0; b < nb; b++) {
            const float *vb = v + b * W * D;
            for (int j = 0; j < n[b]; j++) {
                vf sj[NH];
                for (int h = 0; h < nh; h++) {
                    sj[h] = s[b][h][j];
                    IN_REG(sj[h]);
                }
                for (int i = 0; i < KH; i++) {
                    vf vj = SPLAT(vb[j * D + KH * c + i]);
                    for (int h = 0; h < nh; h++) o[h][i] = fma16(sj[h], vj, o[h][i]);
                }
            }
        }
        for (int h = 0; h < nh; h++)
            for (int i = 0; i < KH; i++) st(ot + (KH * c + i) * nh * W + W * h, o[h][i]);
    }
}

/* As tile_keys, for every vector: keys [0, len) of one float32 head; `causal`: lane l sees keys <=
 * pos[l] (a vector past its own last position meets keys that give it no weight, and leaves it as
 * it was). While a block's scores run, the lines of the next group's block of keys and of this
 * block's values come into L1, a line per step of the scores' loop (the rows are whole lines: D %
 * 16 == 0). */
static inline __attribute__((always_inline)) void wide_keys(WideTile *t, int nh, const float *keys,
                                                            const float *values, int64_t len, int causal) {
    for (int64_t j0 = 0; j0 < len; j0 += NB * W) {
        vf s[NB][NH][W], r[NH];
        int n[NB], nb = 0;
        for (; nb < NB && j0 + nb * W < len; nb++) {
            int64_t jb = j0 + nb * W, ka = jb + NB * W < len ? jb + NB * W : len;
            n[nb] = len - jb < W ? (int)(len - jb) : W;
            int kl = (int)((ka + W < len ? W : len - ka) * D / 16), vl = n[nb] * D / 16;
            const char *pk = (const char *)(keys + ka * D), *pv = (const char *)(values + jb * D);
            if (n[nb] == W) /* a whole block: n a constant, no key index to clamp */
                wide_scores(s[nb], nh, t->qt, keys + jb * D, W, pk, kl, pv, vl);
            else
                wide_scores(s[nb], nh, t->qt, keys + jb * D, n[nb], pk, kl, pv, vl);
        }
        for (int h = 0; h < nh; h++)
            r[h] = fold_group(s[0][h], NH * W, n, nb, causal, j0, t->pos[h][0], t->pos[h], &t->m[h], &t->sum[h]);
        wide_values(t->ot, nh, s, values + j0 * D, n, nb, r);
    }
}

/* One item's lanes against its anchor's keys, then its own (nh vectors). */
static inline __attribute__((always_inline)) void wide_pass(WideTile *t, int nh, const float *anchor_k,
                                                            const float *anchor_v, int64_t la, const float *own_k,
                                                            const float *own_v, int64_t own_len) {
    if (la) wide_keys(t, nh, anchor_k, anchor_v, la, 0);
    wide_keys(t, nh, own_k, own_v, own_len, 1);
}
static void wide_pass_2(WideTile *t, const float *ak, const float *av, int64_t la, const float *mk, const float *mv,
                        int64_t len) {
    wide_pass(t, 2, ak, av, la, mk, mv, len);
}
#if NH == 3
static void wide_pass_3(WideTile *t, const float *ak, const float *av, int64_t la, const float *mk, const float *mv,
                        int64_t len) {
    wide_pass(t, 3, ak, av, la, mk, mv, len);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Decode, two phases. A: the rows reading one anchor against its keys, the anchor read once per
 * tile of rows: as matrix products (`block_item`, below) or as the 16-lane tiles prefill uses
 * (`anchor_item`, the reference it is tested against); each lane's partial state (weighted
 * values, maximum, sum) goes to `state`, one per slice of the anchor's keys. B: each (row, key
 * head) against its own keys, one row at a time (each row's keys are its own), then merged with
 * its anchor's states. */
typedef struct {
    int hq, hkv, bf16;
    const void *q;
    int64_t q_tok, q_head;
    const void *own_k, *own_v;
    int64_t cap;
    const int64_t *slot, *own_len, *anc_k, *anc_v, *anc_len; /* per row; anchor pointer 0: none */
    float scale;
    float *out;
    int64_t stride;       /* own scores per query head in B's scratch: the longest row's, padded to W */
    int64_t *order;       /* anchored rows, grouped by anchor */
    int64_t *items;       /* A: (first of the group in `order`, rows in it, key head, first lane, slice, group) */
    float *state;         /* per (slice, row, query head): D weighted values, maximum, sum */
    int n, slices;        /* rows; slices of each anchor's keys (A's items then merged in B) */
    uint16_t *packed;     /* AMX: each group's anchor packed for the tiles, at packed_at[group] */
    int64_t *packed_at, *pack_items; /* pack_items: (group, key head, first key, a row of the group) */
} Decode;

enum { ITEM = 6 }; /* int64s per item of phase A */

/* Item w's lanes: lane l is query head head[l] of row tok[l] (lanes past the group's end repeat its
 * last); returns the lanes that are real. */
static int item_lanes(const Decode *job, int w, int lanes, int64_t *tok, int64_t *head) {
    const int64_t *it = job->items + ITEM * w;
    int64_t first = it[0], count = it[1], h = it[2], r0 = it[3];
    for (int l = 0; l < lanes; l++) {
        int64_t r = r0 + l < count * G ? r0 + l : count * G - 1;
        tok[l] = job->order[first + r / G], head[l] = h * G + r % G;
    }
    return count * G - r0 < lanes ? (int)(count * G - r0) : lanes;
}

/* Keys [j0, j1) of slice `slice` of `len`, starting at multiples of 32 (AMX reads pairs of keys
 * in tiles of 32). */
static void slice_keys(const Decode *job, int64_t slice, int64_t len, int64_t *j0, int64_t *j1) {
    *j0 = len * slice / job->slices / 32 * 32;
    *j1 = slice + 1 == job->slices ? len : len * (slice + 1) / job->slices / 32 * 32;
}

static float *state_of(const Decode *job, int64_t slice, int64_t tok, int64_t head) {
    return job->state + ((slice * job->n + tok) * job->hq + head) * (D + 2);
}

static void anchor_item(const void *arg, int w, void *scratch) {
    const Decode *job = arg;
    Tile *t = scratch;
    int64_t h = job->items[ITEM * w + 2], slice = job->items[ITEM * w + 4], tok[W], head[W], j0, j1;
    float pos[W] = {0};
    int real = item_lanes(job, w, W, tok, head);
    tile_start(t, job->q, job->q_tok, job->q_head, tok, head, pos, job->scale, job->bf16);
    int64_t t0 = tok[0], len = job->anc_len[t0], es = job->bf16 ? 2 : 4;
    slice_keys(job, slice, len, &j0, &j1);
    tile_keys(t, (const char *)job->anc_k[t0] + (h * len + j0) * D * es,
              (const char *)job->anc_v[t0] + (h * len + j0) * D * es, j1 - j0, 0, job->bf16);
    for (int l = 0; l < real; l++) {
        float *dst = state_of(job, slice, tok[l], head[l]);
        for (int i = 0; i < D; i++) dst[i] = t->ot[i * W + l];
        dst[D] = t->m[l], dst[D + 1] = t->sum[l];
    }
}

#include "cpu_anchors.c" /* block_item, amx_item: phase A as matrix products */
#include "cpu_bf16.c"    /* the prefill tile in bfloat16 on AVX-512 BF16 dot products */

#if defined(__AVX512F__)
/* The 16 lane sums of v[0..15], in one vector: a tree of shuffles and adds (15 adds for 16 sums,
 * where a horizontal sum per vector takes 4). Lane l holds the sum of v[SUMS[l]] (pairs swapped:
 * storing key j's vector at v[SUMS[j]] puts its sum at lane j). */
static const int SUMS[W] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

static inline __attribute__((always_inline)) vf lane_sums(const vf *v) {
    vf w[8], z[4], u[2];
    for (int a = 0; a < 8; a++) /* 256-bit halves: key a's in the low half, key a + 8's in the high */
        w[a] = (vf)_mm512_shuffle_f32x4((__m512)v[a], (__m512)v[a + 8], 0x44)
               + (vf)_mm512_shuffle_f32x4((__m512)v[a], (__m512)v[a + 8], 0xee);
    for (int a = 0; a < 4; a++) /* 128-bit quarters */
        z[a] = (vf)_mm512_shuffle_f32x4((__m512)w[a], (__m512)w[a + 4], 0x88)
               + (vf)_mm512_shuffle_f32x4((__m512)w[a], (__m512)w[a + 4], 0xdd);
    for (int a = 0; a < 2; a++) /* pairs of lanes */
        u[a] = (vf)_mm512_shuffle_ps((__m512)z[a], (__m512)z[a + 2], 0x44)
               + (vf)_mm512_shuffle_ps((__m512)z[a], (__m512)z[a + 2], 0xee);
    return (vf)_mm512_shuffle_ps((__m512)u[0], (__m512)u[1], 0x88) + (vf)_mm512_shuffle_ps((__m512)u[0], (__m512)u[1], 0xdd);
}
#else
/* The 8 lane sums of v[0..7] (lane l: v[l]'s), by pairwise adds of neighbours, then the halves. */
static const int SUMS[W] = {0, 1, 2, 3, 4, 5, 6, 7};

static inline __attribute__((always_inline)) vf lane_sums(const vf *v) {
    __m256 a = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]), b = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
    __m256 c = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]), d = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
    __m256 x = _mm256_hadd_ps(a, b), y = _mm256_hadd_ps(c, d);
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}
#endif

enum { AHEAD = 32 }; /* own keys a score or a weighted value fetches ahead */

static void own_item(const void *arg, int w, void *scratch) {
    const Decode *job = arg;
    float *s = scratch;
    int t = w / job->hkv, h = w % job->hkv, bf16 = job->bf16;
    vf qv[G][D / W], o[G][D / W], part[G][W];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / W; c++)
            qv[g][c] = ld(job->q, t * job->q_tok + (int64_t)(h * G + g) * job->q_head + W * c, bf16) * job->scale;
    int64_t lo = job->own_len[t], r0 = (job->slot[t] * job->hkv + h) * job->cap, base = r0 * D; /* its key 0 */
    const char *keys = job->own_k, *values = job->own_v;
    const int64_t row = D * (bf16 ? 2 : 4); /* bytes of a key */
    /* Each row's own keys and values stream from memory every step, and the hardware prefetchers
     * stop at every 4 KB page (16 keys of float32, 32 of bfloat16). So each score fetches the key
     * AHEAD keys on into L1 and its own key's values into L2 (they are read after every score), and
     * each weighted value fetches the values AHEAD keys on into L1: past an item's first AHEAD keys
     * every line is asked for. Before, float32 fetched two lines a page for the prefetchers to
     * carry on from, and bfloat16 the next item's rows into L2: this ran 1.08-1.12x as fast on rows
     * of 150-300 own keys in both dtypes (BENCHMARKS.md). */
    for (int64_t j0 = 0; j0 < lo; j0 += W) { /* 16 keys at a time, each query head's products lane-summed at once */
        for (int j = 0; j < W; j++) {
            if (j0 + j + AHEAD < lo) prefetch_rows(keys, r0 + j0 + j + AHEAD, r0 + j0 + j + AHEAD + 1, row, 1);
            if (j0 + j < lo) prefetch_rows(values, r0 + j0 + j, r0 + j0 + j + 1, row, 0);
            int64_t at = base + (j0 + j < lo ? j0 + j : j0) * D; /* past the end: a real key, masked below */
            vf k[D / W];
            for (int c = 0; c < D / W; c++) k[c] = ld(job->own_k, at + W * c, bf16);
            for (int g = 0; g < G; g++) {
                vf acc = qv[g][0] * k[0];
                for (int c = 1; c < D / W; c++) acc += qv[g][c] * k[c];
                part[g][SUMS[j]] = acc;
            }
        }
        for (int g = 0; g < G; g++) st(s + g * job->stride + j0, lane_sums(part[g]));
    }
    int64_t padded = (lo + W - 1) / W * W;
    float m[G], sum[G];
    for (int g = 0; g < G; g++) {
        float *sg = s + g * job->stride;
        for (int64_t j = lo; j < padded; j++) sg[j] = -1e30f; /* exp gives 0 */
        vf mv = SPLAT(-1e30f), sv = SPLAT(0.0f);
        for (int64_t j = 0; j < padded; j += W) mv = vmax(mv, ld(sg, j, 0));
        m[g] = reduce_max(mv);
        for (int64_t j = 0; j < padded; j += W) {
            vf e = exp_neg(ld(sg, j, 0) - m[g]);
            st(sg + j, e);
            sv += e;
        }
        sum[g] = reduce_add(sv);
        for (int c = 0; c < D / W; c++) o[g][c] = SPLAT(0.0f);
    }
    for (int64_t j = 0; j < lo; j++) {
        if (j + AHEAD < lo) prefetch_rows(values, r0 + j + AHEAD, r0 + j + AHEAD + 1, row, 1);
        vf v[D / W];
        for (int c = 0; c < D / W; c++) v[c] = ld(job->own_v, base + j * D + W * c, bf16);
        for (int g = 0; g < G; g++) {
            float p = s[g * job->stride + j];
            for (int c = 0; c < D / W; c++) o[g][c] += p * v[c];
        }
    }
    for (int g = 0; g < G; g++) {
        int64_t row = (int64_t)t * job->hq + h * G + g;
        float *dst = job->out + row * D, own = 1.0f, total = sum[g];
        vf anchor = SPLAT(0.0f);
        if (job->anc_k[t]) { /* merge with the anchor's partial softmaxes, all scaled to the largest maximum */
            float top = m[g];
            for (int i = 0; i < job->slices; i++) {
                const float *a = state_of(job, i, t, h * G + g);
                top = a[D] > top ? a[D] : top;
            }
            own = exp_neg(SPLAT(m[g] - top))[0];
            total = sum[g] * own;
            for (int c = 0; c < D / W; c++) o[g][c] = o[g][c] * own;
            for (int i = 0; i < job->slices; i++) {
                const float *a = state_of(job, i, t, h * G + g);
                float wa = exp_neg(SPLAT(a[D] - top))[0];
                total += a[D + 1] * wa;
                anchor = SPLAT(wa);
                for (int c = 0; c < D / W; c++) o[g][c] += ld(a, W * c, 0) * anchor;
            }
        }
        for (int c = 0; c < D / W; c++) st(dst + W * c, o[g][c] * (1.0f / total));
    }
}

/* ---------------------------------------------------------------------------------------------
 * Prefill: segment `seg` (tokens t0..t1, at own indices offset.. of row own_index of its own
 * buffer), key head h, lanes r0..r0+15 of its (token, query head) rows, token-major: the
 * anchor's keys, then its own keys up to each token's own index. */
typedef struct {
    int hq, hkv, bf16;
    const void *q;
    int64_t q_tok, q_head;
    const int64_t *t0, *t1, *own_k, *own_v, *own_cap, *own_index, *offset, *anc_k, *anc_v, *anc_len; /* per segment */
    float scale;
    float *out;
    int64_t *items; /* (segment, key head, first lane) */
    int kernel;     /* `PREFILL_*` */
} Prefill;

/* bfloat16 prefill: widened to float32 on the float32 tile, on AVX-512 BF16 dot products (cpu_bf16.c)
 * where the build has them, on AMX tiles (cpu_amx_prefill.c) where the CPU has them and Linux lends them */

static int by_anchor(const void *a, const void *b) { /* (anchor pointer, row or segment) pairs, by anchor */
    const int64_t *x = a, *y = b;
    return x[0] != y[0] ? (x[0] < y[0] ? -1 : 1) : (x[1] > y[1]) - (x[1] < y[1]);
}

#include "cpu_amx_prefill.c" /* amx_prefill: the prefill pass on AMX tiles */

/* Item w of a prefill pass: its segment, key head and first row, the segment's rows, its anchor's
 * keys and where its key head's own keys start (bytes into the own buffer); with `lanes` lanes
 * filled in: lane l is query head head[l] of token tok[l] at own index pos[l] (ascending; lanes past
 * the end repeat the last row, their outputs dropped). */
typedef struct {
    int64_t seg, h, r0, rows, la, own;
} PrefillLanes;

static PrefillLanes prefill_lanes(const Prefill *job, int w, int lanes, int64_t *tok, int64_t *head, float *pos) {
    PrefillLanes p = {job->items[3 * w], job->items[3 * w + 1], job->items[3 * w + 2], 0, 0, 0};
    int64_t t0 = job->t0[p.seg], off = job->offset[p.seg];
    p.rows = (job->t1[p.seg] - t0) * G;
    for (int l = 0; l < lanes; l++) {
        int64_t r = p.r0 + l < p.rows ? p.r0 + l : p.rows - 1;
        tok[l] = t0 + r / G, head[l] = p.h * G + r % G, pos[l] = (float)(off + r / G);
    }
    p.la = job->anc_k[p.seg] ? job->anc_len[p.seg] : 0;
    p.own = (job->own_index[p.seg] * job->hkv + p.h) * job->own_cap[p.seg] * D * (job->bf16 ? 2 : 4);
    return p;
}

/* The first `real` of a prefill tile's `lanes` lanes out: ot [D][lanes] divided by each lane's sum
 * (sum[l / W][l % W]) into out [token][head][D], lane l being query head head[l] of token tok[l]. */
static void tile_out(float *out, int hq, const int64_t *tok, const int64_t *head, const float *ot, int lanes,
                     const vf *sum, int real) {
    real = real < lanes ? real : lanes;
#if defined(__AVX512F__)
    for (int g = 0; g < real; g += W)
        for (int c = 0; c < D / W; c++) {
            __m512 r[W];
            for (int i = 0; i < W; i++) r[i] = (__m512)ld(ot, (W * c + i) * lanes + g, 0);
            transpose16(r); /* r[l]: lane g + l's dimensions W c .. W c + W - 1 */
            for (int l = 0; l < W && g + l < real; l++)
                st(out + (tok[g + l] * hq + head[g + l]) * D + W * c, (vf)r[l] * (1.0f / sum[(g + l) / W][l]));
        }
#else
    for (int l = 0; l < real; l++) {
        float *dst = out + (tok[l] * hq + head[l]) * D, inv = 1.0f / sum[l / W][l % W];
        for (int i = 0; i < D; i++) dst[i] = ot[i * lanes + l] * inv;
    }
#endif
}

static void prefill_item(const void *arg, int w, void *scratch) {
    const Prefill *job = arg;
    Tile *t = scratch;
    int64_t tok[W], head[W], es = job->bf16 ? 2 : 4;
    float pos[W];
    PrefillLanes p = prefill_lanes(job, w, W, tok, head, pos);
    const char *ak = (const char *)job->anc_k[p.seg], *av = (const char *)job->anc_v[p.seg];
    const char *mk = (const char *)job->own_k[p.seg] + p.own, *mv = (const char *)job->own_v[p.seg] + p.own;
#if defined(__AVX512BF16__)
    if (job->bf16 && job->kernel == PREFILL_DOTS) {
        TileBf *b = scratch;
        tile_bf16_start(b, job->q, job->q_tok, job->q_head, tok, head, pos);
        if (p.la)
            tile_bf16_keys(b, (const uint16_t *)ak + p.h * p.la * D, (const uint16_t *)av + p.h * p.la * D, p.la, 0,
                           job->scale);
        tile_bf16_keys(b, (const uint16_t *)mk, (const uint16_t *)mv, (int64_t)pos[W - 1] + 1, 1, job->scale);
        tile_bf16_out(b, job->out, job->hq, tok, head, p.rows - p.r0);
        return;
    }
#endif
    tile_start(t, job->q, job->q_tok, job->q_head, tok, head, pos, job->scale, job->bf16);
    if (p.la)
        tile_keys(t, ak + p.h * p.la * D * es, av + p.h * p.la * D * es, p.la, 0, job->bf16);
    tile_keys(t, mk, mv, (int64_t)pos[W - 1] + 1, 1, job->bf16);
    tile_out(job->out, job->hq, tok, head, t->ot, W, &t->sum, p.rows - p.r0);
}

/* As prefill_item, float32 only, with `wide_lanes` lanes from r0 on: NH or 2 vectors on the wide
 * tile, or one on the 16-lane tile (`prefill_item`). */
static void prefill_wide_item(const void *arg, int w, void *scratch) {
    const Prefill *job = arg;
    int64_t seg = job->items[3 * w], r0 = job->items[3 * w + 2];
    int lanes = wide_lanes((job->t1[seg] - job->t0[seg]) * G - r0), nh = lanes / W;
    if (nh == 1) {
        prefill_item(arg, w, scratch);
        return;
    }
    WideTile *t = scratch;
    int64_t tok[PW], head[PW];
    float pos[PW];
    PrefillLanes p = prefill_lanes(job, w, lanes, tok, head, pos);
    const float *ak = p.la ? (const float *)job->anc_k[p.seg] + p.h * p.la * D : NULL;
    const float *av = p.la ? (const float *)job->anc_v[p.seg] + p.h * p.la * D : NULL;
    const float *mk = (const float *)((const char *)job->own_k[p.seg] + p.own);
    const float *mv = (const float *)((const char *)job->own_v[p.seg] + p.own);
    wide_start(t, nh, job->q, job->q_tok, job->q_head, tok, head, pos, job->scale);
#if NH == 3
    if (nh == 3)
        wide_pass_3(t, ak, av, p.la, mk, mv, (int64_t)pos[lanes - 1] + 1);
    else
#endif
        wide_pass_2(t, ak, av, p.la, mk, mv, (int64_t)pos[lanes - 1] + 1);
    tile_out(job->out, job->hq, tok, head, t->ot, lanes, t->sum, p.rows - p.r0);
}

/* Slices of the anchors' keys for phase A: more items than `items` when they would leave threads
 * idle at the end (as flash decoding splits a long context), each slice at least `least` keys of
 * the shortest anchor. */
static int slices_for(int64_t items, int threads, int64_t shortest, int64_t least) {
    int s = 1;
    for (; s < 8 && shortest / (2 * s) >= least; s *= 2) {
        int64_t n = items * s, rounds = (n + threads - 1) / threads;
        if (10 * rounds * threads <= 11 * n) break; /* threads idle at most a tenth of the pass */
    }
    return s;
}

static int ok(int hq, int hkv, int d, int bf16) { return hkv > 0 && hq == hkv * G && d == D && (bf16 == 0 || bf16 == 1); }
#else
static int ok(int hq, int hkv, int d, int bf16) { return (void)hq, (void)hkv, (void)d, (void)bf16, 0; }
#endif

/* 1 when this build serves the layout: its own head size for keys and values alike and its query
 * heads per key head, float32 (0) or bfloat16 (1), on a CPU with AVX-512. */
int batchgen_supports(int hq, int hkv, int d, int dv, int bf16) { return d == dv && ok(hq, hkv, d, bf16); }

/* The entry points return 0 on success, 1 when the layout is not this build's or no thread got its
 * scratch memory (the caller then uses PyTorch's kernels). */
int batchgen_decode_attention(int n, int hq, int hkv, int d, int bf16, const void *q, int64_t q_tok, int64_t q_head,
                              const void *own_k, const void *own_v, int64_t cap, const int64_t *slot,
                              const int64_t *own_len, const int64_t *anc_k, const int64_t *anc_v,
                              const int64_t *anc_len, float scale, float *out, int threads, int anchors) {
    if (!ok(hq, hkv, d, bf16) || anchors < 0 || anchors > 2) return 1;
#if defined(BATCHGEN_SIMD)
    Decode job = {hq, hkv, bf16, q, q_tok, q_head, own_k, own_v, cap, slot, own_len, anc_k, anc_v, anc_len,
                  scale, out, W, NULL, NULL, NULL, n, 1, NULL, NULL, NULL};
    int64_t *pairs = malloc(sizeof(int64_t) * 2 * (size_t)(n ? n : 1)), anchored = 0, base = 0, shortest = 0;
    int amx = anchors == 1 && bf16 && HAVE_AMX && D % 32 == 0 && amx_usable(), tiles = anchors == 0;
    int lanes = tiles ? W : amx ? 4 * W : LANES, items = 0, groups = 0, packs = 0;
    job.order = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    int failed = !pairs || !job.order;
    for (int t = 0; !failed && t < n; t++) {
        int64_t keys = (own_len[t] + W - 1) / W * W;
        job.stride = keys > job.stride ? keys : job.stride;
        if (anc_k[t]) {
            pairs[2 * anchored] = anc_k[t], pairs[2 * anchored + 1] = t, anchored++;
            shortest = !shortest || anc_len[t] < shortest ? anc_len[t] : shortest;
        }
    }
    if (!failed && anchored) {
        qsort(pairs, (size_t)anchored, 2 * sizeof(int64_t), by_anchor);
        for (int64_t i = 0; i < anchored; i++) job.order[i] = pairs[2 * i + 1];
        for (int64_t first = 0, end; first < anchored; first = end, groups++) {
            for (end = first; end < anchored && pairs[2 * end] == pairs[2 * first]; end++) {}
            base += hkv * (((end - first) * G + lanes - 1) / lanes);
        }
        job.slices = slices_for(base, threads < 1 ? 1 : threads, shortest, tiles ? W : 128);
        job.items = malloc(sizeof(int64_t) * ITEM * (size_t)(base * job.slices));
        job.packed_at = malloc(sizeof(int64_t) * (size_t)(groups + 1));
        failed = !job.items || !job.packed_at;
        int64_t at = 0, g = 0;
        for (int64_t first = 0, end; !failed && first < anchored; first = end, g++) {
            for (end = first; end < anchored && pairs[2 * end] == pairs[2 * first]; end++) {}
            job.packed_at[g] = at;
            at += hkv * (amx ? (anc_len[pairs[2 * first + 1]] + 31) / 32 * 32 * D : 0);
            for (int sl = 0; sl < job.slices; sl++)
                for (int h = 0; h < hkv; h++)
                    for (int64_t r = 0; r < (end - first) * G; r += lanes, items++) {
                        int64_t *it = job.items + ITEM * items;
                        it[0] = first, it[1] = end - first, it[2] = h, it[3] = r, it[4] = sl, it[5] = g;
                    }
        }
        if (!failed && amx) { /* the anchors packed for the tiles, (group, key head, PACK keys) an item */
            job.packed = aligned_alloc(64, ((size_t)at * 2 + 63) / 64 * 64 + 64);
            job.pack_items = malloc(sizeof(int64_t) * 4 * (size_t)(at / (PACK * D) + groups * hkv + 1));
            failed = !job.packed || !job.pack_items;
            int64_t k = 0;
            g = 0;
            for (int64_t first = 0, end; !failed && first < anchored; first = end, g++) {
                for (end = first; end < anchored && pairs[2 * end] == pairs[2 * first]; end++) {}
                int64_t t = pairs[2 * first + 1];
                for (int h = 0; h < hkv; h++)
                    for (int64_t k0 = 0; k0 < anc_len[t]; k0 += PACK, k++) {
                        int64_t *it = job.pack_items + 4 * k;
                        it[0] = g, it[1] = h, it[2] = k0, it[3] = t;
                    }
            }
            packs = (int)k;
        }
    }
    job.state = malloc(sizeof(float) * (size_t)(n ? n : 1) * job.slices * hq * (D + 2));
    failed = failed || !job.state;
#if !(defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__))
    (void)packs; /* amx is 0: nothing was packed */
#else
    if (!failed && amx && items) {
        failed = run(pack_item, &job, packs, 64, threads);
        failed = failed || run(amx_item, &job, items, sizeof(Amx), threads);
    } else
#endif
    if (!failed && items)
        failed = tiles ? run(anchor_item, &job, items, sizeof(Tile), threads)
                       : run(block_item, &job, items, sizeof(Block), threads);
    if (!failed)
        failed = run(own_item, &job, n * hkv, sizeof(float) * G * (size_t)job.stride, threads);
    free(pairs), free(job.order), free(job.items), free(job.state), free(job.packed), free(job.packed_at);
    free(job.pack_items);
    return failed;
#else
    return (void)n, (void)q, (void)q_tok, (void)q_head, (void)own_k, (void)own_v, (void)cap, (void)slot,
           (void)own_len, (void)anc_k, (void)anc_v, (void)anc_len, (void)scale, (void)out, (void)threads,
           (void)anchors, 1;
#endif
}

/* 1 where the bfloat16 anchors go through AMX tiles (`anchors` 1): built for a CPU with them, and
 * Linux lends them to this process. */
int batchgen_amx(void) {
#if defined(BATCHGEN_SIMD)
    return HAVE_AMX && D % 32 == 0 && amx_usable();
#else
    return 0;
#endif
}

/* 1 where this build has the AVX-512 BF16 prefill tile (cpu_bf16.c) and, with `fast_only`, where bfloat16
 * prefill runs on it unless told otherwise: on a CPU that runs the dot products fast (`bf16_dots_fast`). */
int batchgen_bf16_dots(int fast_only) {
#if defined(BATCHGEN_SIMD)
    return TILE_BF16 && (!fast_only || bf16_dots_fast());
#else
    return (void)fast_only, 0;
#endif
}

int batchgen_prefill_attention(int nseg, int hq, int hkv, int d, int bf16, const void *q, int64_t q_tok,
                               int64_t q_head, const int64_t *t0, const int64_t *t1, const int64_t *own_k,
                               const int64_t *own_v, const int64_t *own_cap, const int64_t *own_index,
                               const int64_t *offset, const int64_t *anc_k, const int64_t *anc_v,
                               const int64_t *anc_len, float scale, float *out, int threads, int kernel) {
    if (!ok(hq, hkv, d, bf16) || kernel < PREFILL_WIDEN || kernel > PREFILL_TILE16) return 1;
#if defined(BATCHGEN_SIMD)
    int amx = kernel == PREFILL_AMX;
    if (amx && !(bf16 && batchgen_amx())) return 1; /* asked for tiles this CPU or build does not have */
    int wide = !bf16 && kernel == PREFILL_WIDEN; /* float32 on the wide tile */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    int lanes = amx ? AL : W, items = 0;
#else
    int lanes = W, items = 0; /* (amx was refused above: no tiles in this build) */
#endif
    /* each segment's rows in items of `lanes` (the wide tile: `wide_lanes` of the rows left) */
#define STEP(left) (wide ? wide_lanes(left) : lanes)
    for (int s = 0; s < nseg; s++)
        for (int64_t r = 0, rows = G * (t1[s] - t0[s]); r < rows; r += STEP(rows - r)) items += hkv;
    int64_t *list = malloc(sizeof(int64_t) * 3 * (size_t)(items ? items : 1));
    if (!list) return 1;
    int k = 0;
    for (int s = 0; s < nseg; s++)
        for (int h = 0; h < hkv; h++)
            for (int64_t r = 0, rows = G * (t1[s] - t0[s]); r < rows; r += STEP(rows - r), k++)
                list[3 * k] = s, list[3 * k + 1] = h, list[3 * k + 2] = r;
#undef STEP
    Prefill job = {hq, hkv, bf16, q, q_tok, q_head, t0, t1, own_k, own_v, own_cap, own_index,
                   offset, anc_k, anc_v, anc_len, scale, out, list, kernel};
    int failed;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (amx)
        failed = amx_prefill(&job, nseg, items, threads);
    else
#endif
        failed = wide ? run(prefill_wide_item, &job, items, sizeof(WideTile) > sizeof(Tile) ? sizeof(WideTile) : sizeof(Tile),
                            threads)
                      : run(prefill_item, &job, items, sizeof(Tile), threads);
    free(list);
    return failed;
#else
    return (void)nseg, (void)q, (void)q_tok, (void)q_head, (void)t0, (void)t1, (void)own_k, (void)own_v,
           (void)own_cap, (void)own_index, (void)offset, (void)anc_k, (void)anc_v, (void)anc_len, (void)scale,
           (void)out, (void)threads, (void)kernel, 1;
#endif
}

#include "cpu_layer_ops.c" /* the decoder's norms, gate and rotary; the engine's greedy pick and KV stores */
#include "cpu_gemm.c"      /* the decoder's float32 linear layers */
