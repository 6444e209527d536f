"""Continuous batching: rows whose outputs end at different lengths, with and without joining.

G groups of J jobs share a P-token prefix each (16-token suffixes); each job wants between 4 and
M new tokens (seeded draws, as when EOS comes early). Batches hold B rows. **join**: rows planned
next take the slots finished rows free; **no-join**: a batch runs until its longest row ends, its
slots emptying as rows finish. Both systems run in turns in one process (`--repeat` each), since
this VM's speed drifts; the median wall time is reported.

    PYTHONPATH=. python -m bench.bench_join --groups 4 --jobs 64 --prefix 512 --rows 32 --max-new 64
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time

import torch

SUFFIX = 16


def requests(args):
    from pipeline.types import Request, SamplingParams

    rng = random.Random(0)
    out = []
    for g in range(args.groups):
        head = [rng.randrange(100, 49000) for _ in range(args.prefix)]
        for _ in range(args.jobs):
            prompt = head + [rng.randrange(100, 49000) for _ in range(SUFFIX)]
            out.append(Request(len(out), prompt, SamplingParams(max_new_tokens=rng.randint(4, args.max_new))))
    return out


def run(engine_cls, model, reqs, args, join: bool) -> dict:
    budget = args.rows * (SUFFIX + args.max_new)  # B rows per planned batch (cascade: rows hold their own tokens)
    engine = engine_cls(model, eos_token_ids=[], max_batch_tokens=budget, join=join)
    t = time.perf_counter()
    done = engine.generate(reqs)
    wall = time.perf_counter() - t
    s = engine.stats
    return {"wall": wall, "tokens": s.completion_tokens, "steps": s.decode_steps, "batches": s.batches,
            "admitted": s.admitted_rows, "out": sorted((c.key, tuple(c.token_ids)) for c in done)}


def child(args, queue) -> None:
    """Both systems in turns in one process: this VM's speed drifts by tens of percent over minutes."""
    torch.set_num_threads(args.threads)
    from pipeline.engine import Engine
    from pipeline.model import load_model

    model, _ = load_model(None, "cpu", "float32")
    reqs = requests(args)
    runs: dict[str, list[dict]] = {"join": [], "no-join": []}
    for _ in range(args.repeat):
        for name in runs:
            runs[name].append(run(Engine, model, reqs, args, name == "join"))
    queue.put(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=64, help="jobs per group")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--rows", type=int, default=32, help="rows per planned batch")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="turns per system; the median wall time is reported")
    args = ap.parse_args()
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=child, args=(args, q))
    p.start()
    runs = q.get()
    p.join()
    outs = {tuple(map(tuple, r.pop("out"))) for rs in runs.values() for r in rs}
    same = len(outs) == 1
    res = {}
    for name, rs in runs.items():
        res[name] = dict(rs[0], wall=statistics.median(r["wall"] for r in rs), walls=[r["wall"] for r in rs])
    print(f"{args.groups} groups x {args.jobs} jobs, prefix {args.prefix}, suffix {SUFFIX}, 4..{args.max_new} new "
          f"tokens, {args.rows} rows per planned batch; outputs identical: {same}; wall = median of "
          + ", ".join(f"{name} {[round(w, 1) for w in r['walls']]}" for name, r in res.items()) + "\n")
    print("| system | wall s | completion tok/s | decode steps | rows per step | batches | rows joined | vs no-join |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = res["no-join"]["wall"]
    for name, r in res.items():
        print(f"| {name} | {r['wall']:.1f} | {r['tokens'] / r['wall']:.1f} | {r['steps']} | {r['tokens'] / r['steps']:.1f} "
              f"| {r['batches']} | {r['admitted']} | {base / r['wall']:.2f}x |")


if __name__ == "__main__":
    main()
