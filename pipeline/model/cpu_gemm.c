/* The decoder's float32 linear layers: y[m][n] = sum_k x[m][k] w[n][k] (+ b[n]).
 *
 * Why a kernel of our own: at decode's row counts (8-128 rows a step) oneDNN's float32 GEMM ran at
 * 105-175 GFLOP/s on the Xeon measured, against about 220 at thousands of rows: a step's weights
 * stream from memory once, and its kernel waits for them. Here each thread walks its weight panels
 * in order and, while one panel's tiles run, prefetches the next panel into L2 (a few lines per
 * k step), so the stream overlaps the FMAs (BENCHMARKS.md, "float32 linear layers").
 *
 * Layout: the weight is packed once (`batchgen_gemm_pack_parts`) into panels of 48 outputs,
 * [ceil(n / 48)][k][48], zero past n. A tile is 8 rows x 48 outputs in 24 AVX-512 accumulators:
 * per k, 3 loads of the panel, 8 broadcasts of x, 24 FMAs. Rows are taken in blocks (whose x stays in
 * L2 while every panel passes), each thread taking its own range of panels in every block.
 *
 * Each output is a sum of blocks of 128 k steps (each one FMA chain, in order), the blocks added in
 * order, then + bias, whatever the row count, the tiling or the threads: a row's outputs do not
 * depend on the batch it runs in. (One chain over all of k lost up to 2x oneDNN's accuracy at
 * k = 1,536; in blocks it is as accurate as `F.linear`.)
 * With AVX2 (and FMA) a tile is 6 rows x 16 outputs (a third of a panel) in 12 accumulators of 8 floats, each
 * output summed in the same order: the same bits as the AVX-512 tile's, from the same packed panels. A
 * third's k block (8 KB) runs over all the row tiles before the next third, so it stays in L1; the
 * k loop is unrolled by 4; and each thread packs a block's x as [tile][k][6] first, so a tile's
 * broadcasts read one stream (as oneDNN packs both operands; Zen 3 numbers in BENCHMARKS.md).
 * Included by cpu_attention.c after `run` (not built alone); for AVX-512 or AVX2, elsewhere the entry
 * points refuse and `batchgen_gemm_ok` says 0. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define GEMM_BUILT 1
#define GEMM_NR 48 /* outputs of a panel: 3 vectors of 16 (6 of 8) */
#if defined(__AVX512F__)
#define GEMM_MR 8  /* rows of a tile */
#define GEMM_PART 48 /* outputs of a tile: the whole panel */
#define GEMM_PACK_X 0 /* tiles read x's rows where they lie */
#else
#define GEMM_MR 6
#define GEMM_PART 16 /* a third of the panel */
#define GEMM_PACK_X 1 /* tiles read a block's x packed as [tile][k][6] (in the thread's scratch) */
#endif
#define GEMM_KB 128 /* k steps summed in registers, then added to the output's partial sum */

typedef struct {
    const float *x, *p, *bias;
    float *y;
    int64_t m, n, k, ldx, rows; /* rows: of a block */
    int threads;
    const float *up, *up_bias; /* `batchgen_gemm_glu`: y = silu(x p + bias) * (x up + up_bias); else NULL */
} Gemm;

