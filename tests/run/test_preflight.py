"""What `process` would refuse, `validate` reports first, with its location (one code path), and
one bad row never stops the run: awkward columns, lone surrogates, huge ids, reserved column
names, bad output paths."""
import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from batchgen.pipeline.cli import main

HEAD = "A shared header for every job in this file, long enough to share. "


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def cli(args, model_dir):
    return CliRunner().invoke(main, [*args, "--model", str(model_dir)])


def process(src, out, model_dir, *extra):
    return cli(["process", str(src), "-o", str(out), "--max-new-tokens", "2", "--min-shared-tokens", "4", *extra],
               model_dir)


def errors_of(out):
    path = str(out) + ".errors.parquet"
    return pq.read_table(path).to_pylist() if os.path.exists(path) else []


def validate_lines(src, model_dir, *extra):
    res = cli(["validate", str(src), "--max-new-tokens", "2", *extra], model_dir)
    return res, [line for line in res.stdout.splitlines() if line]


# --- 1: a carried column of mixed types ---------------------------------------------------

@pytest.mark.parametrize("fmt, name", [("parquet", "out.parquet"), ("jsonl", "out.jsonl")])
def test_a_column_of_mixed_types_is_written_as_json_text(tmp_path, model_dir, fmt, name):
    src = write_lines(tmp_path / "jobs.jsonl", [
        {"prompt": HEAD + "one", "meta": 1, "nested": {"a": 1}},
        {"prompt": HEAD + "two", "meta": "x", "nested": {"a": "text"}},
        {"prompt": HEAD + "three", "meta": [1, 2], "nested": {"b": [1]}},
    ])
    out = tmp_path / name
    res = process(src, out, model_dir, "--output-format", fmt)
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows = pq.read_table(out).to_pylist() if fmt == "parquet" else [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["meta"] for r in rows] == ["1", "x", "[1, 2]"]
    assert [json.loads(r["nested"]) for r in rows] == [{"a": 1}, {"a": "text"}, {"b": [1]}]
    assert errors_of(out) == []
    assert validate_lines(src, model_dir)[0].exit_code == 0


def test_a_value_the_input_schema_cannot_hold_is_refused_with_its_row(tmp_path, model_dir):
    typed = tmp_path / "a.parquet"
    pq.write_table(pa.table({"prompt": [HEAD + "a"], "stars": pa.array([5], pa.int32())}), typed)
    loose = write_lines(tmp_path / "b.jsonl", [{"prompt": HEAD + "b", "stars": "five"}, {"prompt": HEAD + "c", "stars": 4}])
    out = tmp_path / "out.parquet"
    res = cli(["process", str(typed), str(loose), "-o", str(out), "--max-new-tokens", "2"], model_dir)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert pq.read_table(out).column("stars").to_pylist() == [5, 4]
    [error] = errors_of(out)
    assert error["location"] == f"{loose}:1" and "field 'stars'" in error["reason"] and "int32" in error["reason"]
    res = cli(["validate", str(typed), str(loose)], model_dir)
    assert res.exit_code == 1 and f"{loose}:1: field 'stars'" in res.stdout


# --- 2 and 3: lone surrogates, ids above int64 ------------------------------------------------

SURROGATE_ROWS = [
    ('{"prompt": "lone \\ud800 x"}', "prompt"),
    ('{"messages": [{"role": "user", "content": "lone \\udfff"}]}', "messages[0].content"),
    ('{"id": "bad\\ud800id", "prompt": "fine"}', "id"),
    ('{"prompt": "fine", "note": {"deep": ["ok", "lone \\ud800"]}}', "note.deep[1]"),
    ('{"custom_id": "c1", "body": {"messages": [{"role": "user", "content": "x\\ud83d"}]}}', "body.messages[0].content"),
]


