"""Result writers: schema order, atomic replace, overwrite guard, OpenAI grouping, errors."""

from __future__ import annotations

import datetime
import gzip
import json
import os
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from batchgen.jobs.schema import InvalidRow, JobError, Location
from batchgen.jobs.writers import (ERROR_SCHEMA, ErrorWriter, ExtraSchema, JsonlWriter, OpenAIBatchWriter,
                          ParquetWriter, errors_path, id_type_for, infer_extra_schema,
                          open_result_writer, result_schema, value_kind, write_summary)

EXTRA = pa.schema([("subject", pa.string()), ("score", pa.int32())])
SCHEMA = result_schema(EXTRA, pa.string())


def result(id_: Any, k: int = 0, text: str = "out", **extra: Any) -> dict[str, Any]:
    return {**extra, "id": id_, "sample_index": k, "completion": f"{text}{k}", "finish_reason": "stop",
            "prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3 + k}


def test_result_schema_column_order_and_types() -> None:
    assert SCHEMA.names == ["subject", "score", "id", "sample_index", "completion", "finish_reason",
                            "prompt_tokens", "cached_tokens", "completion_tokens"]
    types = {f.name: f.type for f in SCHEMA}
    assert types["score"] == pa.int32() and types["id"] == pa.string()
    assert types["sample_index"] == pa.int32() and types["completion"] == pa.string()
    assert types["finish_reason"] == pa.string()
    assert {types[c] for c in ("prompt_tokens", "cached_tokens", "completion_tokens")} == {pa.int64()}
    assert result_schema(None, pa.int64()).names[0] == "id"


def test_result_schema_rejects_clashing_input_columns() -> None:
    with pytest.raises(JobError, match="completion clash"):
        result_schema(pa.schema([("completion", pa.string())]), pa.string())


def test_id_type_and_extra_schema_inference() -> None:
    assert id_type_for([1, 2]) == pa.int64()
    assert id_type_for([1, "a"]) == pa.string()
    extras = [{"a": 1, "meta": {"k": 1}}, {"b": "x", "meta": "plain"}, {"a": None, "c": None}]
    schema = infer_extra_schema(extras)
    assert schema.names == ["a", "meta", "b", "c"]
    assert schema.field("a").type == pa.int64()
    assert schema.field("meta").type == pa.string()  # dict in one row, str in another
    assert schema.field("c").type == pa.string()  # all null
    hinted = infer_extra_schema(extras, hint=pa.schema([("a", pa.int16())]))
    assert hinted.field("a").type == pa.int16()


VALUES = st.sampled_from([1, 2.5, "x", None, [1, 2], [1.5], {"a": 1}, {"b": "t"}, {"a": 2.5}, Decimal("1.5"),
                          Decimal("12.345"), True, b"by", datetime.date(2020, 1, 1), 2**63, -1, [], {}])


def test_mixed_kinds_are_json_text_whatever_their_order(tmp_path: Path) -> None:
    """Arrow alone makes [date, 1] a date column (1 would be written as 1970-01-02) and fails on [1, date]."""
    day = datetime.date(2020, 1, 1)
    for extras in ([{"r": day}, {"r": 1}], [{"r": 1}, {"r": day}]):
        schema = infer_extra_schema(extras)
        assert schema.field("r").type == pa.string()
        target = tmp_path / "out.parquet"
        with ParquetWriter(target, result_schema(schema, pa.int64()), overwrite=True) as w:
            w.write([result(i, **e) for i, e in enumerate(extras)])
        assert sorted(pq.read_table(target).column("r").to_pylist()) == ['"2020-01-01"', "1"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from("pqr"), VALUES, max_size=3), min_size=1, max_size=25),
       st.integers(1, 6))
def test_extra_schema_streamed_in_chunks_is_inferred_from_all_values(extras, chunk) -> None:
    """Run by run, one chunk per distinct chunk type is kept: the result is the whole column's,
    in any order of the rows (Arrow's inference over mixed kinds is not)."""
    streamed = ExtraSchema()
    for i in range(0, len(extras), chunk):
        streamed.update(extras[i:i + chunk])
    columns: dict[str, list[Any]] = {}
    for row, extra in enumerate(extras):
        for name in extra:
            columns.setdefault(name, [None] * row)
        for name, values in columns.items():
            values.append(extra.get(name))
    fields = []
    for name, values in columns.items():
        try:
            if len({value_kind(v) for v in values if v is not None}) > 1:
                raise pa.ArrowInvalid("mixed kinds")
            dtype = pa.array(values).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            dtype = pa.string()
        fields.append(pa.field(name, pa.string() if pa.types.is_null(dtype) else dtype))
    assert streamed.schema() == pa.schema(fields)
    backwards = infer_extra_schema(extras[::-1])  # the same types, but for structs' field order
    assert {f.name: unordered(f.type) for f in backwards} == {f.name: unordered(f.type) for f in fields}


def unordered(dtype: pa.DataType) -> Any:
    if pa.types.is_struct(dtype):
        return frozenset((f.name, unordered(f.type)) for f in dtype)
    if pa.types.is_list(dtype):
        return ("list", unordered(dtype.value_type))
    return dtype


