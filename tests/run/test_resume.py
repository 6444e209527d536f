"""Never lose a job: crashes, preemption, option changes, out-of-memory, shards, junk input."""
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.helpers.jobsets import edge_case_requests, tokenizer
from batchgen.pipeline.cli import main
from batchgen.pipeline.engine.engine import Engine
from tests.helpers.tiny_models import make_model

HEAD = "Shared instructions for every job: reply with a short and friendly sentence. "


@pytest.fixture(scope="module")
def jobs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("jobs") / "jobs.jsonl"
    rows = [{"id": f"j{i}", "prompt": HEAD + f"Item {i} of the list?", "n": 1 + (i % 3 == 0), "k": i}
            for i in range(60)]
    rows.insert(7, "{broken")
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ARGS = ["--max-new-tokens", "6", "--max-batch-tokens", "300", "--min-shared-tokens", "4", "--commit-every", "4"]


def cli(args, model_dir):
    result = CliRunner().invoke(main, [*args, "--model", str(model_dir)])
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, model_dir, jobs_file):
    out = tmp_path_factory.mktemp("ref") / "out.parquet"
    res = cli(["process", str(jobs_file), "-o", str(out), *ARGS], model_dir)
    assert res.exit_code == 0, res.output
    return pq.read_table(out).to_pylist(), pq.read_table(str(out) + ".errors.parquet").to_pylist()


def spawn(model_dir, jobs_file, out, extra_env=None, args=ARGS):
    env = {**os.environ, "BATCHGEN_MODEL": str(model_dir), **(extra_env or {})}
    return subprocess.Popen([sys.executable, "-m", "batchgen", "process", str(jobs_file), "-o", str(out), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_commit(out, proc, timeout=120):
    manifest = str(out) + ".parts/manifest.json"
    deadline = time.monotonic() + timeout
    while not os.path.exists(manifest):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)


def check_same(out, uninterrupted):
    rows, errors = uninterrupted
    assert pq.read_table(out).to_pylist() == rows
    assert pq.read_table(str(out) + ".errors.parquet").to_pylist() == errors
    assert not os.path.exists(str(out) + ".parts")
    assert not [f for f in os.listdir(os.path.dirname(out)) if ".tmp-" in f]
    ids = [(r["id"], r["sample_index"]) for r in rows]
    assert len(ids) == len(set(ids))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["after-commit", "final-write"])
def test_sigkill_at_a_fault_point_then_rerun_equals_an_uninterrupted_run(tmp_path, model_dir, jobs_file,
                                                                         uninterrupted, fault):
    out = tmp_path / "out.parquet"
    proc = spawn(model_dir, jobs_file, out, {"BATCHGEN_FAULT": fault})
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists(), "a reader never sees a half-written output"
    assert os.path.exists(str(out) + ".parts/manifest.json")
    res = cli(["process", str(jobs_file), "-o", str(out), *ARGS], model_dir)
    assert res.exit_code == 0, res.output
    check_same(out, uninterrupted)
    summary = json.loads(open(str(out) + ".summary.json").read())
    assert summary["resumed_jobs"] > 0


@pytest.mark.slow
def test_sigkill_mid_batch_then_rerun(tmp_path, model_dir, jobs_file, uninterrupted):
    out = tmp_path / "out.parquet"
    proc = spawn(model_dir, jobs_file, out)
    wait_for_commit(out, proc)
    proc.send_signal(signal.SIGKILL)  # the next batch is in flight
    proc.communicate(timeout=60)
    res = cli(["process", str(jobs_file), "-o", str(out), *ARGS], model_dir)
    assert res.exit_code == 0, res.output
    check_same(out, uninterrupted)


