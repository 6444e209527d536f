"""batchgen against real CPU inference runtimes, whole process against whole process.

Every system runs the same job file (real English text, `bench/corpus.py`) as its own process, the
way a user runs it. Systems take turns (A B C, B C A, ...) `--turns` times in one script, since this
machine's speed drifts by tens of percent over minutes; a table gives each system's medians, and its
ratios are taken turn by turn within the run (each system's total over the reference's in the same
turn, then the median), never across runs. Greedy everywhere, `--threads` threads everywhere; every
row may stop at EOS, and the outputs are compared with the reference's (batchgen float32 unless
`--ref` says otherwise). Each table names the CPU it ran on (`lscpu`'s model name, family and model).

Columns per system, times in seconds: *start* = exec to ready (the model loaded and the jobs read
and tokenized; for batchgen, the start of its first forward, as BENCHMARKS.md's "Start-up and
finish" section measures it, through `bench.timed_batchgen`); *engine* = ready to the last token;
*finish* = the last token to the process's exit as this script sees it; *total* = exec to exit.

Workloads (the issue-25 shapes; `--limit`, `--n` and `--max-new-tokens` shrink them for a smoke run):
  fewshot        64 five-shot jobs in 4 subjects, 16 new tokens (prefill-heavy)
  system_prompt  8 system prompts x 8 requests, 16 new tokens
  samples        8 prompts x 16 samples (`n`) under an 8-shot chain-of-thought header, 128 new tokens
  long_document  2 documents of ~3k tokens x 32 questions, 64 new tokens
  fewshot_1k     1,024 five-shot jobs in 16 subjects, 16 new tokens
A job with `n` samples goes to the peers as `n` rows of the same prompt (ids `ID/k`), since their
runners take one row per completion; batchgen reads the `n` itself.

Systems: `bench/peers/systems.py`. The peers' venvs and converted models come from
`bench/peers/setup.sh DEST` (`--peers DEST` or `BATCHGEN_PEERS`); one that is not set up is skipped,
saying so. vLLM runs once untimed before the turns (its first start compiles its model).

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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import corpus
from bench.peers.systems import ROOT, SYSTEMS, command, is_batchgen, missing

PEERS = Path(os.environ.get("BATCHGEN_PEERS", Path.home() / ".cache" / "batchgen-peers"))
SHAPES = {  # workload -> (job-file builder, its arguments)
    "fewshot": (corpus.fewshot, {"subjects": 4, "questions": 16, "max_new_tokens": 16}),
    "system_prompt": (corpus.system_prompt, {"groups": 8, "jobs": 8, "max_new_tokens": 16}),
    "samples": (corpus.samples, {"prompts": 8, "n": 16, "max_new_tokens": 128}),
    "long_document": (corpus.long_document, {"documents": 2, "questions": 32, "max_new_tokens": 64}),
    "fewshot_1k": (corpus.fewshot, {"subjects": 16, "questions": 64, "max_new_tokens": 16}),
}


@dataclass
class Run:
    turn: int
    start: float
    engine: float
    finish: float
    total: float


@dataclass
class Result:
    runs: list[Run] = field(default_factory=list)
    completions: dict[str, str] = field(default_factory=dict)
    version: str = ""
    info: dict = field(default_factory=dict)
    failed: str = ""


def cpu_model() -> str:
    """`lscpu`'s model name, family and model: machines of this project differ (Zen 4, Zen 5, Xeon)."""
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return f"{fields.get('Model name', '?')} (cpu family {fields.get('CPU family', '?')}, model {fields.get('Model', '?')})"


def job_files(name: str, args, work: Path) -> tuple[Path, Path]:
    """The workload's job file for batchgen and the one for the peers (`n` samples as `n` rows)."""
    build, shape = SHAPES[name]
    shape = dict(shape)
    if args.max_new_tokens:
        shape["max_new_tokens"] = args.max_new_tokens
    if args.n and "n" in shape:
        shape["n"] = args.n
    rows = build(**shape)[: args.limit or None]
    expanded = [{**{k: v for k, v in r.items() if k != "n"}, "id": f"{r['id']}/{k}"}
                for r in rows for k in range(r["n"])] if "n" in shape else rows
    jobs, peer_jobs = work / f"{name}.jsonl", work / f"{name}.peers.jsonl"
    jobs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    peer_jobs.write_text("".join(json.dumps(r) + "\n" for r in expanded))
    return jobs, peer_jobs