#if defined(__AVX512F__)
/* A tile's k steps [k0, k1) added to its partial sums in y (k0 = 0: they start them), + bias after
 * the last; prefetching `npf` lines from `pf` meanwhile. */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, int64_t ldx, const float *bp, int64_t k0,
                                                            int64_t k1, int last, float *y, int64_t ldy,
                                                            const float *bias, int mr, int64_t cols, const char *pf,
                                                            int64_t npf) {
    /* registers: 24 accumulators, 3 of the panel, 1 of x; the bias and the masks only at the stores */
    int64_t per = k1 > k0 ? (npf + (k1 - k0) - 1) / (k1 - k0) : 0; /* lines to prefetch per k step */
    const char *pe = pf + 64 * npf;
    __m512 c[GEMM_MR][3];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 3; j++) c[i][j] = _mm512_setzero_ps();
    for (int64_t kk = k0; kk < k1; kk++) {
        const float *b = bp + kk * GEMM_NR;
        __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32);
        for (int64_t r = 0; r < per && pf < pe; r++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            __m512 a = _mm512_set1_ps(x[i * ldx + kk]);
            c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
            c[i][2] = _mm512_fmadd_ps(a, b2, c[i][2]);
        }
    }
    for (int j = 0; j < 3; j++) {
        int64_t left = cols - 16 * j;
        __mmask16 mask = left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
        __m512 add = last && bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            float *at = y + i * ldy + 16 * j;
            __m512 v = k0 ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask, at), c[i][j]) : c[i][j];
            if (last && bias) v = _mm512_add_ps(v, add);
            _mm512_mask_storeu_ps(at, mask, v);
        }
    }
}
#else
/* A tile of a third of a panel (16 outputs from bp, 48 floats a k step) for mr rows: `cols` of its
 * outputs are real (16 or more: all). Registers: 12 accumulators, 2 of the panel, 1 of x (BLIS's 6 x 16 on
 * Haswell: with 4 x 24, 16 registers in all, GCC left the panel in memory and the tile ran at 0.6x
 * oneDNN's rate). */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, int64_t ldx, const float *bp, int64_t k0,
                                                            int64_t k1, int last, float *y, int64_t ldy,
                                                            const float *bias, int mr, int64_t cols, const char *pf,
                                                            int64_t npf) {
    (void)ldx; /* x is packed: row i's k step kk at x[kk * 6 + i] */
    int64_t per = k1 > k0 ? (npf + (k1 - k0) - 1) / (k1 - k0) : 0;
    const char *pe = pf + 64 * npf;
    __m256 c[GEMM_MR][2];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 2; j++) c[i][j] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t kk = k0; kk < k1; kk++) {
        const float *b = bp + kk * GEMM_NR;
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        for (int64_t r = 0; r < per && pf < pe; r++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m256 a = _mm256_broadcast_ss(x + kk * GEMM_MR + i);
            c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
        }
    }
    if (cols >= 16) { /* plain loads and stores: AMD runs the masked ones (vmaskmovps) as microcode */
        __m256 add0 = last && bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        __m256 add1 = last && bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            float *at = y + i * ldy;
            __m256 v0 = k0 ? _mm256_add_ps(_mm256_loadu_ps(at), c[i][0]) : c[i][0];
            __m256 v1 = k0 ? _mm256_add_ps(_mm256_loadu_ps(at + 8), c[i][1]) : c[i][1];
            if (last && bias) v0 = _mm256_add_ps(v0, add0), v1 = _mm256_add_ps(v1, add1);
            _mm256_storeu_ps(at, v0);
            _mm256_storeu_ps(at + 8, v1);
        }
        return;
    }
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols), lanes);
    __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols - 8), lanes);
    __m256 add0 = last && bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
    __m256 add1 = last && bias ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) {
        float *at = y + i * ldy;
        __m256 v0 = k0 ? _mm256_add_ps(_mm256_maskload_ps(at, m0), c[i][0]) : c[i][0];
        __m256 v1 = k0 ? _mm256_add_ps(_mm256_maskload_ps(at + 8, m1), c[i][1]) : c[i][1];
        if (last && bias) v0 = _mm256_add_ps(v0, add0), v1 = _mm256_add_ps(v1, add1);
        _mm256_maskstore_ps(at, m0, v0);
        _mm256_maskstore_ps(at + 8, m1, v1);
    }
}

#endif

/* The lines of `rows` rows, `ld` floats apart, `bytes` of each from `at`, fetched ahead (`hint`). */
static inline void gemm_fetch_rows(const float *at, int64_t rows, int64_t ld, int64_t bytes, int hint) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < bytes; c += 64) {
            const char *line = (const char *)(at + r * ld) + c;
            if (hint) _mm_prefetch(line, _MM_HINT_ET0);
            else _mm_prefetch(line, _MM_HINT_T0);
        }
}

/* The rows [i0, i1) (at most one block) against panel pj, a block of k steps at a time across all
 * the tiles (that block of the panel stays in L1); prefetching `npf` lines at `pf` meanwhile.
 * While a tile runs, the next tile's lines that would come from memory are fetched: its outputs
 * in the first k block (fresh memory, written first: each store waited for its line), and, in the
 * thread's `first` panel of the block, its x for this k block (the panels after find the block's x
 * in L2). 1.04-1.06x at 2,048 rows, level at a decode step's (BENCHMARKS.md). */
