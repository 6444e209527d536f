"""The Python API: `batchgen.generate` and `batchgen.Engine` give the CLI's rows, in input order, in
the caller's type (list, DataFrame, Dataset), with errors returned in place and nothing written
unless asked."""
import json
import os
import subprocess
import sys

import datasets
import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import batchgen
from batchgen.jobs import JobError, JobValidationError
from batchgen.pipeline.cli import main
from tests.helpers.tiny_models import make_model
from tests.helpers.tiny_tokenizer import make_tokenizer

SYSTEM = "You answer briefly and kindly, in plain words, and you never make things up. "
RESULT = ["id", "sample_index", "completion", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens"]


def jobs():
    return [
        {"id": 1, "prompt": SYSTEM + "What is rain?", "topic": "weather", "n": 1, "temperature": 0.0},
        {"id": 2, "prompt": SYSTEM + "Yes or no?", "topic": "quiz", "n": 2, "temperature": 0.8},
        {"id": 3, "prompt": SYSTEM + "A code.", "topic": "codes", "n": 1, "temperature": 0.0},
        {"id": 4, "prompt": "", "topic": "bad", "n": 1, "temperature": 0.0},
        {"id": 5, "prompt": SYSTEM + "What is snow?", "topic": "weather", "n": 1, "temperature": 1.5},
    ]


@pytest.fixture(scope="module")
def engine():
    return batchgen.Engine(make_model("llama"), make_tokenizer(), name="tiny")


def test_a_dataset_comes_back_as_a_dataset_with_the_rows_the_cli_writes(tmp_path, model_dir):
    ds = datasets.Dataset.from_list(jobs())
    ds.to_parquet(str(tmp_path / "jobs.parquet"))
    options = dict(max_new_tokens=6, min_shared_tokens=4, regex="[a-z]{2,5}", repetition_penalty=1.2)
    out = batchgen.generate(ds, model=str(model_dir), **options)
    assert isinstance(out, datasets.Dataset)
    assert out.column_names == ["topic", *RESULT, "error"]

    cli_out = tmp_path / "cli.parquet"
    res = CliRunner().invoke(main, ["process", str(tmp_path / "jobs.parquet"), "-o", str(cli_out), "--model",
                                    str(model_dir), "--max-new-tokens", "6", "--min-shared-tokens", "4",
                                    "--regex", "[a-z]{2,5}", "--repetition-penalty", "1.2"])
    assert res.exit_code == 0, res.output
    cli_rows = pq.read_table(cli_out).to_pylist()
    api_rows = out.to_list()
    assert [{k: v for k, v in r.items() if k != "error"} for r in api_rows if r["error"] is None] == cli_rows
    assert all(len(r["completion"]) >= 2 for r in cli_rows)  # the default constraint held
    # the bad job is in its place, with the reason the CLI's errors file gives
    bad = [r for r in api_rows if r["error"] is not None]
    assert [r["id"] for r in bad] == [4] and bad[0]["completion"] is None
    cli_error = pq.read_table(str(cli_out) + ".errors.parquet").to_pylist()[0]
    assert bad[0]["error"] == f"dataset:row 3: {cli_error['reason']}"
    assert [r["id"] for r in api_rows] == [1, 2, 2, 3, 4, 5]


def test_lists_and_dataframes_come_back_in_their_type_and_order(engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = engine.generate(jobs(), max_new_tokens=4)
    assert isinstance(rows, list) and [r["id"] for r in rows] == [1, 2, 2, 3, 4, 5]
    assert rows[4]["error"] == "jobs:row 3: field 'prompt' must be a non-empty string, got ''"
    frame = engine.generate(pd.DataFrame(jobs()), max_new_tokens=4)
    assert isinstance(frame, pd.DataFrame) and list(frame["id"]) == [1, 2, 2, 3, 4, 5]
    assert list(frame["completion"].iloc[[0, 1, 2, 3, 5]]) == [r["completion"] for r in rows if r["error"] is None]
    assert os.listdir(tmp_path) == []  # nothing written


def test_an_output_path_writes_what_the_cli_writes(engine, tmp_path):
    out = tmp_path / "out.parquet"
    rows = engine.generate(jobs(), output=str(out), max_new_tokens=4)
    assert [r["completion"] for r in pq.read_table(out).to_pylist()] == [r["completion"] for r in rows
                                                                        if r["error"] is None]
    errors = pq.read_table(str(out) + ".errors.parquet").to_pylist()
    assert [e["location"] for e in errors] == ["jobs:row 3"]
    with pytest.raises(JobError, match="pass overwrite=True to replace it"):
        engine.generate(jobs(), output=str(out), max_new_tokens=4)
    openai = tmp_path / "batch.jsonl"
    engine.generate(jobs(), output=str(openai), output_format="openai", max_new_tokens=4)
    line = json.loads(openai.read_text().splitlines()[0])
    assert line["response"]["body"]["model"] == "tiny" and line["custom_id"] == "1"


def test_files_in_and_options_checked_like_job_fields(engine, tmp_path):
    src = tmp_path / "jobs.jsonl"
    src.write_text("".join(json.dumps(j) + "\n" for j in jobs()))
    rows = engine.generate(str(src), max_new_tokens=3, choice=["yes", "no"])
    assert {r["completion"] for r in rows if r["error"] is None} <= {"yes", "no"}
    assert rows[4]["error"].startswith(f"{src}:4: ")
    with pytest.raises(TypeError, match="unexpected keyword argument.*: frobnicate"):
        engine.generate(jobs(), frobnicate=1)
    with pytest.raises(JobValidationError, match="field 'best_of' is a generation parameter batchgen does not"):
        engine.generate(jobs(), best_of=2)
    with pytest.raises(JobValidationError, match="defaults: field 'top_logprobs' is 2 but logprobs is not true"):
        engine.generate(jobs(), top_logprobs=2)
    with pytest.raises(JobError, match="5 job|1 job"):
        engine.generate(jobs(), on_error="fail")


def test_generate_in_a_fresh_process(tmp_path, model_dir):
    """The API and the CLI from a folder of the user's that holds a jobs.py and a pipeline.py (first
    on sys.path, as the current folder is): batchgen's internals install as batchgen.jobs and
    batchgen.pipeline, so the user's modules shadow nothing."""
    for name in ("jobs", "pipeline"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    code = ("import json, batchgen; out = batchgen.generate([{'prompt': 'Hello there', 'lang': 'en'}], "
            f"model={str(model_dir)!r}, max_new_tokens=8, choice=['hi', 'hello']); print(json.dumps(out))")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["lang"] == "en" and row["completion"] in ("hi", "hello") and row["error"] is None
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "Hello there"}) + "\n")
    cli = subprocess.run([sys.executable, "-m", "batchgen", "process", str(src), "-o", str(tmp_path / "out.parquet"),
                          "--model", str(model_dir), "--max-new-tokens", "2"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr


def test_errors_name_the_keyword_arguments_not_the_cli_flags(engine, tmp_path):
    """The same checks as the CLI's, worded for this face: output=, overwrite=True, json_schema=."""
    src = tmp_path / "jobs.jsonl"
    src.write_text("".join(json.dumps(j) + "\n" for j in jobs()))
    before = src.read_bytes()
    with pytest.raises(JobError) as info:  # an output never replaces an input, here either
        engine.generate(str(src), output=str(src), output_format="jsonl", overwrite=True, max_new_tokens=2)
    assert str(info.value).startswith(f"output={str(src)!r}: is the input {src} (the same file)")
    assert src.read_bytes() == before
    (tmp_path / "adir").mkdir()
    problems = {
        "is a directory": dict(output=str(tmp_path / "adir")),
        "the name says Parquet but the output format is jsonl": dict(output=str(tmp_path / "o.parquet"),
                                                                    output_format="jsonl"),
        "json_schema= cannot be used": dict(json_schema={"type": "nonsense-type"}),
        "prompt_template=": dict(prompt_template="{}"),
    }
    for words, options in problems.items():
        with pytest.raises(JobError) as info:
            engine.generate(jobs(), max_new_tokens=2, **options)
        assert words in str(info.value) and "--" not in str(info.value) and "-o " not in str(info.value), \
            str(info.value)
    engine.generate(jobs()[:1], output=str(tmp_path / "o.parquet"), max_new_tokens=2)
    with pytest.raises(JobError, match="pass overwrite=True to replace it"):
        engine.generate(jobs()[:1], output=str(tmp_path / "o.parquet"), max_new_tokens=2)
    openai = [{"custom_id": "r", "body": {"messages": [{"role": "user", "content": "hi"}]}}]
    (row,) = engine.generate(openai, prompt_template="Q: {x}", max_new_tokens=2)
    assert row["error"] == "jobs:row 0: prompt_template= cannot be used with OpenAI batch rows"


def test_a_row_with_a_bad_logit_bias_key_is_an_error_row(engine):
    rows = engine.generate([{"prompt": SYSTEM + "Hi", "logit_bias": {"²": 5}}, {"prompt": SYSTEM + "Ho"}],
                           max_new_tokens=2)
    assert rows[0]["error"].startswith("jobs:row 0: field 'logit_bias.²' must be a token id")
    assert rows[1]["error"] is None and rows[1]["completion_tokens"] == 2
