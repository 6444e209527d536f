"""Bounded memory without changing a result: windows of whole prefix groups, parts put back in
input order by Arrow, and exactly-once at 100k jobs (with a stand-in engine, so CI can afford it;
the real-engine run at 1M is in BENCHMARKS.md)."""
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.jobs import GenerationDefaults
from batchgen.pipeline.cli import main
from batchgen.jobs.columns import ORDER
from batchgen.pipeline.run.ordered import in_order
from batchgen.pipeline.run.runner import RunOptions, process
from batchgen.pipeline.engine.types import Completion, RunStats

# heads that differ from their first letter: six top groups
HEADS = [f"{w}: answer as a careful assistant on this topic and keep it short. "
         for w in ("Apples", "Boats", "Clouds", "Dunes", "Eagles", "Forests")]
JOB_COUNTS = ("jobs", "completed", "failed", "rows", "prompt_tokens", "cached_tokens", "completion_tokens")


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    rng = random.Random(1)
    rows = [{"id": f"j{i}", "prompt": HEADS[rng.randrange(6)] + f"Item {i}?", "n": 1 + (i % 7 == 0)}
            for i in range(40)]
    rows.insert(11, "{broken")
    path = tmp_path_factory.mktemp("grouped") / "jobs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run(src, out, model_dir, *extra):
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(out), "--max-new-tokens", "3",
                                    "--min-shared-tokens", "8", "--max-batch-tokens", "400", *extra,
                                    "--model", str(model_dir)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return (pq.read_table(out).to_pylist(), pq.read_table(str(out) + ".errors.parquet").to_pylist(),
            json.loads(open(str(out) + ".summary.json").read()))


def plan(src, model_dir, *extra):
    res = CliRunner().invoke(main, ["plan", str(src), "--json", "--max-new-tokens", "3", "--min-shared-tokens", "8",
                                    "--max-batch-tokens", "400", *extra, "--model", str(model_dir)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return json.loads(res.stdout)


def test_windows_change_only_how_much_is_held_at_once(tmp_path, model_dir, grouped):
    whole = run(grouped, tmp_path / "whole.parquet", model_dir)
    groups = run(grouped, tmp_path / "groups.parquet", model_dir, "--window-jobs", "12")  # whole groups
    cut = run(grouped, tmp_path / "cut.parquet", model_dir, "--window-jobs", "3")  # groups cut in pieces
    assert groups[0] == whole[0] and groups[1] == whole[1]
    assert {k: groups[2][k] for k in JOB_COUNTS} == {k: whole[2][k] for k in JOB_COUNTS}
    # a job alone in a piece of a cut group computes its prefix itself, but its cached_tokens are
    # those of the tree of all jobs: every row and count is the same
    assert cut[0] == whole[0] and cut[1] == whole[1]
    assert {k: cut[2][k] for k in JOB_COUNTS} == {k: whole[2][k] for k in JOB_COUNTS}
    # whole groups: every prefix still prefilled once; a cut group prefills its prefix per window
    assert groups[2]["prefill_tokens"] == whole[2]["prefill_tokens"]
    assert cut[2]["prefill_tokens"] > whole[2]["prefill_tokens"]
    # plan predicts what process runs, window by window
    for extra, (_, _, summary) in (((), whole), (("--window-jobs", "12"), groups), (("--window-jobs", "3"), cut)):
        report = plan(grouped, model_dir, *extra)
        for key in ("prefill_tokens", "batches", "shared_prefixes", "prompt_tokens", "cached_tokens"):
            assert report[key] == summary[key], (extra, key)
    assert plan(grouped, model_dir, "--window-jobs", "3")["split_groups"] > 0


def test_parts_come_back_in_input_order_through_buckets(tmp_path, monkeypatch):
    import batchgen.pipeline.run.ordered

    monkeypatch.setattr(batchgen.pipeline.run.ordered, "BUCKET_POSITIONS", 7)
    schema = pa.schema([("v", pa.string()), (ORDER, pa.int64()), ("sample_index", pa.int32())])
    rng = random.Random(0)
    rows = [{"v": f"{o}.{s}", ORDER: o, "sample_index": s} for o in range(100) for s in range(1 + o % 3)]
    rng.shuffle(rows)
    files = []
    for k in range(0, len(rows), 23):  # parts of jobs finished in any order, samples of a job together
        part = sorted(rows[k:k + 23], key=lambda r: (r[ORDER], r["sample_index"]))
        files.append(str(tmp_path / f"part-{k}.parquet"))
        pq.write_table(pa.Table.from_pylist(part, schema=schema), files[-1])
    got = [r for t in in_order(files, schema, 100, str(tmp_path)) for r in t.to_pylist()]
    assert got == sorted(rows, key=lambda r: (r[ORDER], r["sample_index"]))
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(f) for f in files)  # buckets removed


class FakeEngine:
    """Stands in for the engine at scale: one token per sample, at once; records its calls."""

    calls: list[int] = []

    def __init__(self, model, **kwargs):
        self.stats, self.attention_path = RunStats(), "cascade"

    @classmethod
    def for_model(cls, model, fallback_eos_ids, **kwargs):
        return cls(model, **kwargs)

    def run(self, requests, should_stop=lambda: False):
        FakeEngine.calls.append(len(requests))
        for r in requests:
            if should_stop():
                return
            self.stats.jobs += 1
            for s in range(r.params.n):
                yield Completion(r.key, s, [65 + len(r.prompt_ids) % 20], "length", len(r.prompt_ids), 0)


class Interrupted(BaseException):
    pass


@pytest.mark.slow
def test_exactly_once_at_100k_jobs_with_a_crash_and_resume(tmp_path, model_dir, monkeypatch):
    import batchgen.pipeline.engine.engine
    import batchgen.pipeline.run.ordered

    monkeypatch.setattr(batchgen.pipeline.engine.engine, "Engine", FakeEngine)
    monkeypatch.setattr(batchgen.pipeline.run.ordered, "BUCKET_POSITIONS", 8192)  # the bucketed path, 13 buckets
    n, rng = 100_000, random.Random(2)
    src = tmp_path / "jobs.jsonl"
    with open(src, "w") as f:
        for i in range(n):
            f.write("{broken\n" if i % 997 == 0 else json.dumps({"prompt": HEADS[rng.randrange(6)] + f"x{i}"}) + "\n")
    out = str(tmp_path / "out.parquet")
    options = RunOptions(model=str(model_dir), defaults=GenerationDefaults(max_new_tokens=1), min_shared_tokens=8,
                         window_jobs=20_000, commit_every=5000)

    def interrupt(p):
        if p.jobs_done >= 45_000:
            raise Interrupted()

    with pytest.raises(Interrupted):
        process([str(src)], out, options, progress=interrupt)
    FakeEngine.calls = []
    summary = process([str(src)], out, options)
    assert 0 < summary["resumed_jobs"] < n
    assert max(FakeEngine.calls) <= 20_000  # a window of Python requests at a time, never all
    table = pq.read_table(out, columns=["id", "sample_index"])
    errors = pq.read_table(out + ".errors.parquet")
    ids = table.column("id").to_pylist()
    bad = [i for i in range(n) if i % 997 == 0]
    assert ids == [i for i in range(n) if i % 997]  # every job once, in input order (ids are row numbers)
    assert [int(x.rsplit(":", 1)[1]) - 1 for x in errors.column("location").to_pylist()] == bad
    assert summary["jobs"] == n and summary["completed"] == n - len(bad) and summary["failed"] == len(bad)
