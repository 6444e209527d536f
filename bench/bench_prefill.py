"""Prefill attention's tile (`batchgen.pipeline.model.native.prefill_attention`), one layer, by dtype and path:
  float32       the float32 tile
  bf16-widened  bfloat16 widened to float32 on the float32 tile (what CPUs without AVX-512 BF16 run)
  bf16-dots     bfloat16 on AVX-512 BF16 dot products (`cpu_bf16.c`; where `native.bf16_dots` says)
  bf16-amx      bfloat16 on AMX tiles (`cpu_amx_prefill.c`; where `native.amx` says)
Suffixes of 30-400 tokens over anchors of 400 (the engine's shape on a few-shot file), SmolLM2-135M's
heads (9 query heads, 3 key heads of 64). FLOPs: 4 x head size per (query head, key) pair a token
reads (its anchor and its own keys up to itself). Systems take turns in one process, since this
machine is shared and its speed drifts; medians, GFLOP/s, and each system's ratio to float32.
A path this CPU lacks (AMX tiles, AVX-512 BF16) is left out. `--old REV` adds each path again on the
kernels built from another revision's sources ("old ...", as `bench_kernel_turns`).

    python -m bench.bench_prefill --turns 21 --threads 1 [--old HEAD]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_attention import cpu_model
from bench.bench_kernel_turns import old_library
from batchgen.pipeline.model import native

def case(dtype: torch.dtype, hq: int, hkv: int, d: int, suffixes: int, anchor: int, seed: int = 0):
    """The call's arguments and its FLOPs: `suffixes` rows of 30-400 tokens in row slots, each over
    one of four anchors of `anchor` keys."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(30, 401, (suffixes,), generator=g).tolist()
    cap = max(lengths)
    own_k, own_v = (torch.randn(suffixes, hkv, cap, d, generator=g).to(dtype) for _ in range(2))
    anchors = [tuple(torch.randn(1, hkv, anchor, d, generator=g).to(dtype) for _ in range(2)) for _ in range(4)]
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    starts = [sum(lengths[:i]) for i in range(suffixes)]
    lt = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    args = (q, hkv, lt(starts), lt([s + n for s, n in zip(starts, lengths)]), lt([own_k.data_ptr()] * suffixes),
            lt([own_v.data_ptr()] * suffixes), lt([cap] * suffixes), lt(list(range(suffixes))), lt([0] * suffixes),
            lt([anchors[i % 4][0].data_ptr() for i in range(suffixes)]),
            lt([anchors[i % 4][1].data_ptr() for i in range(suffixes)]), lt([anchor] * suffixes), d ** -0.5,
            torch.empty(t, hq, d))
    flops = sum(4 * d * hq * (anchor + i + 1) for n in lengths for i in range(n))
    return args, flops, (own_k, own_v, anchors)  # the buffers too: args holds only their addresses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=21)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--suffixes", type=int, default=16)
    p.add_argument("--anchor", type=int, default=400)
    p.add_argument("--old", default=None, help="a git revision whose kernels to run beside these")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    hq, hkv, d = 9, 3, 64
    cases = {"float32": case(torch.float32, hq, hkv, d, a.suffixes, a.anchor),
             "bf16": case(torch.bfloat16, hq, hkv, d, a.suffixes, a.anchor)}
    kernels = {"float32": ("float32", None), "bf16-widened": ("bf16", "widen"), "bf16-dots": ("bf16", "dots"),
               "bf16-amx": ("bf16", "amx")}
    libs = {"": native._lib(hq // hkv, d)}
    if a.old:
        libs["old "] = old_library(a.old, hq // hkv, d, Path(tempfile.mkdtemp()))

    def call(lib, dtype: str, kernel: str | None) -> bool:
        native._libs[(hq // hkv, d)] = lib
        return native.prefill_attention(*cases[dtype][0], kernel=kernel)

    calls = {}
    for tag, lib in libs.items():
        for s, (dtype, kernel) in kernels.items():
            if (s == "bf16-amx" and not native.amx(torch.bfloat16, hq, hkv, d)) \
                    or (s == "bf16-dots" and not native.bf16_dots(hq, hkv, d, fast_only=False)):
                continue  # a path this CPU lacks
            calls[tag + s] = (lambda lib=lib, dtype=dtype, kernel=kernel: call(lib, dtype, kernel))
    times = {s: [] for s in calls}
    for s in calls:
        assert calls[s](), s  # built and warm
    for _ in range(a.turns):
        for s in calls:
            t0 = time.perf_counter()
            calls[s]()
            times[s].append(time.perf_counter() - t0)
    print(f"{cpu_model()}; {a.threads} thread(s); bf16 dot products: {native.bf16_dots(hq, hkv, d)}; "
          f"{a.suffixes} suffixes over anchors of {a.anchor}; {a.turns} turns")
    base = statistics.median(times["float32"])
    for s in calls:
        m = statistics.median(times[s])
        flops = cases["float32" if s == "float32" else "bf16"][1]
        print(f"{s:17s} {m * 1e3:8.2f} ms  {flops / m / 1e9:7.1f} GFLOP/s  float32 / this {base / m:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
