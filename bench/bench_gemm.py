"""batchgen's float32 GEMM (`pipeline/model/cpu_gemm.c`) against oneDNN's on packed weights.

Two parts, both in one process:
- the layers alone: a stack of the embedded default model's float32 layer shapes (SmolLM2-135M:
  q/k/v 576 -> 960, o 576 -> 576, gate and up 576 -> 3,072 as one, down 1,536 -> 576), enough of
  them that the weights stream from memory as in a forward, at each row count from a decode
  step's to a prefill's; the kernels take turns round by round, and the ratios are taken per round
  (this VM drifts by tens of percent within minutes); `--old REV` adds batchgen's GEMM as built from
  another git revision's kernel sources (the A/B of a kernel change; it must give the same bits);
- the MLP's gate alone: its two products and `silu_mul`, against `Gemm.glu`'s one pass;
- the engine: a `bench/corpus.py` workload through `Engine.generate` on two decoders of the default
  model, one on each kernel (`BATCHGEN_GEMM=0` loads oneDNN's), in alternating turns, wall time
  per run, and whether the greedy outputs agree.

    python -m bench.bench_gemm --threads 2 --workload long_document --turns 4
    python -m bench.bench_gemm --skip-engine --rows 8,64,512,2048 --old HEAD~1
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_attention import cpu_model

HIDDEN, INTER = 576, 1536
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]  # (k, n)


def layers_alone(rows_list: list[int], layers: int, rounds: int, old: str | None = None) -> None:
    """`old`: a git revision whose GEMM (built from its kernel sources) runs beside this one's, in the
    same rounds: the A/B of two builds (its outputs checked for the same bits)."""
    from batchgen.pipeline.model import kernels, native

    gemm = native.gemm(torch.float32, 9, 3, 64)
    if gemm is None:
        raise SystemExit(f"no GEMM here: {native.why_not(torch.float32, 9, 3, 64, 64)}")
    kernels.keep_freed_memory()  # as the decoder runs: outputs reuse memory
    weights = [[torch.randn(n, k) * 0.02 for k, n in SHAPES] for _ in range(layers)]
    stacks = {"batchgen": [[gemm.linear(w) for w in layer] for layer in weights],
              "oneDNN": [[kernels.linear(w) for w in layer] for layer in weights]}
    if old:
        from bench.bench_kernel_turns import old_library

        theirs = native.Gemm(old_library(old, 3, 64, Path(tempfile.mkdtemp())))
        stacks[f"batchgen at {old}"] = [[theirs.linear(w) for w in layer] for layer in weights]
    others = [s for s in stacks if s != "batchgen"]
    print(f"the layers alone: {layers} layers of SmolLM2-135M's shapes ({4 * sum(k * n for k, n in SHAPES) * layers / 1e6:.0f}"
          f" MB of weights), {torch.get_num_threads()} threads, {rounds} rounds, GFLOP/s (medians) and"
          f" each other's time / batchgen's per round (median of rounds):")
    print("| rows | " + " | ".join(f"{s} GFLOP/s" for s in stacks) + " | "
          + " | ".join(f"faster than {s}" for s in others) + " |")
    print("|---:|" + "---:|" * (len(stacks) + len(others)))
    for m in rows_list:
        x, xi = torch.randn(m, HIDDEN), torch.randn(m, INTER)

        def run(stack):
            return [f(xi if k == INTER else x) for layer in stack for (k, _), f in zip(SHAPES, layer)]

        flops = 2 * m * layers * sum(k * n for k, n in SHAPES)
        first = {s: run(stacks[s]) for s in stacks}
        if old and not all(torch.equal(a, b) for a, b in zip(first["batchgen"], first[others[-1]])):
            raise SystemExit(f"batchgen at {old} gives other bits at {m} rows")
        times = {s: [] for s in stacks}
        for r in range(rounds):
            for s in stacks if r % 2 == 0 else list(stacks)[::-1]:  # in turns, each round the other way
                t = time.perf_counter()
                run(stacks[s])
                times[s].append(time.perf_counter() - t)
        rates = [f"{flops / statistics.median(times[s]) / 1e9:.0f}" for s in stacks]
        ratios = [f"{statistics.median(y / x for x, y in zip(times['batchgen'], times[s])):.2f}x" for s in others]
        print(f"| {m} | " + " | ".join(rates + ratios) + " |")


def gated_alone(rows_list: list[int], layers: int, rounds: int) -> None:
    """The MLP's gate: the gate and up projections (576 -> 1,536 each) then `silu_mul` (two GEMM
    passes and an elementwise one), against `Gemm.glu`'s one pass; their bits checked equal."""
    from batchgen.pipeline.model import kernels, native

    gemm, ops = native.gemm(torch.float32, 9, 3, 64), native.layer_ops(torch.float32, 9, 3, 64, HIDDEN, INTER)
    if gemm is None or ops is None:
        print("the MLP's gate: no GEMM or layer ops here")
        return
    kernels.keep_freed_memory()
    pairs = [(gemm.linear(torch.randn(INTER, HIDDEN) * 0.02), gemm.linear(torch.randn(INTER, HIDDEN) * 0.02))
             for _ in range(layers)]
    ways = {"three passes": [lambda x, g=g, u=u: ops.silu_mul(g(x), u(x)) for g, u in pairs],
            "one pass": [gemm.glu(g, u, ops) for g, u in pairs]}
    print(f"the MLP's gate alone: {layers} layers of gate and up ({HIDDEN} -> {INTER} each) and silu * up,"
          f" {torch.get_num_threads()} threads, {rounds} rounds, GFLOP/s of the two products (medians):")
    print("| rows | three passes GFLOP/s | one pass GFLOP/s | one pass faster, median of rounds |")
    print("|---:|---:|---:|---:|")
    for m in rows_list:
        x = torch.randn(m, HIDDEN)
        if not all(torch.equal(a(x), b(x)) for a, b in zip(*ways.values())):
            raise SystemExit(f"the one pass gives other bits at {m} rows")
        times = {w: [] for w in ways}
        for r in range(rounds):
            for w in ways if r % 2 == 0 else list(ways)[::-1]:
                t = time.perf_counter()
                for f in ways[w]:
                    f(x)
                times[w].append(time.perf_counter() - t)
        flops = 2 * 2 * m * HIDDEN * INTER * layers
        rates = [f"{flops / statistics.median(times[w]) / 1e9:.0f}" for w in ways]
        ratio = statistics.median(a / b for a, b in zip(times["three passes"], times["one pass"]))
        print(f"| {m} | " + " | ".join(rates) + f" | {ratio:.2f}x |")


