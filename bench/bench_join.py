"""Continuous batching: rows whose outputs end at different lengths, with and without joining.

G groups of J jobs share a P-token prefix each (16-token suffixes); each job wants between 4 and
M new tokens (seeded draws, as when EOS comes early). Batches hold B rows. **join**: rows planned
next take the slots finished rows free; **no-join**: a batch runs until its longest row ends, its
slots emptying as rows finish. Each system runs in a fresh forked process.

    PYTHONPATH=. python -m bench.bench_join --groups 4 --jobs 64 --prefix 512 --rows 32 --max-new 64
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import random
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


def child(join: bool, args, queue) -> None:
    torch.set_num_threads(args.threads)
    from pipeline.engine import Engine
    from pipeline.model import load_model

    model, _ = load_model(None, "cpu", "float32")
    reqs = requests(args)
    budget = args.rows * (SUFFIX + args.max_new)  # B rows per planned batch (cascade: rows hold their own tokens)
    engine = Engine(model, eos_token_ids=[], max_batch_tokens=budget, join=join)
    t = time.perf_counter()
    done = engine.generate(reqs)
    wall = time.perf_counter() - t
    s = engine.stats
    queue.put({"wall": wall, "tokens": s.completion_tokens, "steps": s.decode_steps, "batches": s.batches,
               "admitted": s.admitted_rows, "prefill": s.prefill_tokens,
               "out": sorted((c.key, tuple(c.token_ids)) for c in done)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=64, help="jobs per group")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--rows", type=int, default=32, help="rows per planned batch")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    res = {}
    for name, join in (("join", True), ("no-join", False)):
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(join, args, q))
        p.start()
        res[name] = q.get()
        p.join()
    same = res["join"].pop("out") == res["no-join"].pop("out")
    print(f"{args.groups} groups x {args.jobs} jobs, prefix {args.prefix}, suffix {SUFFIX}, 4..{args.max_new} new "
          f"tokens, {args.rows} rows per planned batch; outputs identical: {same}\n")
    print("| system | wall s | completion tok/s | decode steps | rows per step | batches | rows joined | vs no-join |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = res["no-join"]["wall"]
    for name, r in res.items():
        print(f"| {name} | {r['wall']:.1f} | {r['tokens'] / r['wall']:.1f} | {r['steps']} | {r['tokens'] / r['steps']:.1f} "
              f"| {r['batches']} | {r['admitted']} | {base / r['wall']:.2f}x |")


if __name__ == "__main__":
    main()
