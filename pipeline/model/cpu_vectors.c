/* The vectors the kernels of cpu_attention.c are written in: W floats (16 with AVX-512, 8 with AVX2
 * and FMA) and what each instruction set gives them, their loads and stores (bfloat16 widened), the
 * softmax's exponential and the prefetch of rows. Included by cpu_attention.c after its configuration
 * (not built alone). */
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

/* W float32 to bfloat16, rounded to nearest even (NaN kept a NaN), as PyTorch's cast rounds. */
static inline __attribute__((always_inline)) vh to_bf16(vf f) {
#if defined(__AVX512BF16__)
    __m256bh b = _mm512_cvtneps_pbh((__m512)f); /* the instruction rounds the same way */
    vh h;
    memcpy(&h, &b, sizeof h);
    return h;
#else
    vu u;
    memcpy(&u, &f, sizeof u);
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    vu bits = (rounded & ~nan) | ((u >> 16 | 0x40u) & nan);
    return __builtin_convertvector(bits, vh);
#endif
}

/* Stores W floats at p[i] in the dtype: float32 as they are, or rounded to bfloat16. */
static inline __attribute__((always_inline)) void put(void *p, int64_t i, vf v, int bf16) {
    if (!bf16) {
        memcpy((float *)p + i, &v, sizeof v);
    } else {
        vh h = to_bf16(v);
        memcpy((uint16_t *)p + i, &h, sizeof h);
    }
}

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
#endif /* BATCHGEN_SIMD */