def engine_turns(turns: int, jobs: int, workload: str) -> None:
    from transformers import AutoTokenizer

    from bench import corpus
    from batchgen.pipeline.engine.engine import Engine
    from batchgen.pipeline.engine.types import Request, SamplingParams
    from batchgen.pipeline.model import kernels
    from batchgen.pipeline.model.decoder import Decoder
    from batchgen.pipeline.model.load import load_model

    ours, source = load_model(None, "cpu", "float32")
    os.environ["BATCHGEN_GEMM"] = "0"
    try:
        theirs, _ = load_model(None, "cpu", "float32")
    finally:
        del os.environ["BATCHGEN_GEMM"]
    if not isinstance(ours, Decoder) or ours.linear is kernels.linear or theirs.linear is not kernels.linear:
        raise SystemExit("the default model is not on batchgen's decoder with its GEMM here")
    tok = AutoTokenizer.from_pretrained(source)
    rows = corpus.WORKLOADS[workload]()[:jobs]
    reqs = [Request(i, tok(r["prompt"]).input_ids, SamplingParams(max_new_tokens=r["max_new_tokens"], n=r.get("n", 1)))
            for i, r in enumerate(rows)]
    models = {"batchgen GEMM": ours, "oneDNN": theirs}
    runs: dict[str, list[float]] = {name: [] for name in models}
    outs = {}
    for model in models.values():  # warm-up
        Engine.for_model(model, [tok.eos_token_id]).generate(reqs[:2])
    for turn in range(turns):
        for name in (list(models) if turn % 2 == 0 else list(models)[::-1]):
            t = time.perf_counter()
            done = Engine.for_model(models[name], [tok.eos_token_id]).generate(reqs)
            runs[name].append(time.perf_counter() - t)
            outs[name] = [c.token_ids for c in sorted(done, key=lambda c: (c.key, c.sample_index))]
    ratios = [b / a for a, b in zip(runs["batchgen GEMM"], runs["oneDNN"])]
    same = sum(a == b for a, b in zip(*outs.values()))
    print(f"the engine, {workload} ({len(reqs)} jobs), float32, {torch.get_num_threads()} threads, {turns} turns:")
    for name, times in runs.items():
        print(f"  {name:14s} s: {' '.join(f'{x:.2f}' for x in times)}")
    print(f"  faster by, per turn: {' '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x")
    print(f"  greedy outputs equal: {same}/{len(outs['oneDNN'])}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,8,32,64,128,256,512,2048", help="row counts for the layers alone")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--workload", default="long_document")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--old", default=None, help="a git revision: its GEMM beside this one's in the layers alone")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_model())
    layers_alone([int(r) for r in args.rows.split(",")], args.layers, args.rounds, args.old)
    gated_alone([int(r) for r in args.rows.split(",")], args.layers, args.rounds)
    if not args.skip_engine:
        engine_turns(args.turns, args.jobs, args.workload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
