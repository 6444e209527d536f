/* Decode attention on a CPU: one query token per row, against its row's cached prefix (the
 * anchor, shared with other rows) and then its own keys (the row's slot), in one pass per layer.
 *
 * Why a kernel of our own: PyTorch's CPU attention kernels read a decoding row's keys at 8-9 GB/s
 * on this machine (1-8 queries per key head and a few hundred keys per row: each row is a tiny GEMM
 * with its own overhead), and the anchor and own parts take two calls and a merge. Here each
 * (row, key head) reads its keys once for all the query heads that share them, and then its
 * values once, with the queries and outputs held in vector registers.
 *
 * Built by pipeline/native.py with the machine's C compiler (-march=native): plain C with GCC/Clang
 * vector extensions of 16 floats, no Python or torch headers. Only for CPUs with AVX-512: on AVX2
 * the same code spills its registers and ran 9x slower here, so there it compiles to nothing and
 * the engine keeps PyTorch's kernels. Threads come from torch's OpenMP runtime when built with
 * -fopenmp, else from pthreads.
 *
 * Layouts (elements of the KV dtype, row-major):
 *   q       [n, Hq, D] with strides (q_tok, q_head, 1)
 *   own k/v [slots, Hkv, cap, D]  contiguous
 *   anchor  [1, Hkv, len, D]      contiguous, one per row or none (pointer 0)
 *   out     [n, Hq, D] float32, contiguous
 * Scores, softmax and sums in float32, as PyTorch's kernels compute them. */
#include <pthread.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

typedef float vf __attribute__((vector_size(64)));     /* 16 floats */
typedef uint16_t vh __attribute__((vector_size(32)));  /* 16 bfloat16 bit patterns */
typedef uint32_t vu __attribute__((vector_size(64)));
enum { W = 16, MAXC = 8, MAXG = 8 }; /* head size up to MAXC * W; up to MAXG query heads per key head */

typedef struct {
    int n, hq, hkv, d, bf16;
    const void *q;
    int64_t q_tok, q_head;
    const void *own_k, *own_v;
    int64_t cap;
    const int64_t *slot, *own_len;          /* per row */
    const int64_t *anc_k, *anc_v, *anc_len; /* per row: data pointers (0: none) and lengths */
    float scale;
    float *out;
    int64_t max_keys;
    int next; /* work counter, shared by the threads */
    int done; /* items computed */
} Job;

typedef void (*ItemFn)(const Job *, int, float *);

#if defined(__AVX512F__)
/* 16 elements from p[i] as float32: plain, or bfloat16 widened (its bits are float32's top half). */
static inline __attribute__((always_inline)) vf ld(const void *p, int64_t i, const int bf16) {
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

static inline __attribute__((always_inline)) float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }

/* e^x for x <= 0 (Cephes' expf: range reduction by ln 2, degree-6 polynomial; about 1 ulp). */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f + 0.5f;
    float n = __builtin_floorf(t);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
               + 1.6666665459e-1f) * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return y * s;
}

/* One (row, key head): its G queries over the anchor's keys and then its own, softmax, values.
 * G, D and the dtype are compile-time constants in each instance (below), so the queries and the
 * output rows stay in registers while each key and value is read once. */
