"""Worker processes for `validate` and `plan` (pipeline/run/workers.py): answers in submission order,
a task's error raised in the caller, a worker that dies named; and the commands' outputs the same
with workers as without, on an input of many chunks with plain rows, Jobs and bad lines."""
import json
import math
import operator
import os
import random
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from batchgen.jobs import GenerationDefaults
from batchgen.pipeline.cli import main
from batchgen.pipeline.run import inputrows, preflight
from batchgen.pipeline.run.options import RunOptions
from batchgen.pipeline.run.planning import describe
from batchgen.pipeline.run.preflight import check_inputs
from batchgen.pipeline.run.workers import Workers
from tests.helpers.cli_helpers import die


def test_answers_come_in_submission_order_and_errors_are_raised_here():
    with Workers(2) as pool:
        assert pool.map(math.factorial, [(n,) for n in range(12)]) == [math.factorial(n) for n in range(12)]
        late = pool.submit(operator.truediv, 1, 0)
        fine = pool.submit(operator.add, 2, 3)
        with pytest.raises(ZeroDivisionError):
            late.result()
        assert fine.result() == 5 and fine.result() == 5  # taken once, kept
        assert pool.map(sorted, [([3, 1, 2],)]) == [[1, 2, 3]]  # the pool goes on after a task's error


def test_a_worker_that_dies_is_an_error_not_a_hang():
    with Workers(1) as pool:
        gone = pool.submit(os._exit, 3)
        with pytest.raises(RuntimeError, match="worker process stopped .exit status 3"):
            gone.result()


def test_an_answer_that_cannot_travel_is_an_error():
    with Workers(1) as pool:
        with pytest.raises(RuntimeError, match="could not be sent"):
            pool.submit(threading.Lock).result()  # a lock does not pickle
        assert pool.submit(abs, -2).result() == 2


def test_a_failed_run_stops_its_workers_at_once():
    """Leaving with an error kills them: a run does not wait for the chunks it had sent ahead."""
    start = time.monotonic()
    with pytest.raises(KeyError):
        with Workers(2) as pool:
            pool.map(abs, [(1,), (2,)])  # started
            pool.submit(time.sleep, 30)
            raise KeyError("boom")
    assert time.monotonic() - start < 20


def test_a_script_without_a_main_guard_can_use_them(tmp_path):
    """Workers are their own programs: the caller's main module is not run again in them."""
    script = tmp_path / "unguarded.py"
    script.write_text("import math\nfrom batchgen.pipeline.run.workers import Workers\n"
                      "pool = Workers(2)\nprint(pool.map(math.isqrt, [(16,), (81,), (4,)]))\npool.close()\n")
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[4, 9, 2]"


@pytest.fixture()
def many_chunks(tmp_path, monkeypatch):
    """1,200 rows in chunks of 50 (workers from row 150 on): plain rows under four heads, rows
    that are Jobs (their own parameters), one that does not fit the context window, bad lines."""
    monkeypatch.setattr(inputrows, "CHUNK_ROWS", 50)
    monkeypatch.setattr(preflight, "MIN_WORKER_ROWS", 150)
    rng = random.Random(3)
    heads = [f"{w} says: think it through and answer briefly. " for w in ("Ann", "Bob", "Cy", "Di")]
    lines = []
    for i in range(1200):
        row = {"id": f"r{i}", "prompt": heads[rng.randrange(4)] + f"Question {i}: {rng.random():.6f}?"}
        if i % 97 == 0:
            row["temperature"] = 0.5  # a Job, not a plain row
        if i == 700:
            row["prompt"] = "x" * 5000  # past the tiny model's window
        lines.append(json.dumps(row))
        if i % 311 == 5:
            lines.append("{not json")
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plan_and_validate_are_the_same_with_workers(many_chunks, model_dir, monkeypatch):
    tasks = []
    real = Workers.submit
    monkeypatch.setattr(Workers, "submit", lambda self, fn, *a: tasks.append(fn.__name__) or real(self, fn, *a))
    defaults = GenerationDefaults(max_new_tokens=4)
    plans = [describe([str(many_chunks)], defaults, model=str(model_dir), min_shared_tokens=8, window_jobs=300,
                      workers=w) for w in (0, 2)]
    assert plans[0] == plans[1] and plans[0]["windows"] > 1 and plans[0]["invalid"] == 5
    # chunks 4 on (rows 150 on) tokenized in the workers, then every window planned there
    assert tasks.count("tokenize_in_worker") >= 20 and tasks.count("plan_window") == plans[0]["windows"]
    checked = [check_inputs([str(many_chunks)], RunOptions(model=str(model_dir), defaults=defaults, workers=w),
                            purpose="validate") for w in (0, 2)]
    assert list(checked[0].invalid.lines()) == list(checked[1].invalid.lines())
    assert (checked[0].orders == checked[1].orders).all() and checked[0].total == checked[1].total == 1204
    assert tasks.count("tokenize_in_worker") >= 40


def test_a_worker_killed_mid_run_is_one_line_from_the_cli(many_chunks, model_dir, monkeypatch):
    """As the out-of-memory killer would: the command fails with one line, no traceback."""
    monkeypatch.setattr(preflight, "tokenize_in_worker", die)
    monkeypatch.setattr("batchgen.pipeline.run.workers.worker_count", lambda: 2)
    for command in (["plan", "--json"], ["validate"]):
        res = CliRunner().invoke(main, [command[0], str(many_chunks), *command[1:], "--model", str(model_dir)])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        assert "worker process stopped (exit status 9)" in res.output and "Traceback" not in res.output


def test_the_cli_uses_workers_and_says_the_same(many_chunks, model_dir, monkeypatch):
    args = ["--model", str(model_dir), "--max-new-tokens", "4"]
    out = {}
    for count in (1, 2):
        monkeypatch.setattr("batchgen.pipeline.run.workers.worker_count", lambda: count)
        res = CliRunner().invoke(main, ["plan", str(many_chunks), "--json", *args])
        assert res.exit_code == 0, res.output
        valid = CliRunner().invoke(main, ["validate", str(many_chunks), *args])
        assert valid.exit_code == 1  # the bad lines and the long prompt
        out[count] = (json.loads(res.stdout), valid.output)
    assert out[1] == out[2] and "context window" in out[1][1]
