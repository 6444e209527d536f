/* Prefill attention of cpu_attention.c in bfloat16 on AMX tiles (Intel since Sapphire Rapids; head
 * size a multiple of 32), where the AVX-512 tiles run far below the matmul rate. The matrix
 * products of decode's `amx_item` (`amx_scores`, `amx_outputs` in cpu_anchors.c), with causality by
 * own index: 64 query rows an item (tokens x the query heads of one key head, four tiles of 16), KA
 * keys at a time:
 *   scores^T [keys][rows] = keys [keys][D] (read in place) . queries^T (pairs of elements, unscaled:
 *     the products of bfloat16 are exact in float32, summed in float32, then scaled);
 *   the online softmax in float32 down vectors of 16 rows, as the AVX-512 tiles compute it
 *     (`fold_scores`' masking: past the keys and after each row's own index); the weights rounded
 *     to bfloat16 (as PyTorch's bfloat16 flash attention rounds them), their sum taken before;
 *   outputs^T [D][rows] += values^T [D][keys] . weights^T, the values transposed once per call
 *     (`pack_vt`): each anchor once for every segment reading it, each segment's own keys once for
 *     its items.
 * Included by cpu_prefill.c after its Prefill job and `tile_out` (not built alone); native_build.py hashes it
 * into the library's name. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
typedef struct {
    uint16_t qt[AL * D];  /* [rows / 16][D/2][16][2] queries^T in pairs of elements (tiles B) */
    float s[KA * AL];     /* [keys][rows] scores, then weights */
    uint16_t pt[KA * AL]; /* [rows / 16][keys / 2][16][2] weights^T in pairs of keys (tiles B) */
    float ot[D * AL];     /* [D][rows] weighted values, not yet divided by the sum */
    uint16_t k[W * D];    /* the last keys of a run, padded with zeros to 16 */
    vf m[4], sum[4], pos[4];
} AmxPrefill;

/* The item's row tiles (`nv` of them) against keys [0, len) of one head ([len][D] at `keys`; their
 * values transposed at vt, rows of `lp` keys); `causal`: row r sees keys <= pos[r]. */
static void amx_prefill_keys(AmxPrefill *b, const uint16_t *keys, const uint16_t *vt, int64_t lp, int64_t len,
                             int causal, int nv, float scale) {
    const __m512i ilv = _mm512_load_si512(ILV);
#define PT(rg, ks) (b->pt + ((rg) * (KA / 2) + (ks) * 16) * 2 * W)
    for (int64_t c0 = 0; c0 < len; c0 += KA) {
        int n = len - c0 < KA ? (int)(len - c0) : KA, pairs = (n + 31) / 32;
        amx_scores(keys + c0 * D, n, b->qt, nv, b->s, b->k);
        for (int u = 0; u < nv; u++) { /* the chunk's softmax, 16 rows a vector; earlier chunks rescaled */
            const float *s = b->s + W * u;
            float first = b->pos[u][0];
            /* the maximum of the unscaled scores a row sees, then scaled: rounding is monotone, so
             * that is the maximum of the scaled scores, with no pass that writes them */
            __m512 most = column_max(s, n, _mm512_set1_ps(-__builtin_inff()), causal, c0, first, b->pos[u]);
            vf top = (vf)_mm512_max_ps((__m512)b->m[u], (__m512)((vf)most * scale));
            vf rescale = exp_neg(b->m[u] - top), sum = b->sum[u] * rescale;
            for (int j = 0; j < 32 * pairs; j += 2) { /* a key a row does not see weighs 0 */
                __mmask16 see0 = j >= n ? 0 : rows_seeing(causal, c0 + j, first, b->pos[u]);
                __mmask16 see1 = j + 1 >= n ? 0 : rows_seeing(causal, c0 + j + 1, first, b->pos[u]);
                vf e0 = see0 ? (vf)_mm512_maskz_mov_ps(see0, (__m512)exp_neg(ld(s, j * AL, 0) * scale - top)) : SPLAT(0.0f);
                vf e1 = see1 ? (vf)_mm512_maskz_mov_ps(see1, (__m512)exp_neg(ld(s, (j + 1) * AL, 0) * scale - top))
                             : SPLAT(0.0f);
                sum += e0 + e1;
                /* row l's pair (weight of key j, of key j + 1), rounded to bfloat16 */
                _mm512_storeu_si512(PT(u, 0) + j * W,
                                    _mm512_permutexvar_epi16(ilv, (__m512i)_mm512_cvtne2ps_pbh((__m512)e1, (__m512)e0)));
            }
            b->m[u] = top, b->sum[u] = sum;
            if (_mm512_cmp_ps_mask((__m512)rescale, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))
                for (int i = 0; i < D; i++) st(b->ot + i * AL + W * u, ld(b->ot, i * AL + W * u, 0) * rescale);
        }
        amx_outputs(b->ot, vt, lp, c0, pairs, b->pt, nv, 1, 0);
    }
#undef PT
}

/* Where each segment's values sit transposed in `packed`: its anchor's (shared by the segments
 * reading the same anchor) and its own keys' (up to its last token's own index). */
typedef struct {
    const Prefill *job;
    uint16_t *packed;
    int64_t *anc_at, *own_at, *packs; /* packs: (source, keys, offset in packed, first key) */
} AmxPacking;

static void amx_pack_item(const void *arg, int w, void *scratch) {
    const AmxPacking *p = arg;
    (void)scratch;
    const int64_t *it = p->packs + 4 * w;
    int64_t len = it[1], k0 = it[3], lp = padded(len);
    pack_vt((const uint16_t *)it[0], len, p->packed + it[2], k0, k0 + PACK < lp ? k0 + PACK : lp);
}

