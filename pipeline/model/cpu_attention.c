/* batchgen's attention kernels for CPUs: every token of a forward against its row's cached prefix
 * (the anchor, shared with other rows) and then its own keys, in one pass, final (no partial
 * softmaxes to merge).
 *
 * Why kernels of our own: PyTorch's CPU kernels run this at 76-95 GFLOP/s in prefill (padded
 * batches of suffixes, a second call per anchor, gathers and a log-sum-exp merge around them) and
 * read a decoding row's keys at 8-9 GB/s (each row a tiny GEMM). Here:
 * - decode (one query per row): the rows reading one anchor as matrix products against it, the
 *   queries of 48 rows x query heads (64 on AMX tiles, bfloat16) by its keys, then their weights
 *   by its values, the anchor read once per such tile; then each (row, key head) against its own
 *   keys, read once for all the query heads that share them, and merged with its anchor's part;
 * - prefill (a run of tokens continuing one sequence): 16 query rows (tokens x the query heads of
 *   one key head) at a time, a GEMM-style register tile against 16 keys at a time, online softmax
 *   (flash attention), causal by own index, no padding.
 *
 * One translation unit, in files by job (each #included once, none built alone):
 *   cpu_vectors.c   the vectors every kernel is written in; cpu_threads.c: a pass over threads;
 *   cpu_tiles.c     prefill's register tiles (16 lanes, and the wide one);
 *   cpu_decode.c    decode attention; its anchors as matrix products in cpu_anchors.c, on AMX
 *                   tiles in cpu_amx_anchors.c;
 *   cpu_prefill.c   prefill attention; bfloat16 on dot products in cpu_bf16.c, on AMX in cpu_amx_prefill.c;
 *   cpu_layer_ops.c the decoder's elementwise passes; cpu_step_ops.c the engine's greedy pick and KV
 *                   stores; cpu_gemm.c the decoder's float32 linear layers.
 *
 * Built by pipeline/native_build.py with the machine's C compiler (-march=native) for one head layout
 * (-DBATCHGEN_G query heads per key head, -DBATCHGEN_D head size): plain C with GCC/Clang vector
 * extensions of W floats, no Python or torch headers: W = 16 for CPUs with AVX-512, W = 8 for AVX2
 * with FMA (the tiles then have half the lanes and keys; 16-float vectors there live in memory);
 * elsewhere the entry points refuse and the engine keeps PyTorch's kernels. AVX-512 BF16 dot products and AMX tiles
 * where -march=native has them, AMX only once Linux lends this process its tile registers
 * (`amx_usable`). Threads come from torch's OpenMP runtime
 * when built with -fopenmp (its threads still spin after torch's last op: new threads would fight
 * them for the cores), else from pthreads.
 *
 * Layouts (elements of the KV dtype, float32 or bfloat16, row-major):
 *   q           [T, Hq, D] with strides (q_tok, q_head, 1)
 *   own k/v     [rows, Hkv, cap, D] contiguous: a batch's row slots, or a prefix being prefilled
 *   anchor k/v  [1, Hkv, len, D]    contiguous, or none (pointer 0)
 *   out         [T, Hq, D] contiguous, float32 or (`out_bf16`) bfloat16, rounded as PyTorch's cast rounds
 * Scores, softmax and sums in float32, as PyTorch's kernels compute them (AMX: the weights meet the
 * values as two bfloat16 parts, 16 bits of their 24). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(BATCHGEN_G) || !defined(BATCHGEN_D)
#error "build with -DBATCHGEN_G=<query heads per key head> -DBATCHGEN_D=<head size>"
#endif
#define G BATCHGEN_G
#define D BATCHGEN_D
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define BATCHGEN_SIMD 1 /* the kernels are built: for AVX-512, or for AVX2 with FMA */
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
enum { W = 16 }; /* floats per vector; keys per prefill tile */
#else
/* AVX2: vectors of 8 floats, and tiles of 8 lanes and 8 keys (vectors of 16 would live in memory:
 * GCC keeps a vector type the CPU has no registers for on the stack, and the kernels ran at 6
 * GFLOP/s) */
enum { W = 8 };
#endif
/* prefill_attention's kernels (native.PREFILL): float32 on the wide tile (bfloat16 widened onto the
 * 16-lane one), AVX-512 BF16 dot products, AMX tiles, and the 16-lane tile for either (the reference);
 * with AVX2 the tiles have half the lanes */
enum { PREFILL_WIDEN = 0, PREFILL_DOTS = 1, PREFILL_AMX = 2, PREFILL_TILE16 = 3 };
_Static_assert(D % 16 == 0 && D <= 128 && G >= 1 && G <= 8, "head size 16-128 in steps of 16, 1-8 query heads a key head");

#include "cpu_vectors.c" /* vf, ld/st, exp_neg, prefetch_rows: what every kernel is written in */
#include "cpu_threads.c" /* run: a pass of work items over threads */
#include "cpu_tiles.c"   /* prefill's register tiles: 16 lanes, and the wide one */

#if defined(BATCHGEN_SIMD)
static int ok(int hq, int hkv, int d, int bf16) { return hkv > 0 && hq == hkv * G && d == D && (bf16 == 0 || bf16 == 1); }
#else
static int ok(int hq, int hkv, int d, int bf16) { return (void)hq, (void)hkv, (void)d, (void)bf16, 0; }
#endif

/* 1 when this build serves the layout: its own head size for keys and values alike and its query
 * heads per key head, float32 (0) or bfloat16 (1), on a CPU with AVX-512. */
int batchgen_supports(int hq, int hkv, int d, int dv, int bf16) { return d == dv && ok(hq, hkv, d, bf16); }

/* The entry points return 0 on success, 1 when the layout is not this build's or no thread got its
 * scratch memory (the caller then uses PyTorch's kernels). */

#include "cpu_decode.c"    /* batchgen_decode_attention, batchgen_amx */
#include "cpu_prefill.c"   /* batchgen_prefill_attention, batchgen_bf16_dots */
#include "cpu_layer_ops.c" /* the decoder's norms, gate and rotary */
#include "cpu_step_ops.c"  /* the engine's greedy pick and KV stores */
#include "cpu_gemm.c"      /* the decoder's float32 linear layers */
