"""lm-evaluation-harness, whole runs: `--model batchgen` against `--model hf` on a local 5-shot
multiple-choice task (every question of a subject under one few-shot header, four choices each),
on the embedded model, float32, in turns in one script.

The task is written to a temp dir: `--subjects` subjects x `--questions` questions from real
English text (`bench/corpus.py`). Each system runs as `python -m lm_eval` would, in its own process
(`batchgen-lm-eval`, lm-eval's own command line with batchgen registered); the wall time counts
everything. The hf backend runs at each `--hf-batch-sizes` (a fair tuning of its one knob).

    python -m bench.bench_lm_eval --subjects 2 --questions 32 --turns 2
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASK = """task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    train: {dir}/train.jsonl
    test: {dir}/test.jsonl
output_type: multiple_choice
fewshot_split: train
test_split: test
fewshot_config:
  sampler: first_n
doc_to_text: "{{{{question}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
target_delimiter: " "
num_fewshot: 5
metric_list:
  - metric: acc
"""


def write_task(d: Path, subjects: int, questions: int, seed: int = 0) -> None:
    """One task per subject (lm-eval samples the few-shot header per task): bench_mc_<s>."""
    from bench import corpus

    rng = random.Random(seed)
    pool = corpus.sentences()

    def row():
        length = int(30 * (400 / 30) ** rng.random())  # question tokens, log-uniform 30..400
        words = []
        while len(" ".join(words)) < length * corpus.CHARS_PER_TOKEN:
            words += rng.choice(pool).split()
        return {"question": " ".join(words), "choices": [" ".join(rng.choice(pool).split()[:5]) for _ in range(4)],
                "answer": rng.randrange(4)}

    names = []
    for s in range(subjects):
        sub = d / f"s{s}"
        sub.mkdir()
        (sub / "train.jsonl").write_text("".join(json.dumps(row()) + "\n" for _ in range(5)))
        (sub / "test.jsonl").write_text("".join(json.dumps(row()) + "\n" for _ in range(questions)))
        text = TASK.format(dir=sub).replace("task: bench_mc", f"task: bench_mc_{s}")
        (d / f"bench_mc_{s}.yaml").write_text(text)
        names.append(f"bench_mc_{s}")
    (d / "names.txt").write_text(",".join(names))


def run(cmd: list[str], env: dict) -> float | str:
    """The run's wall seconds, or why it failed (a peer killed for memory is a result, not a crash)."""
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode < 0:
        return f"killed by signal {-proc.returncode} after {time.perf_counter() - t:.0f} s (out of memory?)"
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else ''}"
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subjects", type=int, default=2)
    p.add_argument("--questions", type=int, default=32, help="questions per few-shot header")
    p.add_argument("--turns", type=int, default=2)
    # 64 ran out of memory here: hf holds a batch's whole logits (rows x ~600 x 49,152 floats) several times
    p.add_argument("--hf-batch-sizes", default="16,32")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args()
    from batchgen.pipeline.model.load import default_model_path

    model_dir = default_model_path()
    bindir = Path(sys.executable).parent
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_task(tmp, args.subjects, args.questions)
        tasks = (tmp / "names.txt").read_text()
        common = ["--tasks", tasks, "--include_path", str(tmp), "--device", "cpu"]
        systems = {"batchgen": [str(bindir / "batchgen-lm-eval"), "--model", "batchgen", "--model_args",
                                f"pretrained={model_dir},dtype=float32,threads={args.threads}", *common]}
        for b in args.hf_batch_sizes.split(","):
            systems[f"hf (batch {b})"] = [str(bindir / "lm_eval"), "--model", "hf", "--model_args",
                                          f"pretrained={model_dir},dtype=float32", "--batch_size", b, *common]
        walls: dict[str, list[float]] = {name: [] for name in systems}
        failed: dict[str, str] = {}
        names = list(systems)
        for turn in range(args.turns):
            for name in [n for n in names[turn % len(names):] + names[: turn % len(names)] if n in names]:
                got = run(systems[name], env)
                if isinstance(got, str):
                    failed[name] = got
                    names.remove(name)
                else:
                    walls[name].append(got)
                print(f"turn {turn + 1} {name}: {got if isinstance(got, str) else f'{got:.1f} s'}", file=sys.stderr,
                      flush=True)
        work = prefill_work(tmp, tasks)
    base = statistics.median(walls["batchgen"])
    print(f"### lm-eval, {args.subjects} subjects x {args.questions} questions x 4 choices, 5-shot, "
          f"{args.threads} threads, float32\n")
    print(f"batchgen prefill {work['prefill']} tokens; radix lower bound {work['bound']}; "
          f"{work['prompt']} tokens in the requests\n")
    print("| system | wall s (median) | min-max | batchgen faster by |")
    print("|---|---:|---:|---:|")
    for name, why in failed.items():
        print(f"| {name} | {why} | | |")
    for name, w in walls.items():
        if not w:
            continue
        mid = statistics.median(w)
        print(f"| {name} | {mid:.1f} | {min(w):.1f}-{max(w):.1f} | {mid / base:.2f}x |")
    return 0


def prefill_work(task_dir: Path, tasks: str) -> dict[str, int]:
    """The engine's prefill on exactly the requests lm-eval builds, and the radix-tree bound."""
    from lm_eval.tasks import TaskManager, get_task_dict

    import batchgen.pipeline.evalharness  # noqa: F401
    from batchgen.pipeline.engine.engine import Engine
    from batchgen.pipeline.engine.prefix_tree import PrefixTree
    from batchgen.pipeline.engine.types import Request, SamplingParams

    lm = __import__("lm_eval.api.registry", fromlist=["get_model"]).get_model("batchgen").create_from_arg_string(
        "dtype=float32", {})
    requests = []
    for task in get_task_dict(tasks.split(","), TaskManager(include_path=str(task_dir))).values():
        task.build_all_requests(limit=None, rank=0, world_size=1)
        requests += [inst.args for inst in task.instances]
    pairs = [lm._encode_pair(c, x) if c else ([lm.prefix_token_id], lm.tok_encode(x)) for c, x in requests]
    reqs = [Request(i, ctx + cont, SamplingParams(max_new_tokens=0), score_from=len(ctx))
            for i, (ctx, cont) in enumerate(pairs)]
    engine = Engine(lm.engine.model, eos_token_ids=[])
    engine.generate(reqs)
    full = PrefixTree()
    for r in reqs:
        full.insert(r.key, r.prompt_ids[:-1])  # the last continuation token is never fed
    return {"prefill": engine.stats.prefill_tokens, "bound": full.token_count(),
            "prompt": sum(len(r.prompt_ids) - 1 for r in reqs)}


if __name__ == "__main__":
    raise SystemExit(main())
