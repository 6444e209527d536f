"""Preemption before generation, precision-safe resume, and summaries that do not depend on how
often a run was interrupted."""
import json
import os
import signal

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.jobs import JobError
from batchgen.pipeline.cli import main
from batchgen.pipeline.run.runner import Preempted, RunOptions, process

HEAD = "Shared instructions for every job: reply with a short and friendly sentence. "
JOB_COUNTS = ("jobs", "completed", "failed", "rows", "prompt_tokens", "cached_tokens", "completion_tokens")


@pytest.fixture
def jobs_file(tmp_path):
    rows = [{"id": f"j{i}", "prompt": HEAD + f"Item {i} of the list?", "n": 1 + (i % 4 == 0)} for i in range(24)]
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    return path


def options(model_dir, **kw):
    from batchgen.jobs import GenerationDefaults

    base = dict(model=str(model_dir), defaults=GenerationDefaults(max_new_tokens=4), min_shared_tokens=4,
                max_batch_tokens=200, commit_every=3)
    return RunOptions(**{**base, **kw})


class Interrupted(BaseException):
    pass


def interrupt_after(jobs):
    def progress(p):
        if p.jobs_done - p.resumed >= jobs:
            raise Interrupted()
    return progress


# --- 10: a SIGTERM while reading or tokenizing exits 75 ---------------------------------------

def test_sigterm_while_reading_exits_75_with_nothing_written(tmp_path, model_dir, jobs_file, monkeypatch):
    import batchgen.jobs.readers

    seen = []
    # stands in for the scheduler's kill: without batchgen's handler the test process would die
    old = signal.signal(signal.SIGTERM, lambda *a: seen.append("ignored by batchgen"))
    real = batchgen.jobs.readers._open_binary

    class Killed:  # the input file, whose sixth line comes with a SIGTERM
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def peek(self, n):
            return self.f.peek(n)

        def __iter__(self):
            for i, line in enumerate(self.f):
                if i == 5:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield line

    monkeypatch.setattr(batchgen.jobs.readers, "_open_binary", lambda path: Killed(real(path)))
    try:
        out = tmp_path / "out" / "out.parquet"
        res = CliRunner().invoke(main, ["process", str(jobs_file), "-o", str(out), "--model", str(model_dir)])
    finally:
        signal.signal(signal.SIGTERM, old)
    assert res.exit_code == 75, res.output + repr(res.exception)
    assert seen == [] and "rerun the same command" in res.output
    assert not (tmp_path / "out").exists()