static void gemm_block(const Gemm *g, int64_t i0, int64_t i1, int64_t pj, const char *pf, int64_t npf, const float *xp,
                       int first, const float *packed, const float *all_bias, float *out, int64_t ldy) {
    /* out: the output of row i0 at the panel's first column, rows ldy floats apart */
    const float *bp = packed + pj * GEMM_NR * g->k;
    int64_t cols = g->n - pj * GEMM_NR < GEMM_NR ? g->n - pj * GEMM_NR : GEMM_NR;
    const float *bias = all_bias ? all_bias + pj * GEMM_NR : NULL;
    int64_t k = g->k, tiles = (i1 - i0 + GEMM_MR - 1) / GEMM_MR, blocks = k ? (k + GEMM_KB - 1) / GEMM_KB : 1;
    int64_t share = (npf + tiles * blocks - 1) / (tiles * blocks), from = 0;
    for (int64_t k0 = 0; k0 < k || k0 == 0; k0 += GEMM_KB) { /* (k = 0: one block, of zeros) */
        int64_t k1 = k0 + GEMM_KB < k ? k0 + GEMM_KB : k;
        int last = k1 >= k;
        for (int64_t t = 0; t * GEMM_PART < cols; t++) { /* a part's k block stays in L1 across the tiles */
            const float *bt = bp + t * GEMM_PART, *bias_t = bias ? bias + t * GEMM_PART : NULL;
            int64_t ct = cols - t * GEMM_PART;
            for (int64_t i = i0; i < i1; i += GEMM_MR) {
                const float *x = GEMM_PACK_X ? xp + (i - i0) * k : g->x + i * g->ldx; /* (i - i0: whole tiles) */
                float *y = out + (i - i0) * ldy + t * GEMM_PART;
                int64_t mine = t || from >= npf ? 0 : npf - from < share ? npf - from : share;
                const char *at = mine ? pf + 64 * from : pf;
                if (!t) from += share;
                if (i + GEMM_MR < i1) {
                    int64_t next = i1 - i - GEMM_MR < GEMM_MR ? i1 - i - GEMM_MR : GEMM_MR; /* its rows */
                    if (k0 == 0) gemm_fetch_rows(y + GEMM_MR * ldy, next, ldy, 4 * (ct < GEMM_PART ? ct : GEMM_PART), 1);
                    if (first && !GEMM_PACK_X) gemm_fetch_rows(x + GEMM_MR * g->ldx + k0, next, g->ldx, 4 * (k1 - k0), 0);
                }
                switch (i1 - i < GEMM_MR ? (int)(i1 - i) : GEMM_MR) { /* each row count its own unrolled tile */
                case 1: gemm_tile(x, g->ldx, bt, k0, k1, last, y, ldy, bias_t, 1, ct, at, mine); break;
                case 2: gemm_tile(x, g->ldx, bt, k0, k1, last, y, ldy, bias_t, 2, ct, at, mine); break;
                case 3: gemm_tile(x, g->ldx, bt, k0, k1, last, y, ldy, bias_t, 3, ct, at, mine); break;
                case 4: gemm_tile(x, g->ldx, bt, k0, k1, last, y, ldy, bias_t, 4, ct, at, mine); break;
                case 5: gemm_tile(x, g->ldx, bt, k0, k1, last, y, ldy, bias_t, 5, ct, at, mine); break;
#if GEMM_MR == 8
                case 6: gemm_tile(x, g->ldx, bt, k0, k1, last, y, ldy, bias_t, 6, ct, at, mine); break;
                case 7: gemm_tile(x, g->ldx, bt, k0, k1, last, y, ldy, bias_t, 7, ct, at, mine); break;
#endif
                default: gemm_tile(x, g->ldx, bt, k0, k1, last, y, ldy, bias_t, GEMM_MR, ct, at, mine); break;
                }
            }
        }
    }
}

/* Threads for n outputs: each takes a range of whole panels (at least one), so no more than panels. */
static int gemm_threads(int threads, int64_t n) {
    int64_t panels = (n + GEMM_NR - 1) / GEMM_NR;
    return threads < 1 || panels < 1 ? 1 : (int64_t)threads > panels ? (int)panels : threads;
}

/* Rows of a block: its x within ~512 KB of L2 (rows of k floats), in whole tiles, at most 128 rows
 * (with AVX2's tiles of 6 a block of 128 ends in a tile of 2 rows: capping at 126 instead took one
 * more pass over the panels at 2,048 rows, 0.92-0.97x). */
static int64_t gemm_rows(int64_t k) {
    int64_t rows = 512 * 1024 / (4 * (k ? k : 1)) / GEMM_MR * GEMM_MR;
    return rows < GEMM_MR ? GEMM_MR : rows > 128 ? 128 : rows;
}

