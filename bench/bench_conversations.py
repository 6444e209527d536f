"""Conversations: every turn in one batchgen run, against one batchgen run per turn.

The user's recipe before conversations: run batchgen on turn 1, fill its answers in, run again on
turn 2 with the whole history, and so on, so every run prefills each conversation's whole history
again. `one run` gives batchgen the conversations with `"content": null` turns and generates every
turn in one process, each row keeping its keys and values across its turns. Both are whole
processes (`python -m batchgen process`), taking turns (one run, per turn, one run, ...) `--turns`
times, since this machine's speed drifts; a table gives each system's medians and the ratio turn
by turn. Greedy, float32: the per-turn runs' answers must equal the one run's turns (the check is
printed).

Workloads (real English text, bench/corpus.py; `--conversations` and `--max-new-tokens` scale them):
  mtbench   two-turn questions under one system prompt (MT-bench's shape: FastChat's
            gen_model_answer answers turn 1, appends it, asks turn 2)
  turns8    8-turn conversations, a user message of 20-60 tokens a turn

Columns: wall seconds (exec to exit, summed over a system's processes), prefill tokens (the
summaries' `prefill_tokens`, summed), and prefill over the sum of each conversation's final
context (its last turn's prompt tokens): 1.0 would be every context token prefilled once.

    python -m bench.bench_conversations --workloads mtbench,turns8 --turns 3

`--engine vllm`: both systems drive a vLLM server (`--server URL`; bench/vllm_cpu_serve.sh, the
default model, float32, blocks of 32 tokens), a fresh one per system run (started untimed, so each run finds an empty
prefix cache; the per-turn runs share theirs, as a user's running server would). The table adds
the prompt tokens of every turn and the cached tokens the server reports of the later turns (one
run: the summary's `carried_tokens`; per turn: the later runs' `cached_tokens`), and a third
system: per turn with a server each (what `--engine vllm` per run does: turn 2's server starts
with an empty cache; its starts are untimed too).

    python -m bench.bench_conversations --workloads mtbench --engine vllm --turns 1
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

from contextlib import contextmanager

from bench import corpus

ROOT = Path(__file__).resolve().parent.parent

SYSTEM = ("You are a helpful assistant. Answer the user's questions accurately and briefly, in plain "
          "English, and say so when you are not sure.")


def mtbench(conversations: int, max_new_tokens: int, seed: int = 0) -> list[dict]:
    text = corpus._Text(seed + 7)
    rows = []
    for i in range(conversations):
        first = text.about(text.log_uniform(25, 90)) + " Explain this briefly."
        second = "Now " + text.about(text.log_uniform(15, 40)).lower() + " How does that change your answer?"
        rows.append({"id": f"mt{i}", "max_new_tokens": max_new_tokens, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": first},
            {"role": "assistant", "content": None}, {"role": "user", "content": second},
            {"role": "assistant", "content": None}]})
    return rows


def turns8(conversations: int, max_new_tokens: int, seed: int = 0, turns: int = 8) -> list[dict]:
    text = corpus._Text(seed + 8)
    rows = []
    for i in range(conversations):
        messages = [{"role": "system", "content": SYSTEM}]
        for _ in range(turns):
            messages += [{"role": "user", "content": text.about(text.log_uniform(20, 60))},
                         {"role": "assistant", "content": None}]
        rows.append({"id": f"c{i}", "max_new_tokens": max_new_tokens, "messages": messages})
    return rows


WORKLOADS = {"mtbench": (mtbench, 80), "turns8": (turns8, 8)}


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def batchgen(jobs: Path, out: Path, args: list[str]) -> tuple[float, dict, list[dict]]:
    """One whole `batchgen process`: its wall seconds, summary and output rows."""
    import pyarrow.parquet as pq

    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "batchgen", "process", str(jobs), "-o", str(out), "--overwrite", *args],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.monotonic() - began
    return wall, json.loads(Path(str(out) + ".summary.json").read_text()), pq.read_table(out).to_pylist()


def one_run(jobs: list[dict], work: Path, args: list[str]) -> dict:
    wall, summary, rows = batchgen(write(work / "all.jsonl", jobs), work / "all.parquet", args)
    return {"wall": wall, "prefill": summary["prefill_tokens"], "runs": 1,
            "turns": {r["id"]: r["turns"] for r in rows},
            "context": sum(r["prompt_tokens"] for r in rows), "later_cached": summary["carried_tokens"]}


def per_turn(jobs: list[dict], work: Path, args: list[str], each=None) -> dict:
    """Turn k's run: each conversation's messages up to its k-th turn to generate, the earlier
    ones filled in with the answers the earlier runs wrote. `each`: a context giving each run its
    own arguments (a fresh server per run, as `--engine vllm` starts one per process)."""
    answers: dict[str, list[str]] = {j["id"]: [] for j in jobs}
    wall = prefill = runs = context = later_cached = prompt = 0
    turns = max(sum(m["content"] is None for m in j["messages"]) for j in jobs)
    for k in range(turns):
        batch = []
        for j in jobs:
            messages, seen = [], 0
            for m in j["messages"]:
                if m["content"] is None:
                    if seen == k:
                        break
                    m = {"role": "assistant", "content": answers[j["id"]][seen]}
                    seen += 1
                messages.append(m)
            batch.append({"id": j["id"], "max_new_tokens": j["max_new_tokens"], "messages": messages})
        if each is None:
            w, summary, rows = batchgen(write(work / f"turn{k}.jsonl", batch), work / f"turn{k}.parquet", args)
        else:
            with each() as own:
                w, summary, rows = batchgen(write(work / f"turn{k}.jsonl", batch), work / f"turn{k}.parquet", own)
        wall, prefill, runs = wall + w, prefill + summary["prefill_tokens"], runs + 1
        prompt += summary["prompt_tokens"]
        later_cached += summary["cached_tokens"] if k else 0
        for r in rows:
            answers[r["id"]].append(r["completion"])
        context = sum(r["prompt_tokens"] for r in rows)  # the last run's: each conversation's final context
    return {"wall": wall, "prefill": prefill, "runs": runs, "turns": answers, "context": context,
            "later_cached": later_cached, "prompt": prompt}


@contextmanager
def vllm_server(work: Path, threads: int):
    """A fresh `vllm serve` of the default model (untimed), and the batchgen arguments that use it."""
    from batchgen.pipeline.serve.vllm_server import VllmServer
    from bench.bench_vllm import model_dir

    os.environ["VLLM_THREADS"] = str(threads)
    server = VllmServer(str(ROOT / "bench" / "vllm_cpu_serve.sh"), model_dir(), "m", str(work / "vllm.log"),
                        ["--dtype", "float32", "--enforce-eager", "--max-num-seqs", "64", "--max-model-len", "4096",
                         # the CPU build's default block of 128 tokens caches no MT-bench history (a turn 1 of
                         # 60-130 prompt tokens); 32 is the smallest it takes gladly (a GPU's default is 16)
                         "--block-size", "32"])
    server.spawn()
    try:
        server.wait()
        yield ["--dtype", "float32", "--server", server.url]
    finally:
        server.stop()


def per_turn_fresh(jobs: list[dict], work: Path, args: list[str], threads: int) -> dict:
    """Per turn, each run on a server of its own (what `--engine vllm` per run does): turn 2's
    server has none of turn 1 in its prefix cache."""
    return per_turn(jobs, work, args, each=lambda: vllm_server(work, threads))


def timed(system, jobs: list[dict], work: Path, args: list[str], engine: str, threads: int) -> dict:
    if engine == "local":
        return system(jobs, work, args)
    if system is per_turn_fresh:
        return system(jobs, work, args, threads)
    with vllm_server(work, threads) as served:
        return system(jobs, work, served)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="mtbench,turns8")
    parser.add_argument("--turns", type=int, default=2, help="alternations of the two systems")
    parser.add_argument("--conversations", type=int, default=None, help="per workload (default: 80 and 8)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--engine", choices=["local", "vllm"], default="local")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="vLLM's threads (--engine vllm)")
    opts = parser.parse_args()
    args = ["--dtype", "float32", "--min-shared-tokens", "8"]
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    print(f"CPU: {cpu}; {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    results = {}
    for name in opts.workloads.split(","):
        build, count = WORKLOADS[name]
        jobs = build(opts.conversations or count, opts.max_new_tokens)
        runs: dict[str, list[dict]] = {"one run": [], "per turn": []}
        order = [("one run", one_run), ("per turn", per_turn)]
        if opts.engine == "vllm":  # per turn on one running server (its cache may keep turn 1), or a server each
            runs["per turn, a server each"] = []
            order.append(("per turn, a server each", per_turn_fresh))
        with tempfile.TemporaryDirectory() as tmp:
            for t in range(opts.turns):
                for label, system in (order if t % 2 == 0 else order[::-1]):
                    runs[label].append(timed(system, jobs, Path(tmp), args, opts.engine, opts.threads))
        one, per = runs["one run"], runs["per turn"]
        same = sum(a == b for r1, r2 in zip(one, per) for a, b in zip(
            (r1["turns"][j["id"]] for j in jobs), (r2["turns"][j["id"]] for j in jobs)))
        ratio = statistics.median(p["wall"] / o["wall"] for o, p in zip(one, per))
        print(f"\n{name} ({opts.engine}): {len(jobs)} conversations, {sum(len(x) for x in one[0]['turns'].values())} turns, "
              f"max_new_tokens {opts.max_new_tokens}; conversations equal in both: {same} of {len(jobs) * len(one)}")
        prompt = per[0]["prompt"]  # every turn's prompts: the same in both where the turns are equal
        print(f"prompt tokens of every turn: {prompt:,}")
        print("| system | processes | wall s (median) | prefill tokens | prefill / final contexts "
              "| later turns' cached tokens |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, got in runs.items():
            print(f"| {label} | {got[0]['runs']} | {statistics.median(r['wall'] for r in got):.1f} | "
                  f"{got[0]['prefill']:,} | {got[0]['prefill'] / got[0]['context']:.2f} | {got[0]['later_cached']:,} |")
        for label, got in runs.items():
            if label != "one run":
                r = statistics.median(p["wall"] / o["wall"] for o, p in zip(one, got))
                print(f"one run faster than {label} by {r:.2f}x (median over {len(one)} alternations); walls: "
                      + ", ".join(f"{o['wall']:.1f} vs {p['wall']:.1f}" for o, p in zip(one, got)))
        results[name] = {"cpu": cpu, "engine": opts.engine, "prompt_tokens": prompt,
                         "runs": {k: [{x: r[x] for x in ("wall", "prefill", "runs", "context", "later_cached")}
                                      for r in v]
                                              for k, v in runs.items()}, "speedup": ratio, "equal": same}
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