def test_parquet_writer_roundtrip(tmp_path: Path) -> None:
    target = tmp_path / "out" / "results.parquet"  # parent directory is created
    with ParquetWriter(target, SCHEMA) as w:
        w.write([result(1, subject="math", score=7), result("b", subject=None, score=None)])
        w.write([])
    table = pq.read_table(target)
    assert table.schema.names == SCHEMA.names
    assert table.schema.field("score").type == pa.int32()
    rows = table.to_pylist()
    assert rows[0]["id"] == "1" and rows[1]["id"] == "b"  # int ids become text in a string column
    assert rows[0]["completion"] == "out0" and rows[0]["cached_tokens"] == 4
    assert os.listdir(target.parent) == ["results.parquet"]


def test_parquet_writer_many_small_writes_and_empty_file(tmp_path: Path) -> None:
    schema = result_schema(None, pa.int64())
    with ParquetWriter(tmp_path / "many.parquet", schema) as w:
        for i in range(9000):
            w.write([result(i)])
    assert pq.read_table(tmp_path / "many.parquet").column("id").to_pylist() == list(range(9000))
    with ParquetWriter(tmp_path / "empty.parquet", schema):
        pass
    empty = pq.read_table(tmp_path / "empty.parquet")
    assert empty.num_rows == 0 and empty.schema.names == schema.names


def test_exception_inside_with_leaves_no_file(tmp_path: Path) -> None:
    target = tmp_path / "results.parquet"
    with pytest.raises(RuntimeError, match="engine died"):
        with ParquetWriter(target, SCHEMA) as w:
            w.write([result("a")])
            assert os.path.basename(w.tmp_path).startswith(".results.parquet.tmp-")
            assert os.path.exists(w.tmp_path)
            assert not target.exists()  # nothing visible until a clean exit
            raise RuntimeError("engine died")
    assert os.listdir(tmp_path) == []


def test_exception_keeps_previous_file_when_overwriting(tmp_path: Path) -> None:
    target = tmp_path / "results.jsonl"
    target.write_text("previous run\n")
    with pytest.raises(KeyboardInterrupt):
        with JsonlWriter(target, SCHEMA, overwrite=True) as w:
            w.write([result("a")])
            raise KeyboardInterrupt
    assert target.read_text() == "previous run\n"
    assert os.listdir(tmp_path) == ["results.jsonl"]


def test_existing_target_requires_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "results.parquet"
    target.write_bytes(b"old")
    with pytest.raises(JobError, match=r"results.parquet: already exists; pass --overwrite"):
        ParquetWriter(target, SCHEMA)
    with ParquetWriter(target, SCHEMA, overwrite=True) as w:
        w.write([result("a")])
    assert pq.read_table(target).num_rows == 1
    with pytest.raises(JobError, match="is a directory"):
        ParquetWriter(tmp_path, SCHEMA)


def test_missing_result_value_is_an_error(tmp_path: Path) -> None:
    bad = result("a")
    del bad["cached_tokens"]
    with pytest.raises(ValueError, match="cached_tokens"):
        with ParquetWriter(tmp_path / "r.parquet", SCHEMA) as w:
            w.write([bad])
    assert not (tmp_path / "r.parquet").exists()


def test_jsonl_writer_key_order_nested_values_and_gzip(tmp_path: Path) -> None:
    schema = result_schema(pa.schema([("meta", pa.string()), ("subject", pa.string())]), pa.string())
    for name in ("r.jsonl", "r.jsonl.gz"):
        with JsonlWriter(tmp_path / name, schema) as w:
            w.write([result(5, meta={"a": [1, 2]}, subject="x", ignored="not in schema")])
        raw = (tmp_path / name).read_bytes()
        text = (gzip.decompress(raw) if name.endswith(".gz") else raw).decode()
        row = json.loads(text)
        assert list(row) == schema.names
        assert row["id"] == "5" and row["meta"] == {"a": [1, 2]} and "ignored" not in row


def test_openai_writer_groups_samples_of_a_job(tmp_path: Path) -> None:
    target = tmp_path / "batch_out.jsonl"
    with OpenAIBatchWriter(target, SCHEMA, model="tiny-model", fingerprint="batchgen-x:tiny-model:float32") as w:
        # Samples arrive interleaved and out of order across write() calls.
        w.write([result("job-a", 1, endpoint="/v1/chat/completions"), result("job-b", 0,
                 endpoint="/v1/completions", request_model="gpt-echo", model="a carried column")])
        w.write([result("job-a", 0, endpoint="/v1/chat/completions"), result(7, 0)])
    lines = [json.loads(x) for x in target.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["job-a", "job-b", "7"]
    ids = [x["id"] for x in lines]
    assert all(i.startswith("batch_req_") for i in ids) and len(set(ids)) == 3
    a = lines[0]
    assert a["error"] is None and a["response"]["status_code"] == 200
    body = a["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny-model"
    assert body["system_fingerprint"] == "batchgen-x:tiny-model:float32"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][1]["message"] == {"role": "assistant", "content": "out1", "refusal": None,
                                             "annotations": []}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3 + 4, "total_tokens": 17,
                             "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                                           "accepted_prediction_tokens": 0,
                                                           "rejected_prediction_tokens": 0}}
    b = lines[1]["response"]["body"]
    assert b["object"] == "text_completion" and b["choices"][0]["text"] == "out0"
    assert "message" not in b["choices"][0] and b["model"] == "gpt-echo"  # the request's model, echoed
    assert "completion_tokens_details" not in b["usage"]
    # No endpoint on the row: the constructor's default (chat) applies.
    assert lines[2]["response"]["body"]["object"] == "chat.completion"


