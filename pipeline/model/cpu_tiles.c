/* Prefill's register tiles (float32; bfloat16 widened): 16 query rows as vector lanes against 16 keys
 * at a time (`Tile`, also decode's reference for its anchors), and the wide tile of 48 lanes (32 with
 * AVX2) that float32 prefill runs on, with the 16-lane tile's bits. Included by cpu_attention.c (not
 * built alone). */
#if defined(BATCHGEN_SIMD)

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
#endif /* BATCHGEN_SIMD */