static int64_t own_end(const Prefill *job, int64_t seg) { return job->offset[seg] + job->t1[seg] - job->t0[seg]; }

static void amx_prefill_item(const void *arg, int w, void *scratch) {
    const AmxPacking *p = arg;
    const Prefill *job = p->job;
    AmxPrefill *b = scratch;
    int64_t seg = job->items[3 * w], h = job->items[3 * w + 1], r0 = job->items[3 * w + 2];
    int64_t t0 = job->t0[seg], rows = (job->t1[seg] - t0) * G, off = job->offset[seg], tok[AL], head[AL];
    int real = rows - r0 < AL ? (int)(rows - r0) : AL, nv = (real + W - 1) / W;
    float pos[AL];
    for (int l = 0; l < AL; l++) { /* lanes past the end repeat the last row; their outputs are dropped */
        int64_t r = r0 + l < rows ? r0 + l : rows - 1;
        tok[l] = t0 + r / G, head[l] = h * G + r % G, pos[l] = (float)(off + r / G);
    }
    amx_queries(b->qt, job->q, job->q_tok, job->q_head, tok, head, W * nv);
    for (int u = 0; u < 4; u++) {
        memcpy(&b->pos[u], pos + W * u, sizeof b->pos[u]);
        b->m[u] = SPLAT(-1e30f), b->sum[u] = SPLAT(0.0f);
    }
    memset(b->ot, 0, sizeof b->ot);
    amx_configure();
    int64_t la = job->anc_k[seg] ? job->anc_len[seg] : 0, cap = job->own_cap[seg], lo = padded(own_end(job, seg));
    if (la)
        amx_prefill_keys(b, (const uint16_t *)job->anc_k[seg] + h * la * D, p->packed + p->anc_at[seg] + h * padded(la) * D,
                         padded(la), la, 0, nv, job->scale);
    const uint16_t *own = (const uint16_t *)job->own_k[seg] + (job->own_index[seg] * job->hkv + h) * cap * D;
    amx_prefill_keys(b, own, p->packed + p->own_at[seg] + h * lo * D, lo, (int64_t)pos[W * nv - 1] + 1, 1, nv,
                     job->scale);
    _tile_release();
    tile_out(job->out, job->out_bf16, job->hq, tok, head, b->ot, AL, b->sum, real);
}

/* The job's segments on AMX tiles (job->items: (segment, key head, first of AL lanes)): their values
 * transposed in one pass, then the items. 0 when every item was done. */
static int amx_prefill(const Prefill *job, int nseg, int items, int threads) {
    int64_t hkv = job->hkv, at = 0, npacks = 0, *pairs = malloc(sizeof(int64_t) * 2 * (size_t)(nseg ? nseg : 1));
    AmxPacking p = {job, NULL, malloc(sizeof(int64_t) * (size_t)(nseg ? nseg : 1)),
                    malloc(sizeof(int64_t) * (size_t)(nseg ? nseg : 1)), NULL};
    int failed = !pairs || !p.anc_at || !p.own_at, anchored = 0;
    for (int s = 0; !failed && s < nseg; s++)
        if (job->anc_k[s]) pairs[2 * anchored] = job->anc_v[s], pairs[2 * anchored + 1] = s, anchored++;
    if (!failed) {
        qsort(pairs, (size_t)anchored, 2 * sizeof(int64_t), by_anchor);
        for (int i = 0; i < anchored; i++) { /* one packed copy per anchor */
            int64_t s = pairs[2 * i + 1];
            if (i && pairs[2 * i] == pairs[2 * i - 2]) {
                p.anc_at[s] = p.anc_at[pairs[2 * i - 1]];
                continue;
            }
            p.anc_at[s] = at, at += hkv * padded(job->anc_len[s]) * D, npacks += hkv * (padded(job->anc_len[s]) + PACK - 1) / PACK;
        }
        for (int s = 0; s < nseg; s++)
            p.own_at[s] = at, at += hkv * padded(own_end(job, s)) * D, npacks += hkv * (padded(own_end(job, s)) + PACK - 1) / PACK;
        p.packed = aligned_alloc(64, ((size_t)at * 2 + 63) / 64 * 64 + 64);
        p.packs = malloc(sizeof(int64_t) * 4 * (size_t)(npacks ? npacks : 1));
        failed = !p.packed || !p.packs;
    }
    int64_t k = 0;
    for (int i = 0; !failed && i < anchored; i++) {
        int64_t s = pairs[2 * i + 1], len = job->anc_len[s];
        if (i && pairs[2 * i] == pairs[2 * i - 2]) continue;
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t k0 = 0; k0 < padded(len); k0 += PACK, k++) {
                int64_t *it = p.packs + 4 * k;
                it[0] = job->anc_v[s] + 2 * h * len * D, it[1] = len, it[2] = p.anc_at[s] + h * padded(len) * D, it[3] = k0;
            }
    }
    for (int s = 0; !failed && s < nseg; s++) {
        int64_t len = own_end(job, s), cap = job->own_cap[s];
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t k0 = 0; k0 < padded(len); k0 += PACK, k++) {
                int64_t *it = p.packs + 4 * k;
                it[0] = job->own_v[s] + 2 * (job->own_index[s] * hkv + h) * cap * D, it[1] = len;
                it[2] = p.own_at[s] + h * padded(len) * D, it[3] = k0;
            }
    }
    failed = failed || run(amx_pack_item, &p, (int)k, 64, threads);
    failed = failed || run(amx_prefill_item, &p, items, sizeof(AmxPrefill), threads);
    free(pairs), free(p.anc_at), free(p.own_at), free(p.packed), free(p.packs);
    return failed;
}
#endif
