"""The Ray engine on a local Ray instance equals the local engine, job for job, with no prefix
prefilled twice."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.pipeline.cli import main
from tests.helpers.tiny_models import make_model
from tests.helpers.tiny_tokenizer import make_tokenizer

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

HEADS = ["First shared instructions: answer in one short line, kindly. ",
         "Second header with other rules: use as few words as possible here. ",
         "Third block of few-shot examples: Q: a? A: b. Q: c? A: d. "]


def test_ray_engine_equals_the_local_engine(tmp_path):
    model_dir = tmp_path / "m"
    make_model("qwen2").save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    rows = [{"id": f"{h}-{q}", "prompt": HEADS[h] + f"Question {q}?", "n": 1 + (q == 0)}
            for h in range(3) for q in range(5)] + [{"id": "solo", "prompt": "alone"}, "{bad json"]
    src = tmp_path / "jobs.jsonl"
    src.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    common = ["--model", str(model_dir), "--max-new-tokens", "6", "--min-shared-tokens", "8"]
    local = tmp_path / "local.parquet"
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(local), *common])
    assert res.exit_code == 0, res.output
    out_dir = tmp_path / "ray_out"
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(out_dir), "--engine", "ray", "--workers", "1",
                                    *common])
    assert res.exit_code == 0, res.output + repr(res.exception)
    parts = pa.concat_tables([pq.read_table(p) for p in sorted(out_dir.glob("part-*.parquet"))])
    ray_rows = sorted(parts.to_pylist(), key=lambda r: (r["_batchgen_order"], r["sample_index"]))
    for r in ray_rows:
        del r["_batchgen_order"]
    assert ray_rows == pq.read_table(local).to_pylist()
    assert len({(r["id"], r["sample_index"]) for r in ray_rows}) == len(ray_rows)
    ray_summary = json.loads((out_dir / "summary.json").read_text())
    local_summary = json.loads((tmp_path / "local.parquet.summary.json").read_text())
    assert ray_summary["prefill_tokens"] == local_summary["prefill_tokens"]
    assert ray_summary["completed"] == 16 and ray_summary["failed"] == 1
    assert pq.read_table(out_dir / "errors.parquet").num_rows == 1
    # a rerun finds every job done and computes nothing: the work counters are the first run's
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(out_dir), "--engine", "ray", *common])
    assert res.exit_code == 0, res.output
    again = json.loads((out_dir / "summary.json").read_text())
    assert again["resumed_jobs"] == 16 and again["completed"] == 16
    assert again["prefill_tokens"] == ray_summary["prefill_tokens"]
    # this run's share apart from the earlier run's: none of the jobs, none of the work
    assert (ray_summary["run_jobs"], ray_summary["resumed_work"]["prefill_tokens"]) == (16, 0)
    assert (again["run_jobs"], again["run_prompt_tokens"], again["prefill_saving"]) == (0, 0, 0.0)
    assert again["resumed_work"]["prefill_tokens"] == ray_summary["prefill_tokens"]
    for key in ("jobs", "completed", "failed", "rows", "prompt_tokens", "cached_tokens", "completion_tokens"):
        assert again[key] == local_summary[key] == ray_summary[key], key
    # another input of as many rows into the same directory: its jobs are not "done" by position
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"id": f"x{i}", "prompt": f"Other job {i}?"}) + "\n" for i in range(len(rows))))
    before = sorted(out_dir.glob("part-*.parquet"))
    res = CliRunner().invoke(main, ["process", str(other), "-o", str(out_dir), "--engine", "ray", *common])
    assert res.exit_code == 1 and "other jobs, options or model" in res.output, res.output
    assert sorted(out_dir.glob("part-*.parquet")) == before  # the first run's work is kept
    # the model rewritten in place (new weights, the same path): its work is not mixed in either
    make_model("qwen2", seed=1).save_pretrained(model_dir)
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(out_dir), "--engine", "ray", *common])
    assert res.exit_code == 1 and f"model {model_dir} is not the one it ran" in res.output, res.output
    assert sorted(out_dir.glob("part-*.parquet")) == before


def test_ray_refuses_an_output_format_it_does_not_write(tmp_path, model_dir):
    src = tmp_path / "jobs.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(tmp_path / "out"), "--engine", "ray",
                                    "--output-format", "jsonl", "--model", str(model_dir)])
    assert res.exit_code == 2 and "--output-format': jsonl: is not supported with --engine ray" in res.output, \
        res.output
    assert not (tmp_path / "out").exists()
