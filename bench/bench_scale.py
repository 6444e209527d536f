"""A million jobs on one machine: wall time and peak RSS of `validate`, `plan` and
`process --max-new-tokens 1` as the number of jobs grows.

Synthetic jobs of the issue's shape: 20 system prompts of about 250 tokens, each job one of them
plus a ~20-token suffix of random words (unique per job), and one malformed line per 10,000 so
the errors path runs too. With `--carried`, each job also carries two columns to the output (a
subject and a source record), as dataset rows do. The model is a tiny random Llama with the
tests' character-level tokenizer (tests/helpers/tiny_models.py, tests/helpers/tiny_tokenizer.py), saved to a
temporary directory. With `--tokenizer default`, `validate` and `plan` run on the embedded default
model instead (SmolLM2's byte-level BPE, about 4 characters a token), the prompts sized in its tokens:
what a user's file meets.

Every command runs as its own process (`python -m batchgen ...`); its peak RSS is the kernel's
(`os.wait4`), file-backed pages included; the worker processes `validate` and `plan` start on a
big input (pipeline/run/workers.py) are reported apart, their peaks summed. "model" is the peak RSS of a process that only imports
batchgen's engine and loads the model: `process` is reported above it too. After each `process`
the output is checked: every input row once, in the output or in the errors file.

    PYTHONPATH=. python -m bench.bench_scale --sizes 10000,100000,1000000
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPS, PREFIX_TOKENS, SUFFIX_WORDS = 20, 250, 4
BAD_EVERY = 10_000
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level").split()


def make_model(where: Path) -> None:
    sys.path.insert(0, str(ROOT))  # the tests' helpers: tests.helpers
    from tests.helpers.tiny_models import make_model as tiny_model
    from tests.helpers.tiny_tokenizer import make_tokenizer

    tiny_model("llama").save_pretrained(where)
    make_tokenizer().save_pretrained(where)


def make_jobs(path: Path, n: int, tokens_per_char: float = 1.0, carried: bool = False) -> None:
    rng = random.Random(0)
    heads = []
    for g in range(GROUPS):
        words = []
        while len(" ".join(words)) < PREFIX_TOKENS / tokens_per_char:
            words.append(rng.choice(WORDS))
        heads.append(f"System {g}: " + " ".join(words)[: int(PREFIX_TOKENS / tokens_per_char)])
    with open(path, "w") as f:
        for i in range(n):
            if i % BAD_EVERY == BAD_EVERY - 1:
                f.write("{not json\n")
                continue
            suffix = " ".join(rng.choice(WORDS) for _ in range(SUFFIX_WORDS))
            group = rng.randrange(GROUPS)
            row = {"id": i, "prompt": f"{heads[group]}\nTask {i}: {suffix}"}
            if carried:
                row.update(subject=f"subject {group}", source={"set": "bench", "row": i})
            f.write(json.dumps(row) + "\n")


def _children_peaks(pid: int, peaks: dict[int, int], done: threading.Event) -> None:
    """Each child process's peak RSS (VmHWM, kB), read every 0.2 s until `done`: the kernel's
    wait4 reports the largest of a process and its children, not their sum."""
    while not done.wait(0.2):
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                    continue
                status = (stat.parent / "status").read_text()
            except (OSError, IndexError, ValueError):
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peaks[int(stat.parent.name)] = max(peaks.get(int(stat.parent.name), 0), int(line.split()[1]))


def measure(args: list[str], env: dict[str, str]) -> tuple[float, float, int, str, float]:
    """(wall s, peak RSS MB, exit code, stderr tail, the peak RSS of its worker processes summed, MB)
    of one command in its own process."""
    start = time.monotonic()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    done = threading.Event()
    watch = threading.Thread(target=_children_peaks, args=(proc.pid, peaks, done), daemon=True)
    watch.start()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    watch.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.monotonic() - start, usage.ru_maxrss / 1024, proc.returncode, err[-600:], sum(peaks.values()) / 1024


def check_exactly_once(src: Path, out: Path) -> str:
    import pyarrow.parquet as pq

    lines = sum(1 for line in open(src) if line.strip())
    ids = pq.read_table(out, columns=["id", "sample_index"])
    errors_file = Path(str(out) + ".errors.parquet")
    errors = pq.read_table(errors_file).num_rows if errors_file.exists() else 0
    done = ids.column("id").to_numpy()
    ordered = bool((done[1:] > done[:-1]).all())  # ids are row numbers: input order, each once
    ok = len(done) + errors == lines and ordered
    return f"{len(done)} rows + {errors} errors = {len(done) + errors} of {lines}, in order: {'ok' if ok else 'FAILED'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--commands", default="validate,plan,process")
    ap.add_argument("--workdir", default=None, help="where jobs, model and outputs go (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (OMP_NUM_THREADS) of every command")
    ap.add_argument("--carried", action="store_true", help="jobs carry two columns through to the output")
    ap.add_argument("--tokenizer", choices=["tiny", "default"], default="tiny",
                    help="the tests' character-level tokenizer (a tiny random Llama), or the embedded default model's")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.tokenizer == "default":
        sys.path.insert(0, str(ROOT))
        from batchgen.pipeline.model.default_model import default_model_path

        model, per_char, tag = default_model_path(), 0.25, "bpe-"
    else:
        model, per_char, tag = work / "tiny-llama", 1.0, ""
        if not (model / "config.json").exists():
            make_model(model)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    py = [sys.executable, "-m", "batchgen"]
    probe = [sys.executable, "-c", "import batchgen.pipeline.engine.engine; from batchgen.pipeline.model.load import load_model; "
             f"load_model({str(model)!r}, 'cpu', 'float32')"]
    _, model_rss, _, _, _ = measure(probe, env)
    print(f"model loaded: peak RSS {model_rss:.0f} MB", flush=True)
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        src = work / f"jobs-{tag}{'carried-' if args.carried else ''}{n}.jsonl"
        if not src.exists():
            make_jobs(src, n, tokens_per_char=per_char, carried=args.carried)
        for command in args.commands.split(","):
            cmd = py + [command, str(src), "--model", str(model), "--max-new-tokens", "1"]
            note = ""
            if command == "plan":
                cmd += ["--json"]
            if command == "process":
                out = work / f"out-{n}.parquet"
                cmd += ["-o", str(out), "--overwrite", "--progress-every", "600"]
            wall, rss, code, err, workers = measure(cmd, env)
            if command == "process" and code == 0:
                note = check_exactly_once(src, out)
            elif code not in (0, 1):  # validate exits 1: the malformed lines are reported
                note = f"exit {code}: {err}"
            above = f"{rss - model_rss:,.0f}" if command == "process" else ""
            rows.append((n, command, wall, rss, workers, above, note))
            print(f"| {n:,} | {command} | {wall:,.1f} | {rss:,.0f} | {workers:,.0f} | {above} | {note} |", flush=True)
    print("\n| jobs | command | wall s | peak RSS MB | workers' peak RSS MB | RSS above model MB | check |"
          "\n|---:|---|---:|---:|---:|---:|---|")
    for n, command, wall, rss, workers, above, note in rows:
        print(f"| {n:,} | `{command}` | {wall:,.1f} | {rss:,.0f} | {workers:,.0f} | {above} | {note} |")


if __name__ == "__main__":
    main()
