"""batchgen against real CPU inference runtimes, whole process against whole process.

Every system runs the same job file (real English text, `bench/corpus.py`) as its own process, the
way a user runs it, and the wall time counts everything: imports, model load, tokenization,
generation, writing. Systems take turns (A B C, B C A, ...) `--turns` times in one script, since
this machine's speed drifts by tens of percent over minutes; the table gives each system's median.
Greedy everywhere, `--threads` threads everywhere, float32 unless the system's name says otherwise;
every row may stop at EOS (the outputs are compared with batchgen's).

Systems:
  batchgen, batchgen-bf16      `batchgen process` (float32 / bfloat16), on batchgen's own decoder
  batchgen-transformers        `batchgen process`, float32, on transformers' model code (BATCHGEN_DECODER=0)
  openvino                     OpenVINO GenAI, continuous batching, prefix caching off (f32 compute and KV)
  openvino-prefix-warm         prefix caching on; one request per group first, then the rest
  ctranslate2-static           CTranslate2, one generate_batch per group with its common prefix as static_prompt
  hf-batched                   batched `model.generate`, left padding, 16 rows a call
The peers' venvs and converted models come from `bench/peers/setup.sh` (see its header);
missing ones are skipped with a note.

    python -m bench.bench_engine --workloads fewshot,system_prompt --turns 3
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
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("BATCHGEN_PEERS", Path.home() / ".cache" / "batchgen-peers"))
ALL = ["batchgen", "batchgen-bf16", "batchgen-transformers", "openvino", "openvino-prefix-warm", "ctranslate2-static", "hf-batched"]


@dataclass
class Result:
    walls: list[float] = field(default_factory=list)
    completions: dict[str, str] = field(default_factory=dict)
    version: str = ""
    info: dict = field(default_factory=dict)


def command(system: str, jobs: Path, out: Path, args) -> list[str] | None:
    """The command line of one run, or None when the system is not set up here."""
    bg = [str(Path(sys.executable).parent / "batchgen"), "process", str(jobs), "-o", str(out), "--overwrite",
          "--device", "cpu", "--threads", str(args.threads), "--max-new-tokens", str(args.max_new_tokens)]
    if system in ("batchgen", "batchgen-transformers"):
        return bg + ["--dtype", "float32"]
    if system == "batchgen-bf16":
        return bg + ["--dtype", "bfloat16"]
    if system == "hf-batched":
        return [sys.executable, "-m", "bench.hf_run", str(jobs), str(out), str(args.threads)]
    peers = Path(args.peers)
    if system.startswith("openvino"):
        if not (peers / "ov" / "bin" / "python").exists() or not (peers / "ov_model").exists():
            return None
        prefix, calls = ("1", "warm") if system == "openvino-prefix-warm" else ("0", "all")
        return [str(peers / "ov/bin/python"), str(ROOT / "bench/peers/ov_run.py"), str(peers / "ov_model"),
                str(jobs), str(out), prefix, "0", str(args.threads), calls]
    if system == "ctranslate2-static":
        if not (peers / "ct2" / "bin" / "python").exists() or not (peers / "ct2_model").exists():
            return None
        from pipeline.model.load import default_model_path

        return [str(peers / "ct2/bin/python"), str(ROOT / "bench/peers/ct2_run.py"), str(peers / "ct2_model"),
                str(default_model_path() / "tokenizer.json"), str(jobs), str(out), "static", "0", str(args.threads)]
    raise ValueError(system)


def run_once(system: str, cmd: list[str], out: Path, result: Result) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}
    if system == "batchgen-transformers":
        env["BATCHGEN_DECODER"] = "0"
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{system} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result.walls.append(wall)
    if system.startswith("batchgen"):
        import pyarrow.parquet as pq

        summary = json.loads(Path(str(out) + ".summary.json").read_text())
        result.version = f"batchgen {summary['versions']['batchgen']}, torch {summary['versions']['torch']}"
        result.info = {k: summary.get(k) for k in ("prompt_tokens", "prefill_tokens", "completion_tokens", "batches",
                                                   "model_code")}
        rows = pq.read_table(out).to_pylist()
        result.completions = {r["id"]: r["completion"] for r in rows}
    else:
        line = json.loads(proc.stdout.strip().splitlines()[-1])
        result.version = str(line.get("version", ""))
        result.info = {"completion_tokens": line.get("completion_tokens")}
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        result.completions = {r["id"]: r.get("completion_to_eos", r["completion"]) for r in rows}


def bench_workload(name: str, systems: list[str], args, work: Path) -> dict[str, Result]:
    from bench import corpus

    jobs = work / f"{name}.jsonl"
    build = corpus.WORKLOADS[name]
    rows = build(**({"subjects": args.groups, "questions": args.jobs_per_group} if name == "fewshot"
                    else {"groups": args.groups * 2, "jobs": args.jobs_per_group // 2}),
                 max_new_tokens=args.max_new_tokens)
    jobs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results: dict[str, Result] = {}
    ready = []
    for s in systems:
        cmd = command(s, jobs, work / "probe", args)
        if cmd is None:
            print(f"[{name}] {s}: not set up (run bench/peers/setup.sh MODEL_DIR {args.peers}); skipped",
                  file=sys.stderr)
        else:
            ready.append(s)
            results[s] = Result()
    for turn in range(args.turns):
        order = ready[turn % len(ready):] + ready[: turn % len(ready)]
        for s in order:
            out = work / f"{name}.{s}.{'parquet' if s.startswith('batchgen') else 'jsonl'}"
            run_once(s, command(s, jobs, out, args), out, results[s])
            print(f"[{name}] turn {turn + 1} {s}: {results[s].walls[-1]:.1f} s", file=sys.stderr, flush=True)
    return results


def table(name: str, results: dict[str, Result]) -> str:
    ref = results.get("batchgen")
    base = statistics.median(ref.walls) if ref else None
    head = ref.info if ref else {}
    lines = [f"### {name}: {len(ref.completions) if ref else '?'} jobs, {head.get('prompt_tokens', '?')} prompt "
             f"tokens, batchgen prefills {head.get('prefill_tokens', '?')}", "",
             "| system | version | wall s (median) | min-max | batchgen faster by | new tokens | outputs = batchgen |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for s, r in results.items():
        mid = statistics.median(r.walls)
        ratio = f"{mid / base:.2f}x" if base else "-"
        agree = "ref" if s == "batchgen" else (
            f"{sum(r.completions.get(k, '').strip() == v.strip() for k, v in ref.completions.items())}/"
            f"{len(ref.completions)}" if ref else "-")
        lines.append(f"| {s} | {r.version} | {mid:.1f} | {min(r.walls):.1f}-{max(r.walls):.1f} | {ratio} | "
                     f"{r.info.get('completion_tokens', '-')} | {agree} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="fewshot,system_prompt")
    p.add_argument("--systems", default=",".join(ALL))
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--groups", type=int, default=4, help="fewshot subjects; system_prompt gets twice as many groups")
    p.add_argument("--jobs-per-group", type=int, default=16, help="fewshot questions; system_prompt gets half")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--peers", default=str(PEERS), help="where bench/peers/setup.sh built the peers")
    p.add_argument("--json", default=None, help="save the raw numbers here")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(ALL)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {ALL}")
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            results = bench_workload(name, systems, args, Path(tmp))
            print(table(name, results) + "\n", flush=True)
            report[name] = {s: {"walls": r.walls, "version": r.version, **r.info} for s, r in results.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
