/* The engine's passes around a step, on cpu_layer_ops.c's helpers:
 *   greedy: each row's argmax and whether it is finite, for the engine's sampling;
 *   store_rows: a step's new keys and values into its rows' slots.
 * Included by cpu_attention.c after cpu_layer_ops.c (its LAYER_OPS, masked loads and `per_item`; not
 * built alone). */
#if LAYER_OPS
/* Each row's first greatest logit (PyTorch's argmax: the first index among equal maxima), and
 * whether the row is all finite (else the engine fails the row), in one pass over float32 logits
 * (n, v) contiguous. */
typedef struct {
    int64_t n, v;
    const float *logits;
    int64_t *best;
    uint8_t *finite;
} Greedy;

#if LAYER_OPS == 2
static void greedy_item(const void *job, int item, void *scratch) {
    const Greedy *j = job;
    (void)scratch;
    const float *row = j->logits + item * j->v;
    __m512 top = _mm512_set1_ps(-__builtin_inff());
    __m512i at = _mm512_set1_epi32(0), lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 bad = 0, seen = 0;
    const __m512i expo = _mm512_set1_epi32(0x7f800000);
    for (int64_t i = 0; i < j->v; i += W) {
        __mmask16 m = j->v - i >= W ? 0xffff : (__mmask16)((1u << (j->v - i)) - 1);
        __m512 x = _mm512_maskz_loadu_ps(m, row + i);
        bad |= _mm512_mask_cmpeq_epi32_mask(m, _mm512_and_si512(_mm512_castps_si512(x), expo), expo);
        /* strictly greater, or the lane's first value (all -inf rows keep index 0 as PyTorch does) */
        __mmask16 up = _mm512_mask_cmp_ps_mask(m, x, top, _CMP_GT_OQ) | (m & ~seen);
        seen |= m;
        top = _mm512_mask_mov_ps(top, up, x);
        at = _mm512_mask_mov_epi32(at, up, _mm512_add_epi32(lane, _mm512_set1_epi32((int)i)));
    }
    float best = _mm512_mask_reduce_max_ps(seen, top);
    __mmask16 is_best = _mm512_mask_cmp_ps_mask(seen, top, _mm512_set1_ps(best), _CMP_EQ_OQ);
    j->best[item] = is_best ? _mm512_mask_reduce_min_epi32(is_best, at) : 0;
    j->finite[item] = !bad;
}
#else
static void greedy_item(const void *job, int item, void *scratch) {
    const Greedy *j = job;
    (void)scratch;
    const float *row = j->logits + item * j->v;
    const int64_t whole = j->v / W * W;
    __m256 top = _mm256_set1_ps(-__builtin_inff()), bad = _mm256_setzero_ps();
    __m256i at = _mm256_setzero_si256(), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i expo = _mm256_set1_epi32(0x7f800000);
    for (int64_t i = 0; i < whole; i += W) {
        __m256 x = _mm256_loadu_ps(row + i);
        bad = _mm256_or_ps(bad, _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x), expo), expo)));
        /* strictly greater, or the lane's first value (all -inf rows keep index 0 as PyTorch does) */
        __m256 up = i ? _mm256_cmp_ps(x, top, _CMP_GT_OQ) : _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        top = _mm256_blendv_ps(top, x, up);
        at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at),
                                                  _mm256_castsi256_ps(_mm256_add_epi32(lane, _mm256_set1_epi32((int)i))), up));
    }
    float tops[W], best = -__builtin_inff();
    int32_t ats[W];
    int64_t where = 0;
    _mm256_storeu_ps(tops, top), _mm256_storeu_si256((__m256i *)ats, at);
    for (int l = 0; l < W && whole; l++) /* the first index of the greatest: lane l holds indices l mod W */
        if (tops[l] > best || (tops[l] == best && (ats[l] < where || !l))) best = tops[l], where = ats[l];
    int finite = !_mm256_movemask_ps(bad);
    for (int64_t e = whole; e < j->v; e++) { /* the last elements, after every vector's */
        uint32_t bits;
        memcpy(&bits, row + e, 4);
        finite &= (bits & 0x7f800000u) != 0x7f800000u;
        if (row[e] > best) best = row[e], where = e;
    }
    j->best[item] = where;
    j->finite[item] = (uint8_t)finite;
}
#endif

