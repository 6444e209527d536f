"""LoRA adapters per job: one run serving 8 adapters against 8 runs on merged copies, and against
the same jobs on the base model alone (issue 26), whole process against whole process.

The model is the embedded default (SmolLM2-135M-Instruct); 8 random rank-16 adapters on every
projection (peft's own, saved by `save_pretrained`), and for each its merged copy (peft's
`merge_and_unload`, saved as a model directory). The jobs: `--jobs` per adapter, the same
system-prompt workload (`bench/corpus.py`) for every adapter. Systems, each as the user runs it:

  one-run       one `batchgen process` of all jobs, an `adapter` column and `--adapter NAME=PATH` x 8
  merged-runs   8 `batchgen process` runs, one per merged copy, each of its adapter's jobs
  base          one `batchgen process` of all jobs on the base model (no adapter): the 8 copies of each
                job are the same prompt, so they share everything
  base-distinct the same, each copy's prompts made its own (a first line naming the copy): the
                sharing of one-run (each copy shares only within itself), without adapters

Wall time counts everything (imports, load, tokenization, generation, writing). Systems take turns
(A B C, B C A, ...) `--turns` times; the table gives each system's median. The outputs of one-run
and merged-runs are compared (greedy, float32: they must agree job for job).

    python -m bench.bench_adapters --turns 3 --jobs 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def prepare(work: Path, adapters: int, jobs: int, max_new_tokens: int, rank: int) -> dict:
    """Adapters, merged copies and job files under `work` (made once, kept for the turns)."""
    import torch
    import transformers

    from bench.corpus import system_prompt
    from batchgen.pipeline.model.load import default_model_path
    from tests.helpers.tiny_adapters import make_adapter, merged

    source = default_model_path()
    base = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    names = [f"a{i}" for i in range(adapters)]
    rows = system_prompt(groups=max(1, jobs // 8), jobs=8, max_new_tokens=max_new_tokens)[:jobs]
    files = {"all": work / "all.jsonl", "base": work / "base.jsonl", "distinct": work / "distinct.jsonl"}
    with open(files["all"], "w") as a, open(files["base"], "w") as b, open(files["distinct"], "w") as c:
        for name in names:
            for r in rows:
                a.write(json.dumps({**r, "id": f"{name}/{r['id']}", "adapter": name}) + "\n")
                b.write(json.dumps({**r, "id": f"{name}/{r['id']}"}) + "\n")
                c.write(json.dumps({**r, "id": f"{name}/{r['id']}", "prompt": f"Copy {name}.\n{r['prompt']}"}) + "\n")
    for i, name in enumerate(names):
        d = work / name
        if not (d / "adapter_model.safetensors").exists():
            make_adapter(base, d, rank=rank, seed=i + 1, size=0.2)
        m = work / f"merged-{name}"
        if not (m / "config.json").exists():
            merged(base, d).save_pretrained(m)
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
                if (source / f).exists():
                    (m / f).write_bytes((source / f).read_bytes())
        files[name] = work / f"{name}.jsonl"
        with open(files[name], "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "id": f"{name}/{r['id']}"}) + "\n")
    return {"names": names, "files": files, "source": source}


def _batchgen(jobs: Path, out: Path, args, *extra: str) -> list[str]:
    return [str(Path(sys.executable).parent / "batchgen"), "process", str(jobs), "-o", str(out), "--overwrite",
            "--device", "cpu", "--dtype", "float32", "--threads", str(args.threads), *extra]


def run_system(system: str, work: Path, setup: dict, args) -> tuple[float, dict[str, str]]:
    """One run of a system: its wall time and its completions by job id."""
    import pyarrow.parquet as pq

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    names, files = setup["names"], setup["files"]
    if system == "one-run":
        flags = [f for n in names for f in ("--adapter", f"{n}={work / n}")]
        cmds = [(_batchgen(files["all"], work / "one.parquet", args, *flags), work / "one.parquet")]
    elif system in ("base", "base-distinct"):
        out = work / f"{system}.parquet"
        cmds = [(_batchgen(files["base" if system == "base" else "distinct"], out, args), out)]
    else:
        cmds = [(_batchgen(files[n], work / f"m-{n}.parquet", args, "--model", str(work / f"merged-{n}")),
                 work / f"m-{n}.parquet") for n in names]
    t = time.perf_counter()
    for cmd, _ in cmds:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            raise SystemExit(f"{system} failed:\n{proc.stderr[-3000:]}")
    wall = time.perf_counter() - t
    out = {}
    for _, path in cmds:
        out.update({r["id"]: r["completion"] for r in pq.read_table(path, columns=["id", "completion"]).to_pylist()})
    return wall, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--jobs", type=int, default=64, help="jobs per adapter")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--work", default=None, help="keep adapters and merged copies here between invocations")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-adapters-"))
    work.mkdir(parents=True, exist_ok=True)
    setup = prepare(work, args.adapters, args.jobs, args.max_new_tokens, args.rank)
    systems = ["one-run", "merged-runs", "base", "base-distinct"]
    walls: dict[str, list[float]] = {s: [] for s in systems}
    outputs: dict[str, dict[str, str]] = {}
    for turn in range(args.turns):
        for s in systems[turn % len(systems):] + systems[: turn % len(systems)]:
            wall, outputs[s] = run_system(s, work, setup, args)
            walls[s].append(wall)
            print(f"turn {turn + 1}: {s:<12} {wall:7.1f} s", file=sys.stderr)
    same = sum(outputs["one-run"][k] == outputs["merged-runs"][k] for k in outputs["one-run"])
    print(f"\n{args.adapters} adapters x {args.jobs} jobs, {args.max_new_tokens} new tokens, rank {args.rank}, "
          f"{args.threads} threads, {args.turns} turns (median wall seconds)")
    median = {s: statistics.median(w) for s, w in walls.items()}
    for s in systems:
        print(f"  {s:<12} {median[s]:7.1f} s   ({', '.join(f'{w:.1f}' for w in walls[s])})")
    print(f"  merged-runs / one-run: {median['merged-runs'] / median['one-run']:.2f}x   "
          f"one-run / base: {median['one-run'] / median['base']:.2f}x   "
          f"one-run / base-distinct: {median['one-run'] / median['base-distinct']:.2f}x")
    print(f"  one-run equals merged-runs on {same} of {len(outputs['one-run'])} jobs")


if __name__ == "__main__":
    main()
