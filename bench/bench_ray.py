"""Ray's fixed overhead on this machine: the same job file through `--engine local` and
`--engine ray` (a local Ray started and stopped inside the run), in one process.

    PYTHONPATH=. python -m bench.bench_ray --groups 4 --per-group 8 --max-new-tokens 16
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from batchgen.jobs import GenerationDefaults
from batchgen.pipeline.run.runner import RunOptions, process


def job_file(path: str, groups: int, per_group: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = "river stone lamp quiet garden signal harbor paper orbit field winter copper".split()
    with open(path, "w") as f:
        for g in range(groups):
            system = f"Team {g} handbook. " + " ".join(rng.choice(words) for _ in range(120))
            for q in range(per_group):
                question = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
                f.write(json.dumps({"id": f"g{g}q{q}", "messages": [{"role": "system", "content": system},
                                                                   {"role": "user", "content": question}]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    from batchgen.pipeline.run.ray_runner import process_ray

    d = tempfile.mkdtemp(prefix="bgbench-")
    src = os.path.join(d, "jobs.jsonl")
    job_file(src, args.groups, args.per_group)
    options = RunOptions(model=args.model, device="cpu", dtype="float32",
                         defaults=GenerationDefaults(max_new_tokens=args.max_new_tokens))
    results = {}
    t = time.perf_counter()
    results["local"] = process([src], os.path.join(d, "local.parquet"), options)
    results["local"]["wall"] = time.perf_counter() - t
    t = time.perf_counter()
    results["ray"] = process_ray([src], os.path.join(d, "ray_out"), options, workers=args.workers)
    results["ray"]["wall"] = time.perf_counter() - t
    base = results["local"]["wall"]
    print(f"\n{args.groups * args.per_group} jobs, {args.groups} groups, {args.max_new_tokens} new tokens, "
          f"{args.workers} Ray worker(s), {os.cpu_count()} CPUs\n")
    print("| engine | wall s | prefill tok | completion tok | completion tok/s | wall vs local |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['wall']:.1f} | {r['prefill_tokens']} | {r['completion_tokens']} | "
              f"{r['completion_tokens'] / r['wall']:.1f} | {r['wall'] / base:.2f}x |")
    print(f"\nRay fixed overhead (ray wall - local wall): {results['ray']['wall'] - base:.1f} s")


if __name__ == "__main__":
    main()