def test_sigterm_while_loading_the_model_raises_preempted(tmp_path, model_dir, jobs_file, monkeypatch):
    import batchgen.pipeline.model.load

    real = batchgen.pipeline.model.load.load_model

    def load_model(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(batchgen.pipeline.model.load, "load_model", load_model)
    seen = []

    def ours(*a):
        seen.append("ignored by batchgen")

    before = signal.signal(signal.SIGTERM, ours)
    try:
        with pytest.raises(Preempted):
            process([str(jobs_file)], str(tmp_path / "out.parquet"), options(model_dir))
        assert seen == [] and os.listdir(tmp_path) == ["jobs.jsonl"]
        assert signal.getsignal(signal.SIGTERM) is ours  # restored after the run
    finally:
        signal.signal(signal.SIGTERM, before)


# --- 11: resumed work is judged by the resolved precision -------------------------------------

def test_resume_compares_the_resolved_dtype_not_the_option(tmp_path, model_dir, jobs_file, monkeypatch):
    import torch

    import batchgen.pipeline.model.load

    out = str(tmp_path / "out.parquet")

    def parts():
        return len(json.loads(open(out + ".parts/manifest.json").read())["parts"])

    with pytest.raises(Interrupted):
        process([str(jobs_file)], out, options(model_dir, dtype="float32"), progress=interrupt_after(4))
    first = parts()
    # `auto` for this float32 checkpoint is float32: the same precision, so the work resumes
    with pytest.raises(Interrupted):
        process([str(jobs_file)], out, options(model_dir, dtype="auto"), progress=interrupt_after(4))
    assert parts() > first
    # where `auto` resolves to bfloat16 (a bfloat16 checkpoint where it runs natively), finished
    # float32 work must not be mixed in
    real = batchgen.pipeline.model.load.resolve_dtype
    monkeypatch.setattr(batchgen.pipeline.model.load, "resolve_dtype",
                        lambda d, dev, *a: torch.bfloat16 if d == "auto" else real(d, dev, *a))
    with pytest.raises(JobError, match="other jobs, options or model"):
        process([str(jobs_file)], out, options(model_dir, dtype="auto"))
    monkeypatch.setattr(batchgen.pipeline.model.load, "resolve_dtype", real)
    summary = process([str(jobs_file)], out, options(model_dir, dtype="auto"))
    assert summary["resumed_jobs"] == 7 and summary["dtype"] == "float32" and summary["device_type"] == "cpu"


def test_resume_of_a_bfloat16_checkpoint_follows_the_machine(tmp_path, jobs_file, monkeypatch):
    """`auto` on a bfloat16 checkpoint is bfloat16 on a CPU with AVX-512 BF16 and float32 on one
    without: work finished on the one is not mixed into a run on the other, and resumes on its own."""
    import torch

    from batchgen.pipeline.model import precision
    from tests.helpers.tiny_models import make_model
    from tests.helpers.tiny_tokenizer import make_tokenizer

    model_dir = tmp_path / "bf16-llama"
    make_model("llama", dtype=torch.bfloat16).save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    out = str(tmp_path / "out.parquet")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    with pytest.raises(Interrupted):
        process([str(jobs_file)], out, options(model_dir), progress=interrupt_after(4))
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512f"}))
    with pytest.raises(JobError, match="other jobs, options or model"):
        process([str(jobs_file)], out, options(model_dir))
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    summary = process([str(jobs_file)], out, options(model_dir))
    assert summary["resumed_jobs"] > 0 and summary["dtype"] == "bfloat16"


# --- 13: the summary of a resumed run equals an uninterrupted run's -----------------------------

def test_a_resumed_runs_summary_equals_an_uninterrupted_runs(tmp_path, model_dir, jobs_file):
    ref = process([str(jobs_file)], str(tmp_path / "ref.parquet"), options(model_dir))
    out = str(tmp_path / "out.parquet")
    for _ in range(3):
        with pytest.raises(Interrupted):
            process([str(jobs_file)], out, options(model_dir), progress=interrupt_after(4))
    summary = process([str(jobs_file)], out, options(model_dir))
    assert summary["resumed_jobs"] > 0
    assert {k: summary[k] for k in JOB_COUNTS} == {k: ref[k] for k in JOB_COUNTS}
    assert summary["jobs"] == 25 and summary["failed"] == 1 and summary["rows"] == 30
    table = pq.read_table(out).to_pylist()
    assert summary["prompt_tokens"] == sum(r["prompt_tokens"] for r in table if r["sample_index"] == 0)
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in table)
    # work counters: all runs' work, so at least the uninterrupted run's
    assert summary["prefill_tokens"] >= ref["prefill_tokens"] and summary["batches"] >= ref["batches"]


def test_merge_keeps_every_summary_field(tmp_path, model_dir, jobs_file):
    outs = []
    for i in range(2):
        out = str(tmp_path / f"shard-{i}.parquet")
        process([str(jobs_file)], out, options(model_dir, shard=f"{i}/2"))
        outs.append(out)
    single = process([str(jobs_file)], str(tmp_path / "single.parquet"), options(model_dir))
    res = CliRunner().invoke(main, ["merge", *outs, "-o", str(tmp_path / "all.parquet")])
    assert res.exit_code == 0, res.output
    merged = json.loads(open(tmp_path / "all.parquet.summary.json").read())
    shard = json.loads(open(outs[0] + ".summary.json").read())
    assert set(shard) <= set(merged), set(shard) - set(merged)
    assert {k: merged[k] for k in JOB_COUNTS} == {k: single[k] for k in JOB_COUNTS}
    for key in ("cascade_batches", "admitted_rows", "prefill_tokens", "decode_steps"):
        assert merged[key] == sum(json.loads(open(o + ".summary.json").read())[key] for o in outs), key


# --- issue 23, 8: job-level counts do not depend on which jobs a resumed run has left -----------