def test_open_result_writer_dispatch(tmp_path: Path) -> None:
    assert isinstance(open_result_writer(tmp_path / "a", SCHEMA, "parquet"), ParquetWriter)
    assert isinstance(open_result_writer(tmp_path / "a", SCHEMA, "jsonl"), JsonlWriter)
    assert isinstance(open_result_writer(tmp_path / "a", SCHEMA, "openai", model="m"), OpenAIBatchWriter)
    with pytest.raises(JobError, match="needs a model name"):
        open_result_writer(tmp_path / "a", SCHEMA, "openai")
    with pytest.raises(JobError, match="unknown output format 'csv'"):
        open_result_writer(tmp_path / "a", SCHEMA, "csv")


def test_error_writer(tmp_path: Path) -> None:
    path = errors_path(tmp_path / "results.parquet")
    assert path == str(tmp_path / "results.parquet.errors.parquet")
    assert errors_path("out.jsonl.gz") == "out.jsonl.gz.errors.parquet"
    with ErrorWriter(path) as w:
        w.write([])
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
    with ErrorWriter(path) as w:
        w.write([InvalidRow(Location("j.jsonl", line=3), None, "malformed JSON"),
                 InvalidRow(Location("j.parquet", row=0), 12, "field 'n' must be a positive integer, got 0")])
    table = pq.read_table(path)
    assert table.schema == ERROR_SCHEMA
    assert table.to_pylist() == [
        {"id": None, "location": "j.jsonl:3", "reason": "malformed JSON"},
        {"id": "12", "location": "j.parquet:row 0", "reason": "field 'n' must be a positive integer, got 0"}]
    with pytest.raises(JobError, match="--overwrite"):
        ErrorWriter(path)
    # No new errors: the errors file of the earlier run goes (it would list jobs now in the output).
    with ErrorWriter(path, overwrite=True):
        pass
    assert not os.path.exists(path) and os.listdir(tmp_path) == []


def test_write_summary_atomic(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    write_summary(path, {"jobs": 3, "invalid": 1, "ratio": 0.5})
    write_summary(path, {"jobs": 4})
    assert json.loads(path.read_text()) == {"jobs": 4}
    assert os.listdir(tmp_path) == ["summary.json"]


def test_openai_error_lines_and_whole_requests(tmp_path: Path) -> None:
    from batchgen.jobs.openai_batch import GENERATION_FAILED, OpenAIErrorWriter, whole_requests

    # request c (elements at input positions 0-2), d (3), a malformed line (4), and a repeat of d (5)
    rows = [{**result("c", 0), "custom_id": "c", "prompt_index": 0, "request": 0},
            {**result("c", 0), "custom_id": "c", "prompt_index": 1, "request": 0},
            {**result("d", 0), "custom_id": "d", "prompt_index": None, "request": 3}]
    errors = [{"id": "c", "custom_id": "c", "location": "b.jsonl:1", "reason": GENERATION_FAILED + "out of memory",
               "request": 0},
              {"id": "c", "custom_id": "c", "location": "b.jsonl:1", "reason": GENERATION_FAILED + "dead end",
               "request": 0},
              {"id": None, "location": "b.jsonl:4", "reason": "malformed JSON: x", "request": 4},
              {"id": "d", "location": "b.jsonl:5", "reason": "duplicate custom_id 'd'", "request": 5}]
    # a request fails whole; the repeat of d is another request, which does not fail d
    assert [r["custom_id"] for r in whole_requests(rows, {e["request"] for e in errors})] == ["d"]
    path = tmp_path / "out.jsonl.errors.jsonl"
    with OpenAIErrorWriter(path) as w:
        w.write(errors)
        w.write([InvalidRow(Location("b.jsonl", line=5), "e", "field 'body.tools' is ...")])
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["custom_id"], x["error"]["code"]) for x in lines] == [
        ("c", "generation_failed"), (None, "invalid_request"), ("d", "invalid_request"), ("e", "invalid_request")]
    assert lines[0]["error"]["message"] == "b.jsonl:1: generation failed: out of memory"
    assert all(x["response"] is None and x["id"].startswith("batch_req_") for x in lines)
    with OpenAIErrorWriter(path, overwrite=True):
        pass
    assert not path.exists()  # no errors this run: the earlier run's error file goes