static inline __attribute__((always_inline)) void item(const Job *job, int w, float *s, const int G, const int D,
                                                      const int bf16) {
    const int C = D / W;
    int t = w / job->hkv, h = w % job->hkv;
    vf qv[MAXG][MAXC], o[MAXG][MAXC];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            qv[g][c] = ld(job->q, t * job->q_tok + (int64_t)(h * G + g) * job->q_head + W * c, bf16) * job->scale;
    int64_t la = job->anc_k[t] ? job->anc_len[t] : 0, lo = job->own_len[t], total = la + lo;
    const void *kp[2] = {(const void *)job->anc_k[t], job->own_k};
    const void *vp[2] = {(const void *)job->anc_v[t], job->own_v};
    int64_t base[2] = {h * la * D, (job->slot[t] * job->hkv + h) * job->cap * D}, len[2] = {la, lo}, at[2] = {0, la};
    for (int part = 0; part < 2; part++) {
        for (int64_t j = 0; j < len[part]; j++) {
            vf k[MAXC];
            for (int c = 0; c < C; c++) k[c] = ld(kp[part], base[part] + j * D + W * c, bf16);
            for (int g = 0; g < G; g++) {
                vf acc = qv[g][0] * k[0];
                for (int c = 1; c < C; c++) acc += qv[g][c] * k[c];
                s[g * total + at[part] + j] = hsum(acc);
            }
        }
    }
    float sums[MAXG];
    for (int g = 0; g < G; g++) {
        float *sg = s + g * total, m = sg[0], sum = 0.0f;
        for (int64_t j = 1; j < total; j++) m = sg[j] > m ? sg[j] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < total; j++) {
            float e = exp_neg(sg[j] - m);
            sg[j] = e;
            sum += e;
        }
        sums[g] = sum;
        for (int c = 0; c < C; c++) o[g][c] = (vf){0};
    }
    for (int part = 0; part < 2; part++) {
        for (int64_t j = 0; j < len[part]; j++) {
            vf v[MAXC];
            for (int c = 0; c < C; c++) v[c] = ld(vp[part], base[part] + j * D + W * c, bf16);
            for (int g = 0; g < G; g++) {
                float p = s[g * total + at[part] + j];
                for (int c = 0; c < C; c++) o[g][c] += p * v[c];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *dst = job->out + ((int64_t)t * job->hq + h * G + g) * D, inv = 1.0f / sums[g];
        for (int c = 0; c < C; c++) {
            vf r = o[g][c] * inv;
            memcpy(dst + W * c, &r, sizeof r);
        }
    }
}

#if !defined(BATCHGEN_G) || !defined(BATCHGEN_D)
#error "build with -DBATCHGEN_G=<query heads per key head> -DBATCHGEN_D=<head size>"
#endif
/* One build per layout (pipeline/native.py passes the model's): a second or so to compile, where
 * every layout in one library took ten. */
static void item_f32(const Job *job, int w, float *s) { item(job, w, s, BATCHGEN_G, BATCHGEN_D, 0); }
static void item_bf16(const Job *job, int w, float *s) { item(job, w, s, BATCHGEN_G, BATCHGEN_D, 1); }

static ItemFn item_for(int hq, int hkv, int d, int bf16) {
    _Static_assert(BATCHGEN_D % W == 0 && BATCHGEN_D <= MAXC * W && BATCHGEN_G >= 1 && BATCHGEN_G <= MAXG,
                   "a head size of 16-128 in steps of 16, 1-8 query heads per key head");
    if (hkv < 1 || hq != hkv * BATCHGEN_G || d != BATCHGEN_D) return NULL;
    return bf16 == 0 ? item_f32 : bf16 == 1 ? item_bf16 : NULL;
}
#else
static ItemFn item_for(int hq, int hkv, int d, int bf16) {
    (void)hq, (void)hkv, (void)d, (void)bf16;
    return NULL;
}
#endif

/* 1 when this layout is compiled in (and the CPU has AVX-512): this build's head size for keys and
 * values alike, its query heads per key head, float32 (0) or bfloat16 (1). */
int batchgen_decode_attention_supports(int hq, int hkv, int d, int dv, int bf16) {
    return d == dv && item_for(hq, hkv, d, bf16) != NULL;
}

static void *worker(void *arg) {
    Job *job = (Job *)arg;
    ItemFn fn = item_for(job->hq, job->hkv, job->d, job->bf16);
    float *scores = malloc(sizeof(float) * (size_t)(job->hq / job->hkv) * (size_t)job->max_keys);
    if (!scores) return NULL; /* this worker takes no items: the others do them */
    int items = job->n * job->hkv;
    for (int w; (w = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < items;) {
        fn(job, w, scores);
        __atomic_fetch_add(&job->done, 1, __ATOMIC_RELAXED);
    }
    free(scores);
    return NULL;
}

/* Returns 0 on success; 1 for a layout not compiled in, or when no worker got its scratch memory
 * (the caller then falls back to PyTorch's kernels). */
int batchgen_decode_attention(int n, int hq, int hkv, int d, int bf16, const void *q, int64_t q_tok, int64_t q_head,
                              const void *own_k, const void *own_v, int64_t cap, const int64_t *slot,
                              const int64_t *own_len, const int64_t *anc_k, const int64_t *anc_v,
                              const int64_t *anc_len, float scale, float *out, int threads) {
    if (!item_for(hq, hkv, d, bf16)) return 1;
    Job job = {n, hq, hkv, d, bf16, q, q_tok, q_head, own_k, own_v, cap, slot, own_len,
               anc_k, anc_v, anc_len, scale, out, 1, 0, 0};
    for (int t = 0; t < n; t++) {
        int64_t keys = own_len[t] + (anc_k[t] ? anc_len[t] : 0);
        job.max_keys = keys > job.max_keys ? keys : job.max_keys;
    }
    int items = n * hkv;
    threads = threads < 1 ? 1 : threads > items ? items : threads;
#ifdef _OPENMP
    /* torch's own OpenMP runtime (the loader shares the libgomp.so.1 torch loaded): its threads,
     * still spinning after the last torch op, take this work instead of fighting new threads */
#pragma omp parallel num_threads(threads)
    worker(&job);
#else
    pthread_t ids[threads > 1 ? threads - 1 : 1];
    int started = 0;
    for (; started < threads - 1; started++)
        if (pthread_create(&ids[started], NULL, worker, &job)) break;
    worker(&job);
    for (int i = 0; i < started; i++) pthread_join(ids[i], NULL);
#endif
    return job.done != items;
}
