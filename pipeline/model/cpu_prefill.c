/* Prefill attention (`batchgen_prefill_attention`): runs of tokens, each continuing one sequence, against
 * the run's anchor and then its own keys, causal by own index. Included by cpu_attention.c after decode
 * (not built alone). */
#if defined(BATCHGEN_SIMD)

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
    void *out;      /* float32, or bfloat16 where out_bf16 (rounded as PyTorch's cast rounds) */
    int out_bf16;
    int64_t *items; /* (segment, key head, first lane) */
    int kernel;     /* `PREFILL_*` */
} Prefill;

/* The first `real` of a prefill tile's `lanes` lanes out (every prefill kernel's): ot [D][lanes] divided by each lane's sum
 * (sum[l / W][l % W]) into out [token][head][D], lane l being query head head[l] of token tok[l]. */
static void tile_out(void *out, int out_bf16, int hq, const int64_t *tok, const int64_t *head, const float *ot,
                     int lanes, const vf *sum, int real) {
    real = real < lanes ? real : lanes;
#if defined(__AVX512F__)
    for (int g = 0; g < real; g += W)
        for (int c = 0; c < D / W; c++) {
            __m512 r[W];
            for (int i = 0; i < W; i++) r[i] = (__m512)ld(ot, (W * c + i) * lanes + g, 0);
            transpose16(r); /* r[l]: lane g + l's dimensions W c .. W c + W - 1 */
            for (int l = 0; l < W && g + l < real; l++)
                put(out, (tok[g + l] * hq + head[g + l]) * D + W * c, (vf)r[l] * (1.0f / sum[(g + l) / W][l]), out_bf16);
        }
#else
    for (int l = 0; l < real; l++) {
        float inv = 1.0f / sum[l / W][l % W];
        for (int c = 0; c < D / W; c++) {
            vf x;
            for (int i = 0; i < W; i++) x[i] = ot[(W * c + i) * lanes + l] * inv;
            put(out, (tok[l] * hq + head[l]) * D + W * c, x, out_bf16);
        }
    }
#endif
}

/* bfloat16 prefill: widened to float32 on the float32 tile, on AVX-512 BF16 dot products (cpu_bf16.c)
 * where the build has them, on AMX tiles (cpu_amx_prefill.c) where the CPU has them and Linux lends them */
#include "cpu_bf16.c"        /* the 16-lane tile on AVX-512 BF16 dot products */
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
        tile_out(job->out, job->out_bf16, job->hq, tok, head, b->ot, W, &b->sum, p.rows - p.r0);
        return;
    }
#endif
    tile_start(t, job->q, job->q_tok, job->q_head, tok, head, pos, job->scale, job->bf16);
    if (p.la)
        tile_keys(t, ak + p.h * p.la * D * es, av + p.h * p.la * D * es, p.la, 0, job->bf16);
    tile_keys(t, mk, mv, (int64_t)pos[W - 1] + 1, 1, job->bf16);
    tile_out(job->out, job->out_bf16, job->hq, tok, head, t->ot, W, &t->sum, p.rows - p.r0);
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
    tile_out(job->out, job->out_bf16, job->hq, tok, head, t->ot, lanes, t->sum, p.rows - p.r0);
}
#endif /* BATCHGEN_SIMD */

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
                               const int64_t *anc_len, float scale, void *out, int threads, int kernel,
                               int out_bf16) {
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
                   offset, anc_k, anc_v, anc_len, scale, out, out_bf16 != 0, list, kernel};
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
           (void)out, (void)threads, (void)kernel, (void)out_bf16, 1;
#endif
}
