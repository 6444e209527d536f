/* batchgen's attention kernels for CPUs: every token of a forward against its row's cached prefix
 * (the anchor, shared with other rows) and then its own keys, in one pass, final (no partial
 * softmaxes to merge).
 *
 * Why kernels of our own: PyTorch's CPU kernels run this at 76-95 GFLOP/s in prefill (padded
 * batches of suffixes, a second call per anchor, gathers and a log-sum-exp merge around them) and
 * read a decoding row's keys at 8-9 GB/s (each row a tiny GEMM). Here:
 * - decode (one query per row): each (row, key head) reads its keys once for all the query heads
 *   that share them, then its values once, with queries and outputs in vector registers;
 * - prefill (a run of tokens continuing one sequence): 16 query rows (tokens x the query heads of
 *   one key head) at a time, a GEMM-style register tile against 16 keys at a time, online softmax
 *   (flash attention), causal by own index, no padding.
 *
 * Built by pipeline/native.py with the machine's C compiler (-march=native) for one head layout
 * (-DBATCHGEN_G query heads per key head, -DBATCHGEN_D head size): plain C with GCC/Clang vector
 * extensions of 16 floats, no Python or torch headers. Only for CPUs with AVX-512: on AVX2 these
 * 16-float vectors spill (the decode kernel ran 9x slower), so there it compiles to entry points
 * that refuse and the engine keeps PyTorch's kernels. Threads come from torch's OpenMP runtime
 * when built with -fopenmp (its threads still spin after torch's last op: new threads would fight
 * them for the cores), else from pthreads.
 *
 * Layouts (elements of the KV dtype, float32 or bfloat16, row-major):
 *   q           [T, Hq, D] with strides (q_tok, q_head, 1)
 *   own k/v     [rows, Hkv, cap, D] contiguous: a batch's row slots, or a prefix being prefilled
 *   anchor k/v  [1, Hkv, len, D]    contiguous, or none (pointer 0)
 *   out         [T, Hq, D] float32, contiguous
 * Scores, softmax and sums in float32, as PyTorch's kernels compute them. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(BATCHGEN_G) || !defined(BATCHGEN_D)
#error "build with -DBATCHGEN_G=<query heads per key head> -DBATCHGEN_D=<head size>"
#endif
#define G BATCHGEN_G
#define D BATCHGEN_D
enum { W = 16 }; /* floats per vector; keys per prefill tile */
_Static_assert(D % W == 0 && D <= 8 * W && G >= 1 && G <= 8, "head size 16-128 in steps of 16, 1-8 query heads a key head");

/* Work items shared by the threads of one call. */
typedef struct {
    int items, next, done;
} Work;

#if defined(__AVX512F__)
#include <immintrin.h>

typedef float vf __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));
#define SPLAT(x) ((vf){0} + (x))

/* 16 elements from p[i] as float32: plain, or bfloat16 widened (its bits are float32's top half). */
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

/* e^x for x <= 0, 0 below -87 (Cephes' expf: range reduction by ln 2, degree-6 polynomial). */
static inline __attribute__((always_inline)) vf exp_neg(vf x) {
    __mmask16 tiny = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = (vf)_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f));
    vf n = (vf)_mm512_floor_ps((__m512)(x * 1.44269504088896341f + 0.5f));
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
            + 1.6666665459e-1f) * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32((__m512)n), _mm512_set1_epi32(127)), 23);
    return (vf)_mm512_maskz_mul_ps(~tiny, (__m512)y, _mm512_castsi512_ps(e));
}

static int take(Work *w) {
    int i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
    return i < w->items ? i : -1;
}

/* ---------------------------------------------------------------------------------------------
 * Decode: row t's G query heads of key head h over its anchor's keys, then its slot's own. */
typedef struct {
    Work work;
    int hq, hkv, bf16;
    const void *q;
    int64_t q_tok, q_head;
    const void *own_k, *own_v;
    int64_t cap;
    const int64_t *slot, *own_len, *anc_k, *anc_v, *anc_len; /* per row; anchor pointer 0: none */
    float scale;
    float *out;
    int64_t stride; /* scores per query head in the scratch: the most keys of any row, padded to W */
} Decode;

