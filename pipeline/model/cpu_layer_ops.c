/* The decoder's elementwise work between its matmuls, one pass each where PyTorch makes several:
 *   add_rms_norm: x += r (r may be none), then out = w * rmsnorm(x), transformers' RMSNorm: the
 *     sum of squares in float32, rs = 1 / sqrt(mean + eps), x * rs in float32, cast to the dtype,
 *     then times the weight (PyTorch's bfloat16 product: in float32, rounded once);
 *   silu_mul: g = silu(g) * u in place, silu in float32 cast to the dtype, then the product;
 *   rotary: queries and keys rotated in place, as `decoder._rotate_` computes them.
 * (The engine's greedy pick and KV stores, on the same helpers: cpu_step_ops.c.)
 * PyTorch runs the norm as six ops in bfloat16 (widen, square, mean, scale, narrow, weight), each a
 * pass over the activations, and the MLP's gate as two. Here each row is read once and written
 * once, and to the bit as PyTorch computes it: the squares summed in ATen's order
 * (`sum_squares`), silu's exp as SLEEF's (`sleef_exp`); tests/model/test_layer_ops.py holds both
 * to the PyTorch formulas.
 * Rows x and r are contiguous with h elements, h a multiple of 16; rows are shared out by `run`.
 * Included by cpu_attention.c after `ld`, `st`, `exp_neg` and `run` (not built alone). Built for
 * AVX-512 with its byte/word and 256-bit forms (every AVX-512 CPU since Skylake-X), where they are
 * PyTorch's bits as ATen's AVX-512 kernels compute them, and for AVX2 with FMA, where they are
 * ATen's AVX2 kernels' (the gate's one-by-one tails follow the width of ATen's vectors);
 * `batchgen_layer_ops` says which (2, 1), or 0 where the entry points refuse. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LAYER_OPS 2 /* ATen's CPU capability whose bits these are: 2 AVX-512, 1 AVX2 */
#elif defined(__AVX512F__)
#define LAYER_OPS 0
#elif defined(BATCHGEN_SIMD)
#define LAYER_OPS 1
#else
#define LAYER_OPS 0
#endif
#if LAYER_OPS
#include <math.h>

/* The dtype's value of v: v itself in float32, v rounded to bfloat16 and widened back. */
static inline __attribute__((always_inline)) vf narrow(vf v, int bf16) {
    if (!bf16) return v;
    vu u = __builtin_convertvector(to_bf16(v), vu) << 16;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Products and sums rounded on their own, each as PyTorch's separate ops round them: never fused
 * into a multiply-add by the compiler (AVX-512: the instructions with a rounding mode; AVX2: the
 * value passes through an empty asm, which the compiler cannot see into). */
#if LAYER_OPS == 2
typedef __mmask16 lanes_t; /* a bit per lane */
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) /* rounded, no exceptions: an op the compiler cannot fuse */
static inline __attribute__((always_inline)) vf mul_rn(vf a, vf b) { return (vf)_mm512_mul_round_ps((__m512)a, (__m512)b, RN); }
static inline __attribute__((always_inline)) vf add_rn(vf a, vf b) { return (vf)_mm512_add_round_ps((__m512)a, (__m512)b, RN); }
static inline __attribute__((always_inline)) vi cvt_rn(vf a) { return (vi)_mm512_cvtps_epi32((__m512)a); } /* to nearest */
static inline __attribute__((always_inline)) vf ldm(const void *p, int64_t i, int bf16, lanes_t m) {
    if (!bf16) return (vf)_mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __attribute__((always_inline)) void stm(void *p, int64_t i, vf v, int bf16, lanes_t m) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)p + i, m, (__m512)v);
    } else {
        vh h = to_bf16(v);
        __m256i b;
        memcpy(&b, &h, sizeof b);
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, b);
    }
}
#else
typedef unsigned lanes_t;
static inline __attribute__((always_inline)) vf mul_rn(vf a, vf b) {
    vf p = a * b;
    __asm__("" : "+x"(p));
    return p;
}
static inline __attribute__((always_inline)) vf add_rn(vf a, vf b) {
    vf p = a + b;
    __asm__("" : "+x"(p));
    return p;
}
static inline __attribute__((always_inline)) vi cvt_rn(vf a) { return (vi)_mm256_cvtps_epi32((__m256)a); } /* to nearest */
/* The lanes in m, zeros elsewhere; a whole vector in one load (AVX2 has no masked 16-bit loads:
 * the partial ones, only at a row's or a chunk's end, go lane by lane). */
