"""Decode attention's anchor part against the machine's GEMM rate.

Many rows decoding over one long shared prefix (the anchor): per layer, every row's query heads
read the prefix's keys and values, 4 x rows x query heads x prefix x head size FLOPs, a matrix
product ((rows x G) x D against D x L per key head). This times that call through the compiled
kernels (`batchgen.pipeline.model.native.decode_attention`, each row with a single own key, so the anchor is
nearly all of it):
  blocked   the engine's kernel: the anchor as matrix products, on AMX tiles for bfloat16
            where the CPU has them (`native.amx`), else in AVX-512 registers
  avx512    the matrix products in AVX-512 registers (for bfloat16 the kernel without AMX; for
            float32 the same kernel as blocked)
  tiles     the 16-row register tiles the matrix products replaced
  pytorch   the same attention through PyTorch's ops (`attention.partial`: bmm, softmax, bmm)
and against the GEMM rate of the same FLOPs:
  bmm       torch.bmm of the same two products (queries by keys, weights by values), no softmax
  linear    oneDNN's packed linear (`kernels.linear`, as the model's weight matmuls run) at 2,048
            rows of the model's fused QKV layer: the GEMM rate of `bench_profile`'s attention floor
  old       with `--old REV`: blocked, built from that git revision's kernel sources (each row says
            whether its outputs equal blocked's, bit for bit)
A shape `RxL` is R rows over one anchor of L tokens; `RxL/A+O` splits the rows over A anchors (as
the engine's n samples of several prompts read one prefix per prompt) and gives each row O own keys.
`--copies K` keeps K copies of every buffer and calls them in turn, so that they stream from memory
as a 30-layer step streams its layers (one copy stays in cache). With 1 thread the times are the
thread's CPU time, which load on a shared machine stretches less than wall time.
Systems take turns (`--turns`) in one process, since this machine is shared and its speed drifts;
each row gives medians and ratios to `blocked`, never times across runs.

    python -m bench.bench_attention --shapes 128x1600,32x3000 --dtypes float32,bfloat16 --turns 7
    python -m bench.bench_attention --shapes 128x1700/8+23,64x3000/2+56 --dtypes float32 --threads 1 \
        --copies 30 --old HEAD~2 --systems blocked,old,linear
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch

from batchgen.pipeline.model import attention, kernels, native

SYSTEMS = ("blocked", "avx512", "tiles", "pytorch", "bmm", "linear", "old")
GEMM_ROWS = 2048


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return f"{fields['Model name'].strip()} (family {fields.get('CPU family', '?').strip()}, " \
               f"model {fields.get('Model', '?').strip()})"
    except (OSError, KeyError, subprocess.SubprocessError):
        return platform.processor() or platform.machine()


def calls(rows: int, length: int, dtype: torch.dtype, hq: int, hkv: int, d: int, hidden: int, anchors: int = 1,
          own: int = 1, copies: int = 1, old=None):
    """{system: a no-argument call} for one layer's decode attention, and its FLOPs."""
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(copies):
        own_k, own_v = (torch.randn(rows, hkv, own + 8, d, generator=g).to(dtype) for _ in range(2))
        anc = [[torch.randn(1, hkv, length, d, generator=g).to(dtype) for _ in range(2)] for _ in range(anchors)]
        which = [r * anchors // rows for r in range(rows)]
        ptrs = [torch.tensor([anc[a][i].data_ptr() for a in which]) for i in range(2)]
        layers.append((own_k, own_v, anc, ptrs))
    own_k, own_v, (anc_k, anc_v), _ = layers[0][0], layers[0][1], layers[0][2][0], None
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    out = torch.empty(rows, hq, d)
    lt = lambda *xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    slot, own_len, anc_len = torch.arange(rows), lt(*[own] * rows), lt(*[length] * rows)
    turn = [0]

    def kernel(anchors_kind=None, lib=None):
        turn[0] = (turn[0] + 1) % copies
        own_k, own_v, _, (ak, av) = layers[turn[0]]
        if lib is None:
            return native.decode_attention(q, own_k, own_v, slot, own_len, ak, av, anc_len, d ** -0.5, out,
                                           anchors=anchors_kind)
        return not lib.batchgen_decode_attention(
            rows, hq, hkv, d, native.DTYPES[dtype], q.data_ptr(), q.stride(0), q.stride(1), own_k.data_ptr(),
            own_v.data_ptr(), own_k.shape[2], *(x.data_ptr() for x in (slot, own_len, ak, av, anc_len)), d ** -0.5,
            out.data_ptr(), torch.get_num_threads(), native.ANCHORS["matmul"], 0)  # out float32

    flops = 4 * rows * hq * (length + own) * d
    # the same two products as bmm: (Hkv, rows x G, D) x (Hkv, D, L), then (Hkv, rows x G, L) x (Hkv, L, D)
    qg = q.view(rows, hkv, hq // hkv, d).transpose(0, 1).reshape(hkv, -1, d).contiguous()
    kt, p = anc_k[0].transpose(1, 2).contiguous(), torch.rand(hkv, qg.shape[1], length, generator=g).to(dtype)
    # the model's weight matmul at 2,048 rows: x (2048, hidden) by the fused QKV weight, about the same FLOPs
    weight = torch.randn((hq + 2 * hkv) * d, hidden, generator=g).to(dtype) * 0.02
    linear, x = kernels.linear(weight), torch.randn(GEMM_ROWS, hidden, generator=g).to(dtype)
    repeat = max(1, round(flops / (2 * GEMM_ROWS * hidden * weight.shape[0])))
    qp = q[None].transpose(1, 2)[..., None, :].reshape(1, hq, rows, d)  # (1, Hq, rows, D): rows as queries
    systems = {
        "blocked": lambda: kernel("matmul"),
        "avx512": lambda: kernel("matmul-avx512"),
        "tiles": lambda: kernel("tiles"),
        "old": lambda: kernel(lib=old),
        "pytorch": lambda: attention.partial(qp, anc_k, anc_v, None, d ** -0.5,
                                             matmul_dtype=dtype),
        "bmm": lambda: (torch.bmm(qg, kt), torch.bmm(p, anc_v[0])),
        "linear": lambda: [linear(x) for _ in range(repeat)],
    }
    scale = {"linear": 2 * GEMM_ROWS * hidden * weight.shape[0] * repeat / flops}  # its FLOPs over the anchor's

    def same_bits() -> bool:
        """Whether `old` gives blocked's outputs bit for bit, on the first copy of the buffers."""
        turn[0] = copies - 1  # the next call takes copy 0
        kernel("matmul")
        mine = out.clone()
        turn[0] = copies - 1
        kernel(lib=old)
        return torch.equal(mine, out)

    systems["same_bits"] = same_bits
    return systems, flops, scale


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="128x1600,32x3000", help="rows x prefix tokens[/anchors][+own keys], "
                    "comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=7, help="turns of every system (medians over them)")
    ap.add_argument("--calls", type=int, default=5, help="calls per turn")
    ap.add_argument("--heads", default="9,3,64,576", help="query heads, key heads, head size, hidden size "
                    "(SmolLM2-135M's)")
    ap.add_argument("--copies", type=int, default=1, help="copies of every buffer, called in turn (cold caches)")
    ap.add_argument("--old", default=None, help="a git revision: its kernels as the system 'old'")
    ap.add_argument("--systems", default=",".join(SYSTEMS[:-1]), help="comma-separated, of " + ", ".join(SYSTEMS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = args.systems.split(",")
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    torch.set_num_threads(args.threads)
    hq, hkv, d, hidden = map(int, args.heads.split(","))
    print(f"{cpu_model()}, {args.threads} threads, {args.turns} turns; GFLOP/s of one layer's anchor attention "
          f"({hq} query heads, {hkv} key heads, head size {d}), medians over turns\n")
    ratios = [s for s in ("tiles", "bmm", "linear", "old") if s in names and "blocked" in names]
    print("| rows | prefix | anchors | own keys | dtype | AMX | " + " | ".join(names) + " | "
          + " | ".join(f"blocked / {s}" for s in ratios) + " |")
    print("|---:|---:|---:|---:|---|---|" + "---:|" * (len(names) + len(ratios)))
    report = []
    old = None
    for shape in args.shapes.split(","):
        rows, rest = shape.split("x")
        rest, own = rest.split("+") if "+" in rest else (rest, "1")
        length, anchors = rest.split("/") if "/" in rest else (rest, "1")
        rows, length, anchors, own = int(rows), int(length), int(anchors), int(own)
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            if not native.supports(dtype, hq, hkv, d, d):
                print(f"| {rows} | {length} | {name} | (no kernel: {native.why_not(dtype, hq, hkv, d, d)}) |")
                continue
            if args.old and old is None:
                import tempfile
                from pathlib import Path

                from bench.bench_kernel_turns import old_library

                with tempfile.TemporaryDirectory() as tmp:
                    old = old_library(args.old, hq // hkv, d, Path(tmp))
            systems, flops, scale = calls(rows, length, dtype, hq, hkv, d, hidden, anchors, own, args.copies, old)
            same_bits = systems["same_bits"]() if old is not None and "old" in names else None
            systems = {s: systems[s] for s in names}
            times: dict[str, list[float]] = {s: [] for s in names}
            with torch.inference_mode():
                for f in systems.values():
                    f()  # warm-up: builds, first-touch pages, oneDNN's primitives
                calls_per_turn = max(args.calls, args.copies)
                for _ in range(args.turns):
                    for s in names:
                        t = clock()
                        for _ in range(calls_per_turn):
                            systems[s]()
                        times[s].append((clock() - t) / calls_per_turn / scale.get(s, 1.0))
            rate = {s: flops / statistics.median(v) / 1e9 for s, v in times.items()}
            amx = "yes" if native.amx(dtype, hq, hkv, d) else "no"
            print(f"| {rows} | {length} | {anchors} | {own} | {name} | {amx} | "
                  + " | ".join(f"{rate[s]:.0f}" for s in names) + " | "
                  + " | ".join(f"{rate['blocked'] / rate[s]:.2f}" for s in ratios) + " |"
                  + ("" if same_bits is None else f" old's bits {'equal' if same_bits else 'DIFFER'}"), flush=True)
            report.append({"rows": rows, "prefix": length, "anchors": anchors, "own": own, "dtype": name,
                           "gflop_s": rate, "times_s": times, "old_bits_equal": same_bits})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "threads": args.threads, "results": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