static void decode_item(const Decode *job, int w, float *s) {
    int t = w / job->hkv, h = w % job->hkv, bf16 = job->bf16;
    vf qv[G][D / W], o[G][D / W];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / W; c++)
            qv[g][c] = ld(job->q, t * job->q_tok + (int64_t)(h * G + g) * job->q_head + W * c, bf16) * job->scale;
    int64_t la = job->anc_k[t] ? job->anc_len[t] : 0, lo = job->own_len[t], total = la + lo;
    const void *kp[2] = {(const void *)job->anc_k[t], job->own_k}, *vp[2] = {(const void *)job->anc_v[t], job->own_v};
    int64_t base[2] = {h * la * D, (job->slot[t] * job->hkv + h) * job->cap * D}, len[2] = {la, lo}, at[2] = {0, la};
    for (int part = 0; part < 2; part++)
        for (int64_t j = 0; j < len[part]; j++) {
            vf k[D / W];
            for (int c = 0; c < D / W; c++) k[c] = ld(kp[part], base[part] + j * D + W * c, bf16);
            for (int g = 0; g < G; g++) {
                vf acc = qv[g][0] * k[0];
                for (int c = 1; c < D / W; c++) acc += qv[g][c] * k[c];
                s[g * job->stride + at[part] + j] = _mm512_reduce_add_ps((__m512)acc);
            }
        }
    int64_t padded = (total + W - 1) / W * W;
    float sums[G];
    for (int g = 0; g < G; g++) {
        float *sg = s + g * job->stride;
        for (int64_t j = total; j < padded; j++) sg[j] = -1e30f; /* exp gives 0 */
        vf m = SPLAT(-1e30f), sum = SPLAT(0.0f);
        for (int64_t j = 0; j < padded; j += W) m = (vf)_mm512_max_ps((__m512)m, (__m512)ld(sg, j, 0));
        vf mx = SPLAT(_mm512_reduce_max_ps((__m512)m));
        for (int64_t j = 0; j < padded; j += W) {
            vf e = exp_neg(ld(sg, j, 0) - mx);
            st(sg + j, e);
            sum += e;
        }
        sums[g] = _mm512_reduce_add_ps((__m512)sum);
        for (int c = 0; c < D / W; c++) o[g][c] = SPLAT(0.0f);
    }
    for (int part = 0; part < 2; part++)
        for (int64_t j = 0; j < len[part]; j++) {
            vf v[D / W];
            for (int c = 0; c < D / W; c++) v[c] = ld(vp[part], base[part] + j * D + W * c, bf16);
            for (int g = 0; g < G; g++) {
                float p = s[g * job->stride + at[part] + j];
                for (int c = 0; c < D / W; c++) o[g][c] += p * v[c];
            }
        }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / W; c++)
            st(job->out + ((int64_t)t * job->hq + h * G + g) * D + W * c, o[g][c] * (1.0f / sums[g]));
}