static inline __attribute__((always_inline)) vf ldm(const void *p, int64_t i, int bf16, lanes_t m) {
    if (m == (1u << W) - 1) return ld(p, i, bf16);
    float f[W] = {0};
    for (int l = 0; l < W; l++)
        if (m >> l & 1 && bf16) {
            uint32_t bits = (uint32_t)((const uint16_t *)p)[i + l] << 16;
            memcpy(f + l, &bits, 4);
        } else if (m >> l & 1) {
            f[l] = ((const float *)p)[i + l];
        }
    vf v;
    memcpy(&v, f, sizeof v);
    return v;
}
static inline __attribute__((always_inline)) void stm(void *p, int64_t i, vf v, int bf16, lanes_t m) {
    if (m == (1u << W) - 1) {
        put(p, i, v, bf16);
        return;
    }
    vh h = to_bf16(v);
    for (int l = 0; l < W; l++)
        if (m >> l & 1) {
            if (bf16) ((uint16_t *)p)[i + l] = h[l];
            else ((float *)p)[i + l] = v[l];
        }
}
#endif
#define ALL_LANES ((lanes_t)((1u << W) - 1))

typedef struct {
    int64_t n, h, rows_per_item;
    int bf16;
    void *x;
    const void *r, *w;
    float eps;
    void *out;
} Norm;

/* The sum of a row's h squares in the order of PyTorch's `x.pow(2).mean(-1)` on a contiguous row:
 * ATen's cascade_sum (SumKernel.cpp) as it runs on x86, its AVX2 build (8-float vectors; ATen
 * dispatches its reductions to AVX2 on AVX-512 machines too): vectors in rows of 4, one
 * accumulator each, carried up a level every 16 rows; vectors past the last whole row into the
 * first accumulator; the 4 in order; the 8 lanes in order. The level step is ATen's
 * max(16, 2^(ceil(log2 rows) / 4)): 16 below 2^19 rows of 32 floats. */
typedef float v8 __attribute__((vector_size(32)));

static float sum_squares(const float *sq, int64_t h) {
    enum { ILP = 4, LEVELS = 4, STEP = 16, L = 8 };
    const int64_t nvec = h / L, rows = nvec / ILP;
    v8 acc[LEVELS][ILP], v;
    memset(acc, 0, sizeof acc);
#define VEC(n) (memcpy(&v, sq + (n) * L, sizeof v), v)
    int64_t i = 0;
    while (i + STEP <= rows) {
        for (int j = 0; j < STEP; j++, i++)
            for (int k = 0; k < ILP; k++) acc[0][k] += VEC(i * ILP + k);
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++) acc[j][k] += acc[j - 1][k], acc[j - 1][k] = (v8){0};
            if (i & ((int64_t)(STEP - 1) << (j * 4))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < ILP; k++) acc[0][k] += VEC(i * ILP + k);
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++) acc[0][k] += acc[j][k];
    for (int64_t n = rows * ILP; n < nvec; n++) acc[0][0] += VEC(n);
#undef VEC
    v8 total = acc[0][0];
    for (int k = 1; k < ILP; k++) total += acc[0][k];
    float sum = 0.0f;
    for (int64_t e = nvec * L; e < h; e++) sum += sq[e];
    for (int l = 0; l < L; l++) sum += total[l];
    return sum;
}

static void norm_item(const void *job, int item, void *scratch) {
    const Norm *j = job;
    float *sq = scratch; /* the row's squares */
    const int64_t bytes = j->bf16 ? 2 : 4;
    int64_t first = item * j->rows_per_item, last = first + j->rows_per_item;
    if (last > j->n) last = j->n;
    for (int64_t t = first; t < last; t++) {
        void *x = (char *)j->x + t * j->h * bytes, *out = (char *)j->out + t * j->h * bytes;
        for (int64_t i = 0; i < j->h; i += W) {
            vf v = ld(x, i, j->bf16);
            if (j->r) { /* the residual sum in the dtype, as x += r rounds it */
                v = narrow(v + ld((const char *)j->r + t * j->h * bytes, i, j->bf16), j->bf16);
                put(x, i, v, j->bf16);
            }
            st(sq + i, mul_rn(v, v)); /* rounded before it is summed, as pow(2) rounds it */
        }
        float rs = 1.0f / __builtin_sqrtf(sum_squares(sq, j->h) / (float)j->h + j->eps);
        for (int64_t i = 0; i < j->h; i += W)
            put(out, i, narrow(ld(x, i, j->bf16) * rs, j->bf16) * ld(j->w, i, j->bf16), j->bf16);
    }
}

typedef struct {
    int64_t n, m, per_item, chunk;
    int bf16;
    void *g;
    const void *u;
} SiluMul;

/* e^d as PyTorch's float32 vectors compute it (SLEEF's expf, u10, the fused multiply-adds of its
 * AVX2 build): round d / ln 2 to n, two-part ln 2 reduction, degree-6 polynomial, times 2^n in
 * two halves; 0 below -104, infinity above 100. One body for both widths: the products and sums
 * PyTorch rounds apart through `mul_rn`/`add_rn`, its multiply-adds through `fma16`. */