/* A block's rows in whole tiles, as a thread's scratch holds them. */
static int64_t gemm_scratch_rows(const Gemm *g) {
    return ((g->rows < g->m ? g->rows : g->m) + GEMM_MR - 1) / GEMM_MR * GEMM_MR;
}

/* A thread's scratch: a block's x packed (AVX2), then the up projection's panel (`batchgen_gemm_glu`). */
static size_t gemm_scratch(const Gemm *g) {
    int64_t rows = gemm_scratch_rows(g);
    size_t x = GEMM_PACK_X ? (size_t)rows * (size_t)(g->k ? g->k : 1) * sizeof(float) : 0;
    size_t up = g->up ? (size_t)rows * GEMM_NR * sizeof(float) : 0;
    return x + up > 64 ? x + up : 64;
}

/* Thread w's share: its own range of panels in every block of rows, blocks in order. In a block
 * the threads read one x (which stays in L2) against disjoint panels; each thread walks its panels
 * in order, and the next one it needs is the one it prefetches. */
static void gemm_item(const void *arg, int w, void *scratch) {
    const Gemm *g = arg;
    float *xp = scratch;
    int64_t panels = (g->n + GEMM_NR - 1) / GEMM_NR, blocks = (g->m + g->rows - 1) / g->rows;
    int64_t a = panels * w / g->threads, b = panels * (w + 1) / g->threads;
    int64_t lines = GEMM_NR * g->k * (int64_t)sizeof(float) / 64;
    for (int64_t blk = 0; blk < blocks; blk++) {
        int64_t i0 = blk * g->rows, i1 = i0 + g->rows < g->m ? i0 + g->rows : g->m;
#if GEMM_PACK_X
        /* the block's x as tiles of [k][6] (a last tile of mr < 6 rows: its tile reads only mr lanes) */
        for (int64_t row = i0; row < i1; row++) {
            float *to = xp + (row - i0) / GEMM_MR * GEMM_MR * g->k + (row - i0) % GEMM_MR;
            for (int64_t kk = 0; kk < g->k; kk++) to[kk * GEMM_MR] = g->x[row * g->ldx + kk];
        }
#endif
        for (int64_t pj = a; pj < b; pj++) {
            int64_t next = pj + 1 < b ? pj + 1 : a; /* (then the next block's first) */
            const char *pf = pj + 1 < b || blk + 1 < blocks ? (const char *)(g->p + next * GEMM_NR * g->k) : NULL;
            float *y = g->y + i0 * g->n + pj * GEMM_NR;
            if (!g->up) {
                gemm_block(g, i0, i1, pj, pf, pf ? lines : 0, xp, pj == a, g->p, g->bias, y, g->n);
                continue;
            }
#if LAYER_OPS
            /* the gate's panel into y, the up projection's into the thread's scratch (24 KB), then
             * both while they are in cache: y = silu(gate) * up, as `batchgen_silu_mul` computes it */
            float *up = xp + (GEMM_PACK_X ? gemm_scratch_rows(g) * g->k : 0);
            gemm_block(g, i0, i1, pj, (const char *)(g->up + pj * GEMM_NR * g->k), lines, xp, pj == a, g->p, g->bias,
                       y, g->n);
            gemm_block(g, i0, i1, pj, pf, pf ? lines : 0, xp, 0, g->up, g->up_bias, up, GEMM_NR);
            int64_t cols = g->n - pj * GEMM_NR < GEMM_NR ? g->n - pj * GEMM_NR : GEMM_NR; /* a multiple of W */
            for (int64_t i = 0; i < i1 - i0; i++)
                for (int64_t c = 0; c < cols; c += W)
                    put(y + i * g->n, c, gated(ld(y + i * g->n, c, 0), ld(up + i * GEMM_NR, c, 0), 0), 0);
#endif
        }
    }
}

#endif

/* Whether this build has the kernel (AVX-512 or AVX2). */
int batchgen_gemm_ok(void) {
#if defined(GEMM_BUILT)
    return 1;
#else
    return 0;
#endif
}

#if defined(GEMM_BUILT)
typedef struct {
    int64_t parts;              /* the weight's parts, stacked by output: */
    const float *const *w;      /*   each one's rows, */
    const int64_t *rows, *ldw;  /*   how many, how many floats apart */
    float *p;
    int64_t n, k;
    int threads;
} GemmPack;