def test_lone_surrogates_go_to_the_errors_file_with_their_field(tmp_path, model_dir):
    src = write_lines(tmp_path / "jobs.jsonl", [{"id": "good", "prompt": HEAD + "fine"}] + [r for r, _ in SURROGATE_ROWS])
    out = tmp_path / "out.parquet"
    res = process(src, out, model_dir)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert pq.read_table(out).column("id").to_pylist() == ["good"]
    errors = errors_of(out)
    assert [e["location"] for e in errors] == [f"{src}:{i}" for i in range(2, 2 + len(SURROGATE_ROWS))]
    for error, (_, field) in zip(errors, SURROGATE_ROWS):
        assert error["reason"].startswith(f"field '{field}' is not valid Unicode text"), error
    res, lines = validate_lines(src, model_dir)
    assert res.exit_code == 1 and lines == [f"{e['location']}: {e['reason']}" for e in errors]
    # plan tokenizes too: it counts them as invalid instead of crashing
    res = cli(["plan", str(src), "--json"], model_dir)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert json.loads(res.stdout)["invalid"] == len(SURROGATE_ROWS)


def test_an_integer_id_above_int64_is_refused_with_its_location(tmp_path, model_dir):
    big = 1180591620717411303424
    src = write_lines(tmp_path / "jobs.jsonl", [f'{{"id": {big}, "prompt": "{HEAD}"}}', {"id": 7, "prompt": HEAD + "x"},
                                                 {"id": -(2**63), "prompt": HEAD + "y"}])
    out = tmp_path / "out.parquet"
    res = process(src, out, model_dir)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert pq.read_table(out).column("id").to_pylist() == [7, -(2**63)]
    assert pq.read_schema(out).field("id").type == pa.int64()
    [error] = errors_of(out)
    assert error["location"] == f"{src}:1" and error["id"] == str(big)
    assert f'write it as a string ("{big}")' in error["reason"]
    assert validate_lines(src, model_dir)[1] == [f"{src}:1: {error['reason']}"]


# --- 15: columns batchgen writes itself ----------------------------------------------------

@pytest.mark.parametrize("column", ["completion", "_batchgen_order", "finish_reason"])
def test_a_reserved_column_name_is_refused_per_row_by_validate_and_process(tmp_path, model_dir, column):
    src = write_lines(tmp_path / "jobs.jsonl", [{"prompt": HEAD + "a"}, {"prompt": HEAD + "b", column: "x"}])
    res, lines = validate_lines(src, model_dir)
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith(f"{src}:2: field '{column}'")
    out = tmp_path / "out.parquet"
    res = process(src, out, model_dir)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert pq.read_table(out).num_rows == 1
    assert [f"{e['location']}: {e['reason']}" for e in errors_of(out)] == lines


# --- 8: validate on a damaged input ---------------------------------------------------------