@pytest.mark.slow
def test_sigterm_commits_and_exits_75_then_resumes(tmp_path, model_dir, jobs_file, uninterrupted):
    out = tmp_path / "out.parquet"
    proc = spawn(model_dir, jobs_file, out)
    wait_for_commit(out, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert "rerun the same command to resume" in err
    assert not out.exists()
    res = cli(["process", str(jobs_file), "-o", str(out), *ARGS], model_dir)
    assert res.exit_code == 0, res.output
    check_same(out, uninterrupted)


def test_a_rerun_with_other_options_refuses_to_mix(tmp_path, model_dir, jobs_file, uninterrupted):
    out = tmp_path / "out.parquet"
    res = cli(["process", str(jobs_file), "-o", str(out), *ARGS, "--commit-every", "1000"], model_dir)
    assert res.exit_code == 0
    # a finished output is never replaced without --overwrite
    res = cli(["process", str(jobs_file), "-o", str(out), *ARGS], model_dir)
    assert res.exit_code == 1 and "--overwrite" in res.output
    # unfinished work of other options is not mixed in
    parts = tmp_path / "out2.parquet.parts"
    os.makedirs(parts)
    (parts / "manifest.json").write_text(json.dumps({"key": "other", "settings": {"model": "x"}, "parts": []}))
    res = cli(["process", str(jobs_file), "-o", str(tmp_path / "out2.parquet"), *ARGS], model_dir)
    assert res.exit_code == 1 and "other jobs, options or model" in res.output and "--overwrite" in res.output
    res = cli(["process", str(jobs_file), "-o", str(tmp_path / "out2.parquet"), *ARGS, "--overwrite"], model_dir)
    assert res.exit_code == 0
    check_same(tmp_path / "out2.parquet", uninterrupted)


def test_on_error_fail_stops_before_generation(tmp_path, model_dir, jobs_file):
    out = tmp_path / "out.parquet"
    res = cli(["process", str(jobs_file), "-o", str(out), *ARGS, "--on-error", "fail"], model_dir)
    assert res.exit_code == 1
    assert f"{jobs_file}:8: " in res.output and "nothing was generated" in res.output
    assert not out.exists() and not os.path.exists(str(out) + ".parts")


def test_out_of_memory_splits_the_batch_and_the_run_goes_on(monkeypatch):
    tok = tokenizer()
    model = make_model("llama")
    reqs = edge_case_requests(tok, max_new_tokens=5)
    poison = 251  # a token no other prompt holds: any forward that feeds it runs out of memory
    assert not any(poison in r.prompt_ids for r in reqs)
    reqs[3].prompt_ids = reqs[3].prompt_ids + [poison]
    want = sorted((c.key, c.sample_index, c.token_ids) for c in Engine(model, eos_token_ids=[2]).run(reqs))
    real = model.forward

    def limited(*args, input_ids=None, **kw):
        # "CUDA" runs out of memory above 3 decoding rows, and in any forward that feeds the poison
        step = kw.get("batchgen_step")
        if not hasattr(step, "n_dec"):  # the engine's probe of the model's layers (its own stand-in step)
            return real(*args, input_ids=input_ids, **kw)
        if step.n_dec > 3 or (input_ids == poison).any():
            raise torch.OutOfMemoryError("injected")
        return real(*args, input_ids=input_ids, **kw)

    monkeypatch.setattr(model, "forward", limited)
    engine = Engine(model, eos_token_ids=[2], min_shared_tokens=4)
    got = engine.generate(reqs)
    assert engine.stats.oom_splits > 0
    failed = {c.key for c in got if c.error}
    assert failed == {3} and next(c.error for c in got if c.error) == "out of memory"
    ok = sorted((c.key, c.sample_index, c.token_ids) for c in got if not c.error)
    assert ok == [w for w in want if w[0] not in failed]


def test_shards_merge_to_the_single_run_without_duplicated_prefill(tmp_path, model_dir, jobs_file, uninterrupted):
    outs, prefill = [], 0
    for i in range(3):
        out = tmp_path / f"shard-{i}.parquet"
        res = cli(["process", str(jobs_file), "-o", str(out), *ARGS, "--shard", f"{i}/3"], model_dir)
        assert res.exit_code == 0, res.output
        prefill += json.loads(open(str(out) + ".summary.json").read())["prefill_tokens"]
        outs.append(str(out))
    merged = tmp_path / "all.parquet"
    res = CliRunner().invoke(main, ["merge", *outs[:2], "-o", str(merged)])
    assert res.exit_code == 1 and "exactly once" in res.output  # a shard is missing
    res = CliRunner().invoke(main, ["merge", *outs, "-o", str(merged)])
    assert res.exit_code == 0, res.output
    rows, errors = uninterrupted
    assert pq.read_table(merged).to_pylist() == rows
    assert pq.read_table(str(merged) + ".errors.parquet").to_pylist() == errors
    single = tmp_path / "single.parquet"
    cli(["process", str(jobs_file), "-o", str(single), *ARGS], model_dir)
    assert prefill == json.loads(open(str(single) + ".summary.json").read())["prefill_tokens"]


# text a UTF-8 file can hold: no line breaks, no lone surrogates (invalid bytes: test_bad_inputs)
JUNK = st.one_of(st.text(alphabet=st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",)),
                         max_size=20),
                 st.just('{"prompt": ""}'), st.just('{"prompt": "x", "messages": []}'),
                 st.just('{"prompt": "ok", "max_new_tokens": -3}'), st.just("[1, 2]"))


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.one_of(st.tuples(st.just("job"), st.integers(0, 6)), st.tuples(st.just("junk"), JUNK)),
                min_size=1, max_size=12))
def test_every_input_row_lands_exactly_once_in_output_or_errors(tmp_path_factory, model_dir, lines):
    d = tmp_path_factory.mktemp("prop")
    src, out = d / "jobs.jsonl", d / "out.parquet"
    text = []
    for kind, value in lines:
        # job ids repeat on purpose: a repeated id is an error on its later rows
        text.append(json.dumps({"id": f"id{value}", "prompt": HEAD + str(value)}) if kind == "job" else value)
    src.write_text("".join(t + "\n" for t in text))
    res = cli(["process", str(src), "-o", str(out), "--max-new-tokens", "2", "--min-shared-tokens", "4"], model_dir)
    assert res.exit_code == 0, res.output
    records = [i + 1 for i, t in enumerate(text) if t.strip()]
    done = pq.read_table(out).column("id").to_pylist()
    errs = pq.read_table(str(out) + ".errors.parquet").to_pylist() if os.path.exists(str(out) + ".errors.parquet") else []
    assert len(done) == len(set(done))
    err_lines = [int(e["location"].rsplit(":", 1)[1]) for e in errs]
    assert len(err_lines) == len(set(err_lines))
    assert len(done) + len(errs) == len(records)
