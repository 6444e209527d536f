/* Decode attention (`batchgen_decode_attention`): one query per row, against its anchor (the cached
 * prefix it shares with other rows) and then its own keys. Included by cpu_attention.c after the tiles
 * (not built alone); phase A as matrix products is cpu_anchors.c. */
#if defined(BATCHGEN_SIMD)

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
    void *out;            /* float32, or bfloat16 where out_bf16 (rounded as PyTorch's cast rounds) */
    int out_bf16;
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

#include "cpu_anchors.c"     /* block_item: phase A as matrix products in AVX-512 registers */
#include "cpu_amx_anchors.c" /* amx_item: phase A on AMX tiles (bfloat16) */

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
        float own = 1.0f, total = sum[g];
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
        for (int c = 0; c < D / W; c++) put(job->out, row * D + W * c, o[g][c] * (1.0f / total), job->out_bf16);
    }
}

static int by_anchor(const void *a, const void *b) { /* (anchor pointer, row or segment) pairs, by anchor */
    const int64_t *x = a, *y = b;
    return x[0] != y[0] ? (x[0] < y[0] ? -1 : 1) : (x[1] > y[1]) - (x[1] < y[1]);
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
#endif /* BATCHGEN_SIMD */

int batchgen_decode_attention(int n, int hq, int hkv, int d, int bf16, const void *q, int64_t q_tok, int64_t q_head,
                              const void *own_k, const void *own_v, int64_t cap, const int64_t *slot,
                              const int64_t *own_len, const int64_t *anc_k, const int64_t *anc_v,
                              const int64_t *anc_len, float scale, void *out, int threads, int anchors,
                              int out_bf16) {
    if (!ok(hq, hkv, d, bf16) || anchors < 0 || anchors > 2) return 1;
#if defined(BATCHGEN_SIMD)
    Decode job = {hq, hkv, bf16, q, q_tok, q_head, own_k, own_v, cap, slot, own_len, anc_k, anc_v, anc_len,
                  scale, out, out_bf16 != 0, W, NULL, NULL, NULL, n, 1, NULL, NULL, NULL};
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
           (void)anchors, (void)out_bf16, 1;
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