def test_validate_on_a_truncated_gzip_is_one_line_not_a_traceback(tmp_path, model_dir):
    data = gzip.compress(b"".join(json.dumps({"prompt": f"p{i} " * 50}).encode() + b"\n" for i in range(50)))
    src = tmp_path / "jobs.jsonl.gz"
    src.write_bytes(data[: len(data) // 2])
    res = cli(["validate", str(src)], model_dir)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert "read failed after line" in res.output and "Traceback" not in res.output


def test_validate_reports_what_tokenizing_refuses(tmp_path, model_dir):
    src = write_lines(tmp_path / "jobs.jsonl", [{"prompt": "word " * 600}, {"prompt": HEAD}])
    res, lines = validate_lines(src, model_dir)
    assert res.exit_code == 1 and len(lines) == 1 and "exceeds the model's context window of 512" in lines[0]


# --- 7: the output path, before any model work ---------------------------------------------

@pytest.fixture
def no_model(monkeypatch):
    import batchgen.pipeline.model.load

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(batchgen.pipeline.model.load, "load_model", refuse)


@pytest.mark.parametrize("output, extra, message", [
    ("adir", ["--overwrite"], "is a directory"),
    ("", [], "give an output file name"),
    ("sub/", [], "give an output file name"),
    ("x.parquet", ["--output-format", "jsonl"], "the name says Parquet but the output format is jsonl"),
    ("x.jsonl", [], "the name says JSON Lines but the output format is parquet"),
    ("x.jsonl.zst", ["--output-format", "jsonl"], "only as .gz"),
])
def test_a_bad_output_path_fails_before_loading_the_model(tmp_path, model_dir, monkeypatch, no_model,
                                                          output, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    src = write_lines(tmp_path / "jobs.jsonl", [{"prompt": HEAD}])
    before = sorted(os.listdir(tmp_path))
    res = cli(["process", str(src), "-o", output, *extra], model_dir)
    assert res.exit_code == 1 and message in res.output, res.output + repr(res.exception)
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "adir") == []


# --- the property: validate lists exactly what process puts in the errors file ---------------

BAD_ROWS = [
    '{"prompt": "lone \\ud800 x"}',
    '{"messages": [{"role": "user", "content": "\\udc00"}]}',
    '{"id": "a\\ud800", "prompt": "x"}',
    '{"prompt": "x", "tag": "\\ud800"}',
    '{"id": 1180591620717411303424, "prompt": "x"}',
    '{"prompt": "x", "completion": "y"}',
    '{"prompt": "x", "_batchgen_order": 3}',
    '{"prompt": "x", "max_new_tokens": -1}',
    '{"prompt": ""}',
    "{broken",
    json.dumps({"prompt": "word " * 600}),
    # generation parameters: unsupported, a constraint that does not compile, a token id outside
    # the vocabulary, two constraints, an unknown response_format
    '{"prompt": "x", "logprobs": true}',
    '{"prompt": "x", "regex": "(["}',
    '{"prompt": "x", "logit_bias": {"100000": 5}}',
    '{"prompt": "x", "regex": "a", "choice": ["a"]}',
    '{"prompt": "x", "response_format": {"type": "yaml"}}',
]


@st.composite
def _good_row(draw):
    i = draw(st.integers(0, 5))
    row = {"prompt": HEAD + f"job {i}"}
    meta = draw(st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3, alphabet="abc"),
                          st.lists(st.integers(0, 3), max_size=2), st.fixed_dictionaries({"k": st.integers(0, 2)})))
    if meta is not None:
        row["meta"] = meta  # mixed types across rows: written as JSON text, never a failure
    if draw(st.booleans()):
        row.update(draw(st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[a-c]+"}, {"repetition_penalty": 1.2},
                                         {"logit_bias": {"5": 2}}])))
    return json.dumps(row)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.one_of(_good_row(), st.sampled_from(BAD_ROWS)), min_size=1, max_size=10))
def test_validate_lists_exactly_the_rows_process_rejects(tmp_path_factory, model_dir, lines):
    d = tmp_path_factory.mktemp("prop")
    src, out = write_lines(d / "jobs.jsonl", lines), d / "out.parquet"
    res, listed = validate_lines(src, model_dir, "--max-new-tokens", "1")
    assert res.exit_code == (1 if listed else 0), res.output
    res = cli(["process", str(src), "-o", str(out), "--max-new-tokens", "1", "--min-shared-tokens", "4"], model_dir)
    assert res.exit_code == 0, res.output + repr(res.exception)
    errors = errors_of(out)
    assert [f"{e['location']}: {e['reason']}" for e in errors] == listed
    done = pq.read_table(out).column("id").to_pylist()
    error_lines = [int(e["location"].rsplit(":", 1)[1]) for e in errors]
    # every input row exactly once, in the output (ids default to the row number) or the errors file
    assert sorted([i + 1 for i in done] + error_lines) == list(range(1, len(lines) + 1))
    summary = json.loads(open(str(out) + ".summary.json").read())
    assert summary["jobs"] == len(lines) and summary["failed"] == len(errors) and summary["completed"] == len(done)