static inline __attribute__((always_inline)) vf sleef_exp(vf d) {
    vi q = cvt_rn(mul_rn(d, SPLAT(1.442695040888963407359924681001892137f)));
    vf qf = __builtin_convertvector(q, vf);
    vf r = fma16(qf, SPLAT(-0.693145751953125f), d);
    r = fma16(qf, SPLAT(-1.428606765330187045e-06f), r);
    vf u = SPLAT(0.000198527617612853646278381f);
    u = fma16(u, r, SPLAT(0.00139304355252534151077271f));
    u = fma16(u, r, SPLAT(0.00833336077630519866943359f));
    u = fma16(u, r, SPLAT(0.0416664853692054748535156f));
    u = fma16(u, r, SPLAT(0.166666671633720397949219f));
    u = fma16(u, r, SPLAT(0.5f));
    u = add_rn(SPLAT(1.0f), fma16(mul_rn(r, r), u, r));
    /* times 2^(q >> 1), then 2^(q - (q >> 1)): each a float32 power of two built in its exponent bits */
    vi h = q >> 1;
    u = mul_rn(mul_rn(u, (vf)((h + 127) << 23)), (vf)((q - h + 127) << 23));
    vi small = d < SPLAT(-104.0f), big = SPLAT(100.0f) < d; /* NaN: neither */
    return (vf)(((vi)u & ~small & ~big) | ((vi)SPLAT(__builtin_inff()) & big));
}

/* silu(x) = x / (1 + e^-x), in float32, in the dtype: as PyTorch's vectors compute it */
static inline __attribute__((always_inline)) vf silu_vec(vf x, int bf16) { return narrow(x / (1.0f + sleef_exp(-x)), bf16); }

/* The gate's value: silu(g) * u, as PyTorch's vectors compute it (also the GEMM's gated pass, cpu_gemm.c). */
static inline __attribute__((always_inline)) vf gated(vf g, vf u, int bf16) { return silu_vec(g, bf16) * u; }

/* PyTorch's loop splits the elements into its threads' chunks (`chunk` each, the last shorter) and
 * in each takes two of its vectors (32 floats, 64 bfloat16 with AVX-512; 16 and 32 with AVX2) at a
 * time from the chunk's start, and
 * the elements past the last such pair one by one, with the C library's exp: where element p's
 * chunk's tail starts. */
static inline int64_t tail_start(int64_t p, int64_t chunk, int64_t total, int64_t pair) {
    int64_t s = p / chunk * chunk, e = s + chunk < total ? s + chunk : total;
    return s + (e - s) / pair * pair;
}

static void silu_item(const void *job, int item, void *scratch) {
    const SiluMul *j = job;
    (void)scratch;
    int64_t first = item * j->per_item, last = first + j->per_item, total = j->n * j->m;
    if (last > total) last = total;
    const int64_t pair = j->bf16 ? 4 * W : 2 * W;
    int64_t end = -1, tail = 0; /* the chunk of i: its end and where its tail starts */
    for (int64_t i = first; i < last; i += W) {
        if (i >= end) {
            end = (i / j->chunk + 1) * j->chunk < total ? (i / j->chunk + 1) * j->chunk : total;
            tail = tail_start(i, j->chunk, total, pair);
        }
        if (i + 2 * W <= tail && i + 2 * W <= last) { /* two whole vectors, independent: as PyTorch's loop */
            vf x0 = ld(j->g, i, j->bf16), x1 = ld(j->g, i + W, j->bf16);
            put(j->g, i, gated(x0, ld(j->u, i, j->bf16), j->bf16), j->bf16);
            put(j->g, i + W, gated(x1, ld(j->u, i + W, j->bf16), j->bf16), j->bf16);
            i += W;
            continue;
        }
        lanes_t vec = ALL_LANES; /* the lanes PyTorch computes in its vectors */
        if (i + W > tail) /* near the tail, or across the chunk's end (tail <= end): lane by lane */
            for (int l = 0; l < W; l++)
                if (i + l >= tail_start(i + l, j->chunk, total, pair)) vec &= (lanes_t)~(1u << l);
        vf x = ldm(j->g, i, j->bf16, vec);
        stm(j->g, i, gated(x, ldm(j->u, i, j->bf16, vec), j->bf16), j->bf16, vec);
        for (int l = 0; l < W; l++) {
            if (vec >> l & 1) continue;
            if (!j->bf16) {
                float v = ((float *)j->g)[i + l];
                ((float *)j->g)[i + l] = v / (1.0f + expf(-v)) * ((const float *)j->u)[i + l];
            } else {
                uint16_t *g = (uint16_t *)j->g + i + l;
                uint32_t bits = (uint32_t)*g << 16, ub = (uint32_t)((const uint16_t *)j->u)[i + l] << 16;
                float v, u;
                memcpy(&v, &bits, 4), memcpy(&u, &ub, 4);
                *g = to_bf16(narrow(SPLAT(v / (1.0f + expf(-v))), 1) * SPLAT(u))[0];
            }
        }
    }
}