static void gemm_pack_item(const void *arg, int w, void *scratch) {
    (void)scratch;
    const GemmPack *a = arg;
    int64_t panels = (a->n + GEMM_NR - 1) / GEMM_NR, k = a->k;
    for (int64_t pj = panels * w / a->threads; pj < panels * (w + 1) / a->threads; pj++) {
        float *panel = a->p + pj * GEMM_NR * k;
        int64_t part = 0, first = 0; /* the part holding the panel's first row, and that part's first row */
        for (; part < a->parts && first + a->rows[part] <= pj * GEMM_NR; part++) first += a->rows[part];
        for (int64_t j = 0; j < GEMM_NR; j++) { /* the rows read in order; the panel written 48 apart */
            int64_t row = pj * GEMM_NR + j;
            for (; part < a->parts && row >= first + a->rows[part]; part++) first += a->rows[part];
            const float *src = part < a->parts ? a->w[part] + (row - first) * a->ldw[part] : NULL;
            for (int64_t kk = 0; kk < k; kk++) panel[kk * GEMM_NR + j] = src ? src[kk] : 0.0f;
        }
    }
}
#endif

/* A weight [n][k] in `parts` parts stacked by output (a fused layer's, each where it lies in the
 * checkpoint: no concatenated copy first; part i has rows[i] rows of k floats, ldw[i] apart, at w[i])
 * into p: ceil(n / 48) * 48 * k floats, as the kernel reads them. */
int batchgen_gemm_pack_parts(int64_t parts, const float *const *w, const int64_t *rows, const int64_t *ldw, int64_t k,
                             float *p, int threads) {
#if defined(GEMM_BUILT)
    int64_t n = 0;
    for (int64_t i = 0; i < parts; i++) n += rows[i];
    threads = gemm_threads(threads, n);
    GemmPack a = {parts, w, rows, ldw, p, n, k, threads};
    return run(gemm_pack_item, &a, threads, 64, threads);
#else
    return (void)parts, (void)w, (void)rows, (void)ldw, (void)k, (void)p, (void)threads, 1;
#endif
}

#if defined(GEMM_BUILT)
/* The pass over m > 0 rows and n > 0 outputs, gated where `up` is given (`gemm_item`). */
static int gemm_go(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx, const float *p, const float *bias,
                   const float *up, const float *up_bias, float *y, int threads) {
    Gemm g = {x, p, bias, y, m, n, k, ldx, gemm_rows(k), gemm_threads(threads, n), up, up_bias};
    return run(gemm_item, &g, g.threads, gemm_scratch(&g), g.threads);
}
#endif

/* y [m][n] (contiguous) = x [m][k] (rows ldx apart) times the packed weight, + bias [n] (or none). */
int batchgen_gemm(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx, const float *p, const float *bias,
                  float *y, int threads) {
#if defined(GEMM_BUILT)
    if (m <= 0 || n <= 0) return 0;
    return gemm_go(m, n, k, x, ldx, p, bias, NULL, NULL, y, threads);
#else
    return (void)m, (void)n, (void)k, (void)x, (void)ldx, (void)p, (void)bias, (void)y, (void)threads, 1;
#endif
}

/* A gated MLP's first half in one pass: y [m][n] = silu(x gate + gate_bias) * (x up + up_bias), each
 * weight packed as for `batchgen_gemm`, each product with `batchgen_gemm`'s bits, and the rest as
 * `batchgen_silu_mul(m, n, 0, ..., chunk, ...)` computes it: where that would take some elements one
 * by one (PyTorch's chunks' tails, see cpu_layer_ops.c), -1 and nothing done, for the three passes to
 * run instead. n a multiple of 16. One write of y, where the three passes wrote the gate's and the up
 * projection's outputs and read both back (BENCHMARKS.md). */
int batchgen_gemm_glu(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx, const float *gate,
                      const float *gate_bias, const float *up, const float *up_bias, float *y, int64_t chunk,
                      int threads) {
#if defined(GEMM_BUILT) && LAYER_OPS
    if (m <= 0 || n <= 0) return 0;
    if (n % 16 || chunk < 1) return 1;
    for (int64_t s = 0; s < m * n; s += chunk) /* silu_mul's chunks: no element at or past a tail's start */
        if (tail_start(s, chunk, m * n, 2 * W) < (s + chunk < m * n ? s + chunk : m * n)) return -1;
    return gemm_go(m, n, k, x, ldx, gate, gate_bias, up, up_bias, y, threads);
#else
    return (void)m, (void)n, (void)k, (void)x, (void)ldx, (void)gate, (void)gate_bias, (void)up, (void)up_bias, (void)y,
           (void)chunk, (void)threads, 1;
#endif
}
