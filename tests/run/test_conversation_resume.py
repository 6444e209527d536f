"""A conversation is committed whole: a run killed between commits, rerun, writes what an
uninterrupted run writes, having redone only the conversations not committed."""
import json
import os
import signal

import pyarrow.parquet as pq
import pytest

from tests.run.test_resume import HEAD, cli, spawn

ARGS = ["--max-new-tokens", "4", "--max-batch-tokens", "600", "--min-shared-tokens", "4", "--commit-every", "3"]


@pytest.fixture(scope="module")
def conversations_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("jobs") / "conversations.jsonl"
    rows = []
    for i in range(18):
        turns = 2 + i % 2
        if i % 3:
            messages = [{"role": "system", "content": HEAD}]
            for t in range(turns):
                messages += [{"role": "user", "content": f"Item {i}, question {t}?"},
                             {"role": "assistant", "content": None}]
            rows.append({"id": f"c{i}", "messages": messages, "n": 1 + (i % 4 == 0)})
        else:
            rows.append({"id": f"c{i}", "prompt": HEAD + f"Story {i}:", "then": [" And then"] * (turns - 1)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_a_killed_run_redoes_only_unfinished_conversations(tmp_path, model_dir, conversations_file):
    ref = tmp_path / "ref.parquet"
    res = cli(["process", str(conversations_file), "-o", str(ref), *ARGS], model_dir)
    assert res.exit_code == 0, res.output
    uninterrupted = pq.read_table(ref).to_pylist()
    assert all(len(r["turns"]) in (2, 3) for r in uninterrupted)

    out = tmp_path / "out.parquet"
    proc = spawn(model_dir, conversations_file, out, {"BATCHGEN_FAULT": "after-commit"}, args=ARGS)
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    committed = sum(len(pq.read_table(p)) for p in (tmp_path / "out.parquet.parts").glob("part-*.parquet"))
    assert committed > 0  # whole conversations: every turn of each committed row is there
    res = cli(["process", str(conversations_file), "-o", str(out), *ARGS], model_dir)
    assert res.exit_code == 0, res.output
    assert pq.read_table(out).to_pylist() == uninterrupted
    assert not os.path.exists(str(out) + ".parts")
    summary = json.loads(open(str(out) + ".summary.json").read())
    assert 0 < summary["resumed_jobs"] < 18