/* Rotary embeddings in place on x (T, heads, D), strides (x_tok, x_head, 1), from the forward's
 * gathered tables cos, sin (T, D) (sin's first half negated): as `decoder._rotate_` computes it,
 * x * cos + (x's halves swapped) * sin, each product and the sum rounded to the dtype (products
 * the compiler must not fuse into one multiply-add). */
typedef struct {
    int64_t t, heads, d, x_tok, x_head, tokens_per_item;
    int bf16;
    void *x;
    const void *cos, *sin;
} Rotary;

static void rotary_item(const void *job, int item, void *scratch) {
    const Rotary *j = job;
    (void)scratch;
    const int64_t half = j->d / 2, bytes = j->bf16 ? 2 : 4;
    int64_t first = item * j->tokens_per_item, last = first + j->tokens_per_item;
    if (last > j->t) last = j->t;
    for (int64_t t = first; t < last; t++) {
        const char *c = (const char *)j->cos + t * j->d * bytes, *s = (const char *)j->sin + t * j->d * bytes;
        for (int64_t h = 0; h < j->heads; h++) {
            char *x = (char *)j->x + (t * j->x_tok + h * j->x_head) * bytes;
            for (int64_t i = 0; i < half; i += W) {
                lanes_t m = half - i >= W ? ALL_LANES : (lanes_t)((1u << (half - i)) - 1);
                vf x1 = ldm(x, i, j->bf16, m), x2 = ldm(x, i + half, j->bf16, m);
                vf a1 = narrow(mul_rn(x1, ldm(c, i, j->bf16, m)), j->bf16);
                vf b1 = narrow(mul_rn(x2, ldm(s, i, j->bf16, m)), j->bf16);
                vf a2 = narrow(mul_rn(x2, ldm(c, i + half, j->bf16, m)), j->bf16);
                vf b2 = narrow(mul_rn(x1, ldm(s, i + half, j->bf16, m)), j->bf16);
                stm(x, i, add_rn(a1, b1), j->bf16, m);
                stm(x, i + half, add_rn(a2, b2), j->bf16, m);
            }
        }
    }
}

/* Rows (or elements) per work item: about 16k elements, so a decode step's few rows stay on one thread. */
static int64_t per_item(int64_t width) { return width >= 16384 ? 1 : 16384 / width; }
#endif

int batchgen_add_rms_norm(int64_t n, int64_t h, int bf16, void *x, const void *r, const void *w, float eps,
                          void *out, int threads) {
#if LAYER_OPS
    if (h % W || n < 0) return 1;
    Norm job = {n, h, per_item(h), bf16, x, r, w, eps, out};
    int64_t items = (n + job.rows_per_item - 1) / job.rows_per_item;
    return run(norm_item, &job, (int)items, (size_t)h * sizeof(float), items > 1 ? threads : 1);
#else
    return (void)n, (void)h, (void)bf16, (void)x, (void)r, (void)w, (void)eps, (void)out, (void)threads, 1;
#endif
}

int batchgen_silu_mul(int64_t n, int64_t m, int bf16, void *g, const void *u, int64_t chunk, int threads) {
#if LAYER_OPS
    if (m % W || n < 0 || chunk < 1) return 1;
    SiluMul job = {n, m, 16384, chunk, bf16, g, u};
    int64_t items = (n * m + job.per_item - 1) / job.per_item;
    return run(silu_item, &job, (int)items, 64, items > 1 ? threads : 1);
#else
    return (void)n, (void)m, (void)bf16, (void)g, (void)u, (void)chunk, (void)threads, 1;
#endif
}

int batchgen_rotary(int64_t t, int64_t heads, int64_t d, int bf16, void *x, int64_t x_tok, int64_t x_head,
                    const void *cos, const void *sin, int threads) {
#if LAYER_OPS
    if (d % 2 || t < 0) return 1;
    int64_t per = per_item(heads * d);
    Rotary job = {t, heads, d, x_tok, x_head, per, bf16, x, cos, sin};
    int64_t items = (t + per - 1) / per;
    return run(rotary_item, &job, (int)items, 64, items > 1 ? threads : 1);
#else
    return (void)t, (void)heads, (void)d, (void)bf16, (void)x, (void)x_tok, (void)x_head, (void)cos, (void)sin,
           (void)threads, 1;
#endif
}

int batchgen_layer_ops(void) { return LAYER_OPS; }