def test_a_resumed_run_of_scoring_and_generating_jobs_has_every_count_of_an_uninterrupted_one(tmp_path, model_dir):
    from tests.helpers.cli_helpers import write_jsonl

    # one context: questions scored, others generated, prompts scored alone, some sharing more
    rows = [{"id": f"q{i}", "prompt": HEAD + f"Q: {i}+{i}?", "continuations": [f" {2 * i}", " 0"]} for i in range(6)]
    rows += [{"id": f"g{i}", "prompt": HEAD + f"Q: {i}?", "n": 1 + (i == 2)} for i in range(6)]
    rows += [{"id": f"p{i}", "prompt": HEAD + f"Q: {i}+{i}? Why", "prompt_logprobs": True, "max_new_tokens": 0}
             for i in range(3)]
    src = str(write_jsonl(tmp_path / "jobs.jsonl", rows))
    opts = options(model_dir, commit_every=2)
    ref = process([src], str(tmp_path / "ref.parquet"), opts)
    out = str(tmp_path / "out.parquet")
    for done in (2, 3, 5):  # each run commits a few more jobs, then is interrupted
        with pytest.raises(Interrupted):
            process([src], out, opts, progress=interrupt_after(done))
    summary = process([src], out, opts)
    assert summary["resumed_jobs"] > 0
    counts = ("id", "sample_index", "prompt_tokens", "cached_tokens", "completion_tokens")
    got, want = pq.read_table(out, columns=list(counts)), pq.read_table(str(tmp_path / "ref.parquet"), columns=list(counts))
    assert got.to_pylist() == want.to_pylist()
    assert {k: summary[k] for k in JOB_COUNTS} == {k: ref[k] for k in JOB_COUNTS}
    # and what the Python API reports, whose engine runs all the jobs in one tree
    import batchgen

    api = batchgen.generate(src, str(model_dir), max_new_tokens=4, min_shared_tokens=4, max_batch_tokens=200,
                            dtype="float32")
    assert [{k: r[k] for k in counts} for r in api] == want.to_pylist()


# --- issue 48, 6: after a resume, this run's work is counted apart from the resumed work ---------

@pytest.mark.slow  # a subprocess, killed
def test_a_resumed_runs_line_and_summary_count_this_runs_work_apart(tmp_path, model_dir, jobs_file):
    """Runs killed after their first commits redo their window's prefill each time: all runs' prefill
    comes to more than the output's prompt tokens, which the last line printed as a negative
    saving. The line and the summary now count this run's jobs and work apart."""
    import re
    import subprocess
    import sys

    out = str(tmp_path / "out.parquet")
    # each run prefills all the jobs left at once (its first batch), and commits one at a time
    args = ["process", str(jobs_file), "-o", out, "--model", str(model_dir), "--max-new-tokens", "4",
            "--min-shared-tokens", "4", "--max-batch-tokens", "4096", "--commit-every", "1"]
    killed = subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "BATCHGEN_FAULT": "after-commit"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    from batchgen.jobs import GenerationDefaults

    same = options(model_dir, defaults=GenerationDefaults(max_new_tokens=4, seed=0), max_batch_tokens=4096,
                   commit_every=1)  # the command's options
    prompts = process([str(jobs_file)], str(tmp_path / "ref.parquet"), same)["prompt_tokens"]
    manifest = out + ".parts/manifest.json"
    for _ in range(20):  # more interrupted runs, until all runs' prefill exceeds the output's prompts
        if json.loads(open(manifest).read())["stats"]["prefill_tokens"] > prompts:
            break
        with pytest.raises(Interrupted):
            process([str(jobs_file)], out, same, progress=interrupt_after(2))
    before = json.loads(open(manifest).read())
    assert before["stats"]["prefill_tokens"] > prompts
    earlier = {r["id"] for part in before["parts"] for f in part["files"] if f.startswith("part-")
               for r in pq.read_table(out + ".parts/" + f, columns=["id"]).to_pylist()}

    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    summary = json.loads(open(out + ".summary.json").read())
    rows = pq.read_table(out).to_pylist()
    mine = [r for r in rows if r["id"] not in earlier]
    assert 0 < len(earlier) and mine
    assert summary["prompt_tokens"] == prompts  # the output's counts: as before
    assert summary["prefill_tokens"] > prompts  # all runs' work, redone work included: as before
    assert summary["resumed_work"] == before["stats"]
    assert summary["run_jobs"] == sum(r["sample_index"] == 0 for r in mine)
    assert summary["run_prompt_tokens"] == sum(r["prompt_tokens"] for r in mine if r["sample_index"] == 0)
    assert summary["run_completion_tokens"] == sum(r["completion_tokens"] for r in mine)
    prefilled = summary["prefill_tokens"] - before["stats"]["prefill_tokens"]
    assert 0 < prefilled <= summary["run_prompt_tokens"]
    assert summary["prefill_saving"] == round(1 - prefilled / summary["run_prompt_tokens"], 4) >= 0
    line = [x for x in res.output.splitlines() if " jobs done" in x][-1]
    found = re.fullmatch(r"(\d+)/(\d+) jobs done \((\d+) by earlier runs\), (\d+) failed; this run: prefill (\d+) "
                         r"of (\d+) prompt tokens \((\d+)% saved\); (\d+) new tokens in [\d.]+s -> .*", line)
    assert found, line
    assert [int(x) for x in found.groups()] == [
        summary["completed"], summary["jobs"], summary["resumed_jobs"], summary["failed"], prefilled,
        summary["run_prompt_tokens"], round(100 * summary["prefill_saving"]), summary["run_completion_tokens"]]
