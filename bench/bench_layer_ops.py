"""The decoder's one-pass elementwise kernels (`pipeline/model/cpu_layer_ops.c`) against PyTorch's ops.

Two parts, both in one process on the embedded default model:
- the engine: a `bench/corpus.py` workload through `Engine.generate` with the decoder's `ops` set
  and unset in alternating turns (thread CPU time per run; the decoder's `_add_norm`, `_gate` and
  `_rotate` timed apart), and whether the outputs are identical (they must be: the kernels are
  PyTorch's arithmetic to the bit);
- the kernels alone at a prefill's rows: the norm with its residual sum, silu(gate) * up, a
  layer's keys and values into row slots (`native.store_rows`) against indexed assignment, and each
  step's argmax with its finiteness (`native.greedy`) against `aminmax` + `argmax`.

    python -m bench.bench_layer_ops --dtype float32 --threads 2 --turns 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def engine_turns(dtype: str, turns: int, jobs: int, workload: str) -> None:
    from transformers import AutoTokenizer

    from bench import corpus
    from batchgen.pipeline.engine.engine import Engine
    from batchgen.pipeline.engine.types import Request, SamplingParams
    from batchgen.pipeline.model.decoder import Decoder
    from batchgen.pipeline.model.load import load_model

    model, source = load_model(None, "cpu", dtype)
    if not isinstance(model, Decoder) or model.ops is None:
        raise SystemExit("the default model is not on batchgen's decoder with its kernels here")
    tok = AutoTokenizer.from_pretrained(source)
    rows = corpus.WORKLOADS[workload]()[:jobs]
    reqs = [Request(i, tok(r["prompt"]).input_ids, SamplingParams(max_new_tokens=r["max_new_tokens"], n=r.get("n", 1)))
            for i, r in enumerate(rows)]
    spent = [0.0]
    for name in ("_add_norm", "_gate", "_rotate"):  # the sections the kernels replace
        def timed(self, *a, _f=getattr(Decoder, name)):
            t = time.perf_counter()
            try:
                return _f(self, *a)
            finally:
                spent[0] += time.perf_counter() - t
        setattr(Decoder, name, timed)
    ops, runs, parts, outs = model.ops, {"with": [], "without": []}, {"with": [], "without": []}, {}
    Engine.for_model(model, [tok.eos_token_id]).generate(reqs[:2])  # warm-up
    for turn in range(turns):
        for name in ("without", "with") if turn % 2 else ("with", "without"):
            model.ops = ops if name == "with" else None
            spent[0], t = 0.0, time.thread_time()
            done = Engine.for_model(model, [tok.eos_token_id]).generate(reqs)
            runs[name].append(time.thread_time() - t)
            parts[name].append(spent[0])
            outs[name] = [c.token_ids for c in done]
    model.ops = ops
    ratios = [b / a for a, b in zip(runs["with"], runs["without"])]
    print(f"engine, {workload} ({len(reqs)} jobs), {dtype}, {torch.get_num_threads()} threads, {turns} turns:")
    for name in runs:
        print(f"  {name:7s} s: {' '.join(f'{x:.2f}' for x in runs[name])}; the passes' median "
              f"{statistics.median(parts[name]):.2f} s")
    print(f"  faster by, per turn: {' '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x")
    print(f"  outputs identical: {outs['with'] == outs['without']}")


def _median_ms(fn, reps: int = 10, rounds: int = 7) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps * 1e3)
    return statistics.median(times)


def kernels_alone(rows: int) -> None:
    from batchgen.pipeline.model import native
    from batchgen.pipeline.model.decoder import Decoder

    ops = native.layer_ops(torch.float32, 9, 3, 64, 576, 1536)
    if ops is None:
        raise SystemExit(f"no kernels here: {native.why_not(torch.float32, 9, 3, 64, 64)}")
    dec = Decoder.__new__(Decoder)  # only its PyTorch norm
    dec.config = type("C", (), {"rms_norm_eps": 1e-5})()
    print(f"kernels alone, {rows} rows, {torch.get_num_threads()} threads (ms, median of 7):")
    for dtype in (torch.float32, torch.bfloat16):
        x0, r = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype)
        w = (torch.rand(576) + 0.5).to(dtype)
        g0, u = torch.randn(rows, 1536).to(dtype), torch.randn(rows, 1536).to(dtype)
        x, g = x0.clone(), g0.clone()
        # each call starts from fresh values (the sums would grow, the gates shrink to denormals);
        # the copy's own time is taken off
        copies = {"norm + residual": _median_ms(lambda: x.copy_(x0)), "silu(gate) * up": _median_ms(lambda: g.copy_(g0))}
        cases = {"norm + residual": (lambda: dec._norm(x.copy_(x0).add_(r), w),
                                     lambda: ops.add_rms_norm(x.copy_(x0), r, w, 1e-5)),
                 "silu(gate) * up": (lambda: F.silu(g.copy_(g0), inplace=True).mul_(u),
                                     lambda: ops.silu_mul(g.copy_(g0), u))}
        for name, (ref, fast) in cases.items():
            a, b = _median_ms(ref) - copies[name], _median_ms(fast) - copies[name]
            print(f"  {str(dtype)[6:]:9s} {name:16s} PyTorch {a:6.2f}  one pass {b:6.2f}")
    for n in (64, 2048):  # a decode step's rows, a prefill's tokens: one layer's keys and values stored
        qkv = torch.randn(n, 15, 64)
        k, v = qkv[:, 9:12].transpose(0, 1), qkv[:, 12:].transpose(0, 1)  # (3, n, 64) views, as the decoder's
        kb, vb = torch.zeros(n, 3, 64, 64), torch.zeros(n, 3, 64, 64)
        slots, at = torch.arange(n), torch.arange(n) % 64

        def indexed():
            kb[slots, :, at] = k[:, :].transpose(0, 1)
            vb[slots, :, at] = v[:, :].transpose(0, 1)

        print(f"  store keys + values, {n} rows: indexed {_median_ms(indexed):.3f}  copies "
              f"{_median_ms(lambda: native.store_rows(k, v, kb, vb, slice(None), slots, at)):.3f}")
    for b in (64, 128):
        logits = torch.randn(b, 49152)

        def torch_greedy():
            low, high = torch.aminmax(logits, dim=-1)
            return logits.argmax(-1), (torch.isfinite(low) & torch.isfinite(high)).tolist()

        print(f"  greedy + finite, {b} x 49152: PyTorch {_median_ms(torch_greedy):.2f}  one pass "
              f"{_median_ms(lambda: native.greedy(logits)):.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--workload", default="fewshot")
    p.add_argument("--rows", type=int, default=2048, help="rows for the kernels alone")
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels_alone(args.rows)
    if not args.skip_engine:
        engine_turns(args.dtype, args.turns, args.jobs, args.workload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