/* New keys and values into a batch's row slots: token tokens[i] (i itself where tokens is none)
 * of k and v (heads, T, D), strides (k_head, k_tok, 1), into slot slot[i] at own index at[i] of
 * kbuf and vbuf [slots, heads, cap, D] contiguous; `Step.store`'s indexed assignment as copies of
 * D elements. */
typedef struct {
    int64_t n, heads, d, k_head, k_tok, v_head, v_tok, cap, rows_per_item;
    int bytes;
    const char *k, *v;
    char *kbuf, *vbuf;
    const int64_t *tokens, *slot, *at;
} Store;

static void store_item(const void *job, int item, void *scratch) {
    const Store *j = job;
    (void)scratch;
    int64_t first = item * j->rows_per_item, last = first + j->rows_per_item;
    if (last > j->n) last = j->n;
    const size_t row = (size_t)(j->d * j->bytes);
    for (int64_t i = first; i < last; i++) {
        int64_t tok = j->tokens ? j->tokens[i] : i;
        for (int64_t h = 0; h < j->heads; h++) {
            int64_t to = ((j->slot[i] * j->heads + h) * j->cap + j->at[i]) * j->d * j->bytes;
            memcpy(j->kbuf + to, j->k + (h * j->k_head + tok * j->k_tok) * j->bytes, row);
            memcpy(j->vbuf + to, j->v + (h * j->v_head + tok * j->v_tok) * j->bytes, row);
        }
    }
}
#endif

int batchgen_greedy(int64_t n, int64_t v, const float *logits, int64_t *best, uint8_t *finite, int threads) {
#if LAYER_OPS
    if (n < 0 || v < 1 || v > (int64_t)1 << 30) return 1;
    Greedy job = {n, v, logits, best, finite};
    return run(greedy_item, &job, (int)n, 64, n * v >= 1 << 18 ? threads : 1);
#else
    return (void)n, (void)v, (void)logits, (void)best, (void)finite, (void)threads, 1;
#endif
}

/* 0 when stored; 1 (nothing written) for a slot, own index or token out of range. */
int batchgen_store_rows(int64_t n, int64_t heads, int64_t d, int bf16, const void *k, int64_t k_head, int64_t k_tok,
                        const void *v, int64_t v_head, int64_t v_tok, int64_t t, void *kbuf, void *vbuf,
                        int64_t slots, int64_t cap, const int64_t *tokens, const int64_t *slot, const int64_t *at,
                        int threads) {
#if LAYER_OPS
    for (int64_t i = 0; i < n; i++)
        if (slot[i] < 0 || slot[i] >= slots || at[i] < 0 || at[i] >= cap || (tokens ? tokens[i] : i) < 0 ||
            (tokens ? tokens[i] : i) >= t)
            return 1;
    int64_t per = per_item(2 * heads * d);
    Store job = {n, heads, d, k_head, k_tok, v_head, v_tok, cap, per, bf16 ? 2 : 4, k, v, kbuf, vbuf, tokens, slot, at};
    int64_t items = (n + per - 1) / per;
    return run(store_item, &job, (int)items, 64, items > 1 ? threads : 1);
#else
    return (void)n, (void)heads, (void)d, (void)bf16, (void)k, (void)k_head, (void)k_tok, (void)v, (void)v_head,
           (void)v_tok, (void)t, (void)kbuf, (void)vbuf, (void)slots, (void)cap, (void)tokens, (void)slot, (void)at,
           (void)threads, 1;
#endif
}