def result_line(system: str, stdout: str) -> dict:
    """A runner's JSON line: its last stdout line that is one (vLLM's engine logs to stdout after it)."""
    for text in reversed(stdout.splitlines()):
        if text.startswith("{"):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                continue
    raise RuntimeError(f"{system} printed no result line; its stdout ends:\n{stdout[-1500:]}")


def run_once(system: str, jobs: Path, out: Path, args, result: Result, samples: bool, turn: int = 0) -> None:
    """One timed run of `system`, its phases added to `result` (and its outputs kept, the last run's)."""
    times = out.with_suffix(".times.json")
    cmd, extra = command(system, jobs, out, times, args.threads, Path(args.peers), args.device, args.model)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **extra}
    exec_at = time.monotonic()  # CLOCK_MONOTONIC: the clock the children's ready/done times are read from
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    exit_at = time.monotonic()
    if proc.returncode != 0:
        raise RuntimeError(f"{system} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    if is_batchgen(system):
        import pyarrow.parquet as pq

        forwards = json.loads(times.read_text())
        ready_at, done_at = forwards["first_forward_start"], forwards["last_forward_end"]
        summary = json.loads(Path(str(out) + ".summary.json").read_text())
        result.version = f"batchgen {summary['versions']['batchgen']}, torch {summary['versions']['torch']}"
        result.info = {k: summary.get(k) for k in ("rows", "prompt_tokens", "prefill_tokens", "completion_tokens",
                                                   "batches", "model_code")}
        rows = pq.read_table(out, columns=["id", "sample_index", "completion"]).to_pylist()
        result.completions = {f"{r['id']}/{r['sample_index']}" if samples else r["id"]: r["completion"] for r in rows}
    else:
        line = result_line(system, proc.stdout)
        ready_at, done_at = line["ready_at"], line["done_at"]
        result.version = str(line.get("version", ""))
        result.info = {"completion_tokens": line.get("completion_tokens")}
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        result.completions = {r["id"]: r.get("completion_to_eos", r["completion"]) for r in rows}
    result.runs.append(Run(turn=turn, start=ready_at - exec_at, engine=done_at - ready_at, finish=exit_at - done_at,
                           total=exit_at - exec_at))


def bench_workload(name: str, systems: list[str], args, work: Path, warmed: set[str]) -> dict[str, Result]:
    jobs, peer_jobs = job_files(name, args, work)
    samples = "n" in SHAPES[name][1]
    results: dict[str, Result] = {}
    for s in systems:
        gap = missing(s, Path(args.peers))
        if gap:
            print(f"[{name}] {s}: not set up ({gap} is missing; see bench/peers/setup.sh); skipped", file=sys.stderr)
        else:
            results[s] = Result()
    for s in [s for s in results if SYSTEMS[s].warm_up and s not in warmed]:
        tiny = work / "warm_up.jsonl"
        tiny.write_text("".join(json.dumps({**json.loads(line), "max_new_tokens": 2}) + "\n"
                                for line in peer_jobs.read_text().splitlines()[:2]))
        t = time.monotonic()
        try:
            run_once(s, tiny, work / f"warm_up.{s}.jsonl", args, Result(), samples=False)
        except RuntimeError as e:
            results[s].failed = str(e).splitlines()[0]
            print(f"[{name}] {s}: warm-up {e}", file=sys.stderr)
        print(f"[{name}] {s}: warm-up run (untimed) {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
        warmed.add(s)
    ready = [s for s in results if not results[s].failed]
    for turn in range(args.turns):
        for s in ready[turn % len(ready):] + ready[: turn % len(ready)]:
            if results[s].failed:
                continue
            out = work / f"{name}.{s}.{'parquet' if is_batchgen(s) else 'jsonl'}"
            try:
                run_once(s, jobs if is_batchgen(s) else peer_jobs, out, args, results[s], samples, turn)
            except RuntimeError as e:  # one peer's crash costs its column, not the table
                results[s].failed = str(e).splitlines()[0]
                print(f"[{name}] {e}", file=sys.stderr, flush=True)
                continue
            r = results[s].runs[-1]
            print(f"[{name}] turn {turn + 1} {s}: total {r.total:.1f} s (start {r.start:.1f}, engine {r.engine:.1f}, "
                  f"finish {r.finish:.1f})", file=sys.stderr, flush=True)
    return results


def agreement(result: Result, ref: Result | None) -> str:
    """Jobs (samples) whose text equals the reference's."""
    if ref is None or not ref.completions:
        return "-"
    same = sum(result.completions.get(k, "").strip() == v.strip() for k, v in ref.completions.items())
    return f"{same}/{len(ref.completions)}"


def turn_ratio(result: Result, ref: Result) -> str:
    """The median over turns of this system's total over the reference's in the same turn."""
    ref_totals = {b.turn: b.total for b in ref.runs}
    pairs = [r.total / ref_totals[r.turn] for r in result.runs if r.turn in ref_totals]
    return f"{statistics.median(pairs):.2f}x" if pairs else "-"


def table(name: str, results: dict[str, Result], ref_name: str, cpu: str, threads: int, turns: int) -> str:
    ref = results.get(ref_name)
    head = ref.info if ref else {}
    lines = [f"### {name}: {head.get('rows', '?')} completions, {head.get('prompt_tokens', '?')} prompt tokens, "
             f"{ref_name} prefills {head.get('prefill_tokens', '?')}", "",
             f"CPU: {cpu}; {threads} threads; medians of {turns} turns; ratios within each turn.", "",
             f"| system | version | start s | engine s | finish s | total s | total min-max | {ref_name} faster by "
             f"| completion tokens | outputs = {ref_name} |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s, r in results.items():
        if not r.runs:
            lines.append(f"| {s} | {r.version} | failed: {r.failed[:80]} | | | | | | | |")
            continue
        mid = {k: statistics.median(getattr(x, k) for x in r.runs) for k in ("start", "engine", "finish", "total")}
        totals = [x.total for x in r.runs]
        lines.append(f"| {s} | {r.version} | {mid['start']:.2f} | {mid['engine']:.2f} | {mid['finish']:.2f} | "
                     f"{mid['total']:.1f} | {min(totals):.1f}-{max(totals):.1f} | "
                     f"{turn_ratio(r, ref) if ref and ref.runs else '-'} | {r.info.get('completion_tokens', '-')} | "
                     f"{'ref' if s == ref_name else agreement(r, ref)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="fewshot,system_prompt", help=f"any of {','.join(SHAPES)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated; see bench/peers/systems.py")
    p.add_argument("--ref", default=None, help="the system the others are compared with (default: the first "
                                               "batchgen system listed)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--limit", type=int, default=0, help="only the first N jobs of each workload (a smoke run)")
    p.add_argument("--n", type=int, default=0, help="samples per job of the samples workload, instead of 16")
    p.add_argument("--max-new-tokens", type=int, default=0, help="instead of each workload's own")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--peers", default=str(PEERS), help="where bench/peers/setup.sh built the peers (BATCHGEN_PEERS)")
    p.add_argument("--json", default=None, help="save the raw numbers here")
    p.add_argument("--device", default="cpu", help="batchgen's and hf-batched's device (bench/gpu_check.sh: cuda)")
    p.add_argument("--model", default=None, help="a model directory for batchgen and hf-batched (default: the "
                                                 "default model)")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS)) + sorted(set(args.workloads.split(",")) - set(SHAPES))
    if unknown:
        raise SystemExit(f"unknown systems or workloads {unknown}; choose from {list(SYSTEMS)} and {list(SHAPES)}")
    ref_name = args.ref or next((s for s in systems if is_batchgen(s)), systems[0])
    cpu = cpu_model() + ("" if args.device == "cpu" else f"; batchgen and hf-batched on {args.device}")
    report, warmed = {"cpu": cpu, "threads": args.threads}, set()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            results = bench_workload(name, systems, args, Path(tmp), warmed)
            print(table(name, results, ref_name, cpu, args.threads, args.turns) + "\n", flush=True)
            report[name] = {s: {"runs": [asdict(x) for x in r.runs], "version": r.version, "failed": r.failed,
                                **r.info} for s, r in results.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