static void *decode_worker(void *arg) {
    Decode *job = arg;
    float *scratch = malloc(sizeof(float) * G * (size_t)job->stride);
    if (!scratch) return NULL; /* this thread takes no items: the others do them */
    for (int w; (w = take(&job->work)) >= 0; __atomic_fetch_add(&job->work.done, 1, __ATOMIC_RELAXED))
        decode_item(job, w, scratch);
    free(scratch);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Prefill: segment `seg` (tokens t0..t1, own indices offset.. of row own_index of its own
 * buffer), key head h, query rows r0..r0+15 of its (token, query head) rows, token-major. */
typedef struct {
    Work work;
    int hq, hkv, bf16;
    const void *q;
    int64_t q_tok, q_head;
    const int64_t *t0, *t1, *own_k, *own_v, *own_cap, *own_index, *offset, *anc_k, *anc_v, *anc_len; /* per segment */
    float scale;
    float *out;
    int64_t *items; /* (segment, key head, first row) */
} Prefill;

/* Keys or values j0..j0+n of a [len, D] head as float32 rows: in place, or bfloat16 widened into tmp. */
static inline __attribute__((always_inline)) const float *rows_f32(const void *head, int64_t j0, int n, int bf16,
                                                                  float *tmp) {
    if (!bf16) return (const float *)head + j0 * D;
    for (int i = 0; i < n * D; i += W) st(tmp + i, ld(head, j0 * D + i, 1));
    return tmp;
}

static void prefill_item(const Prefill *job, int w, float *scratch) {
    int64_t seg = job->items[3 * w], h = job->items[3 * w + 1], r0 = job->items[3 * w + 2];
    int64_t t0 = job->t0[seg], rows = (job->t1[seg] - t0) * G, off = job->offset[seg];
    int bf16 = job->bf16;
    float *qt = scratch, *ot = qt + D * W, *tmp = ot + D * W; /* queries and outputs [D][16 rows]; tmp [16][D] */
    float posf[W];
    int64_t tok[W], head[W];
    for (int l = 0; l < W; l++) { /* rows past the end repeat the last one; their outputs are dropped */
        int64_t r = r0 + l < rows ? r0 + l : rows - 1;
        tok[l] = t0 + r / G, head[l] = h * G + r % G, posf[l] = (float)(off + r / G);
        for (int c = 0; c < D / W; c++) {
            vf x = ld(job->q, tok[l] * job->q_tok + head[l] * job->q_head + W * c, bf16) * job->scale;
            for (int i = 0; i < W; i++) qt[(W * c + i) * W + l] = x[i];
        }
    }
    vf pos, m = SPLAT(-1e30f), sum = SPLAT(0.0f);
    memcpy(&pos, posf, sizeof pos);
    memset(ot, 0, sizeof(float) * D * W);
    int64_t la = job->anc_k[seg] ? job->anc_len[seg] : 0, cap = job->own_cap[seg], es = bf16 ? 2 : 4;
    const char *kp[2] = {(const char *)job->anc_k[seg] + h * la * D * es,
                         (const char *)job->own_k[seg] + (job->own_index[seg] * job->hkv + h) * cap * D * es};
    const char *vp[2] = {(const char *)job->anc_v[seg] + h * la * D * es,
                         (const char *)job->own_v[seg] + (job->own_index[seg] * job->hkv + h) * cap * D * es};
    int64_t len[2] = {la, (int64_t)posf[W - 1] + 1}; /* own keys up to the last row's (rows ascend) */
    for (int part = 0; part < 2; part++)
        for (int64_t j0 = 0; j0 < len[part]; j0 += W) {
            int n = len[part] - j0 < W ? (int)(len[part] - j0) : W;
            /* scores of 16 rows (lanes) against keys j0..j0+n: a 16 x 16 register tile */
            const float *k = rows_f32(kp[part], j0, n, bf16, tmp);
            vf s[W];
            for (int j = 0; j < W; j++) s[j] = SPLAT(0.0f);
            for (int i = 0; i < D; i++) {
                vf qi = ld(qt, i * W, 0);
                for (int j = 0; j < W; j++) s[j] += qi * k[(j < n ? j : 0) * D + i];
            }
            vf top = m;
            for (int j = 0; j < W; j++) {
                if (j >= n)
                    s[j] = SPLAT(-1e30f);
                else if (part == 1 && j0 + j > (int64_t)posf[0]) /* causal: row l sees own keys <= pos[l] */
                    s[j] = (vf)_mm512_mask_blend_ps(_mm512_cmp_ps_mask((__m512)SPLAT((float)(j0 + j)), (__m512)pos,
                                                                       _CMP_GT_OQ),
                                                    (__m512)s[j], _mm512_set1_ps(-1e30f));
                top = (vf)_mm512_max_ps((__m512)top, (__m512)s[j]);
            }
            vf rescale = exp_neg(m - top); /* online softmax: earlier keys' weights, to the new maximum */
            m = top;
            sum *= rescale;
            for (int j = 0; j < W; j++) {
                s[j] = exp_neg(s[j] - m);
                sum += s[j];
            }
            const float *v = rows_f32(vp[part], j0, n, bf16, tmp);
            for (int c = 0; c < D / W; c++) { /* outputs [16 dims][16 rows] += values^T x weights */
                vf o[W];
                for (int i = 0; i < W; i++) o[i] = ld(ot, (W * c + i) * W, 0) * rescale;
                for (int j = 0; j < n; j++)
                    for (int i = 0; i < W; i++) o[i] += s[j] * v[j * D + W * c + i];
                for (int i = 0; i < W; i++) st(ot + (W * c + i) * W, o[i]);
            }
        }
    for (int l = 0; l < W && r0 + l < rows; l++) {
        float *dst = job->out + (tok[l] * job->hq + head[l]) * D, inv = 1.0f / sum[l];
        for (int i = 0; i < D; i++) dst[i] = ot[i * W + l] * inv;
    }
}

static void *prefill_worker(void *arg) {
    Prefill *job = arg;
    float *scratch = malloc(sizeof(float) * 3 * D * W);
    if (!scratch) return NULL;
    for (int w; (w = take(&job->work)) >= 0; __atomic_fetch_add(&job->work.done, 1, __ATOMIC_RELAXED))
        prefill_item(job, w, scratch);
    free(scratch);
    return NULL;
}

/* Runs `worker` on `threads` threads (the caller's among them); 0 when every item was done. */
static int run(void *(*worker)(void *), void *job, Work *work, int threads) {
    threads = threads < 1 ? 1 : threads > work->items ? work->items : threads;
    if (threads < 1) return 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    worker(job);
#else
    pthread_t ids[threads];
    int started = 0;
    for (; started < threads - 1; started++)
        if (pthread_create(&ids[started], NULL, worker, job)) break;
    worker(job);
    for (int i = 0; i < started; i++) pthread_join(ids[i], NULL);
#endif
    return work->done != work->items;
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
                              const int64_t *anc_len, float scale, float *out, int threads) {
    if (!ok(hq, hkv, d, bf16)) return 1;
#if defined(__AVX512F__)
    Decode job = {{n * hkv, 0, 0}, hq, hkv, bf16, q, q_tok, q_head, own_k, own_v, cap, slot, own_len,
                  anc_k, anc_v, anc_len, scale, out, W};
    for (int t = 0; t < n; t++) {
        int64_t keys = (own_len[t] + (anc_k[t] ? anc_len[t] : 0) + W - 1) / W * W;
        job.stride = keys > job.stride ? keys : job.stride;
    }
    return run(decode_worker, &job, &job.work, threads);
#else
    return (void)n, (void)q, (void)q_tok, (void)q_head, (void)own_k, (void)own_v, (void)cap, (void)slot,
           (void)own_len, (void)anc_k, (void)anc_v, (void)anc_len, (void)scale, (void)out, (void)threads, 1;
#endif
}

int batchgen_prefill_attention(int nseg, int hq, int hkv, int d, int bf16, const void *q, int64_t q_tok,
                               int64_t q_head, const int64_t *t0, const int64_t *t1, const int64_t *own_k,
                               const int64_t *own_v, const int64_t *own_cap, const int64_t *own_index,
                               const int64_t *offset, const int64_t *anc_k, const int64_t *anc_v,
                               const int64_t *anc_len, float scale, float *out, int threads) {
    if (!ok(hq, hkv, d, bf16)) return 1;
#if defined(__AVX512F__)
    int items = 0;
    for (int s = 0; s < nseg; s++) items += hkv * (int)((G * (t1[s] - t0[s]) + W - 1) / W);
    int64_t *list = malloc(sizeof(int64_t) * 3 * (size_t)(items ? items : 1));
    if (!list) return 1;
    int k = 0;
    for (int s = 0; s < nseg; s++)
        for (int64_t r = 0; r < G * (t1[s] - t0[s]); r += W)
            for (int h = 0; h < hkv; h++, k++) list[3 * k] = s, list[3 * k + 1] = h, list[3 * k + 2] = r;
    Prefill job = {{items, 0, 0}, hq, hkv, bf16, q, q_tok, q_head, t0, t1, own_k, own_v, own_cap, own_index,
                   offset, anc_k, anc_v, anc_len, scale, out, list};
    int failed = run(prefill_worker, &job, &job.work, threads);
    free(list);
    return failed;
#else
    return (void)nseg, (void)q, (void)q_tok, (void)q_head, (void)t0, (void)t1, (void)own_k, (void)own_v,
           (void)own_cap, (void)own_index, (void)offset, (void)anc_k, (void)anc_v, (void)anc_len, (void)scale,
           (void)out, (void)threads, 1;
#endif
}
