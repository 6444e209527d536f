"""Input readers: every format, ids across inputs, bad rows, bad inputs, sample data."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.jobs.readers import input_schema, read_jobs
from batchgen.jobs.schema import GenerationDefaults, InvalidRow, Job, JobError, Location

DEFAULTS = GenerationDefaults(max_new_tokens=16)
DATA = Path(__file__).resolve().parents[2] / "data"


def lines(rows: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> str:
    path.write_bytes(lines(rows))
    return str(path)


def read_all(paths: list[str], **kw: Any) -> list[Job | InvalidRow]:
    return list(read_jobs(paths, kw.pop("defaults", DEFAULTS), **kw))


def jobs_only(items: list[Job | InvalidRow]) -> list[Job]:
    assert all(isinstance(i, Job) for i in items), [str(i) for i in items if isinstance(i, InvalidRow)]
    return items  # type: ignore[return-value]


ROWS = [{"prompt": "one", "topic": "a"}, {"id": "x", "prompt": "two", "topic": "b"},
        {"messages": [{"role": "user", "content": "three"}], "topic": "c", "n": 2}]


def test_plain_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "jobs.jsonl", ROWS)
    jobs = jobs_only(read_all([path]))
    assert [j.id for j in jobs] == [0, "x", 2]
    assert [j.extra for j in jobs] == [{"topic": "a"}, {"topic": "b"}, {"topic": "c"}]
    assert jobs[2].messages == [{"role": "user", "content": "three"}] and jobs[2].n == 2
    assert jobs[0].max_new_tokens == 16
    assert [j.location for j in jobs] == [Location(path, line=i) for i in (1, 2, 3)]


def test_gzip_and_zstd_jsonl(tmp_path: Path) -> None:
    gz = tmp_path / "jobs.jsonl.gz"
    gz.write_bytes(gzip.compress(lines(ROWS)))
    zst = tmp_path / "jobs.jsonl.zst"
    with pa.CompressedOutputStream(str(zst), "zstd") as out:
        out.write(lines(ROWS))
    for path in (gz, zst):
        jobs = jobs_only(read_all([str(path)]))
        assert [j.id for j in jobs] == [0, "x", 2]
        assert jobs[1].location == Location(str(path), line=2)


def test_json_array_file(tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(ROWS[:2] + [5]))
    items = read_all([str(path)])
    assert [i.id for i in items[:2]] == [0, "x"]  # type: ignore[union-attr]
    assert isinstance(items[2], InvalidRow)
    assert str(items[2]) == f"{path}:row 2: expected a JSON object, got a number"


def test_parquet_streams_across_batches_and_keeps_columns(tmp_path: Path) -> None:
    path = tmp_path / "jobs.parquet"
    n = 2500  # more than one 1024-row batch
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(n)],
                             "score": pa.array(range(n), pa.int32()),
                             "tags": [["t", str(i)] for i in range(n)]}), path, row_group_size=700)
    jobs = jobs_only(read_all([str(path)]))
    assert len(jobs) == n
    assert [j.id for j in jobs] == list(range(n))
    assert jobs[2049].prompt == "p2049" and jobs[2049].extra == {"score": 2049, "tags": ["t", "2049"]}
    assert str(jobs[5].location) == f"{path}:row 5"
    schema = input_schema([str(path)])
    assert schema is not None and schema.field("score").type == pa.int32()


def test_directory_of_parts_sorted_and_ids_run_across_inputs(tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    write_jsonl(parts / "part-0001.jsonl", [{"prompt": "b0"}, {"prompt": "b1"}])
    pq.write_table(pa.table({"prompt": ["a0", "a1"]}), parts / "part-0000.parquet")
    write_jsonl(parts / ".hidden.jsonl", [{"prompt": "never"}])
    (parts / "_SUCCESS").write_text("")
    (parts / "README.txt").write_text("not data")
    extra = write_jsonl(tmp_path / "more.jsonl", [{"prompt": "c0"}, {"id": 99, "prompt": "c1"}])
    jobs = jobs_only(read_all([str(parts), extra]))
    assert [j.prompt for j in jobs] == ["a0", "a1", "b0", "b1", "c0", "c1"]
    assert [j.id for j in jobs] == [0, 1, 2, 3, 4, 99]


def test_default_id_counts_invalid_rows_but_not_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n   \n{oops\n{"prompt": "b"}\n')
    items = read_all([str(path)])
    assert [type(i).__name__ for i in items] == ["Job", "InvalidRow", "Job"]
    assert items[2].id == 2 and items[2].location.line == 5  # type: ignore[union-attr]


def test_junk_lines_become_invalid_rows_and_good_jobs_survive(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    good = lines({"id": i, "prompt": f"q{i}"} for i in range(5)).splitlines(keepends=True)
    path.write_bytes(b"".join([
        b"\xef\xbb\xbf" + good[0],             # 1: BOM is tolerated
        b'{"prompt": "unterminated\n',           # 2
        good[1],                                 # 3
        b'{"prompt": "caf\xe9"}\n',              # 4: Latin-1, not UTF-8
        b"[1, 2]\n",                             # 5
        good[2],                                 # 6
        b'{"prompt": "x", "max_new_tokens": -3}\n',  # 7
        b'"just a string"\n',                    # 8
        good[3], good[4],                        # 9, 10
    ]))
    items = read_all([str(path)])
    jobs = [i for i in items if isinstance(i, Job)]
    bad = [i for i in items if isinstance(i, InvalidRow)]
    assert [j.id for j in jobs] == [0, 1, 2, 3, 4]
    assert [b.location.line for b in bad] == [2, 4, 5, 7, 8]
    text = [str(b) for b in bad]
    assert text[0] == f"{path}:2: malformed JSON: Unterminated string starting at column 12"
    assert text[1] == f"{path}:4: line is not valid UTF-8 (byte 0xe9 at offset 15)"
    assert text[2] == f"{path}:5: expected a JSON object per line, got an array"
    assert text[3] == f"{path}:7: field 'max_new_tokens' must be a positive integer, got -3"
    assert text[4] == f"{path}:8: expected a JSON object per line, got a string"


def test_duplicate_ids_are_reported(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "1"}, {"id": "a", "prompt": "2"},
                                              {"id": 2, "prompt": "3"}, {"prompt": "row 3 gets id 3"},
                                              {"id": "2", "prompt": "same text as int 2"}])
    items = read_all([path])
    assert [type(i).__name__ for i in items] == ["Job", "InvalidRow", "Job", "Job", "InvalidRow"]
    assert items[1].to_row() == {"id": "a", "location": f"{path}:2",  # type: ignore[union-attr]
                                 "reason": "duplicate id 'a': an earlier job already uses it; ids must be unique"}


def test_missing_path_and_unknown_suffix_raise(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(JobError, match=f"^{missing}: no such file or directory$"):
        read_jobs([missing], DEFAULTS)  # raised on the call, before iteration
    odd = tmp_path / "jobs.csv"
    odd.write_text("prompt\nx\n")
    with pytest.raises(JobError, match="unknown input format"):
        read_jobs([str(odd)], DEFAULTS)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(JobError, match="no .jsonl/.parquet part files"):
        read_jobs([str(empty)], DEFAULTS)
    with pytest.raises(JobError, match="no inputs"):
        read_jobs([], DEFAULTS)


def test_truncated_parquet_raises(tmp_path: Path) -> None:
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(100)]}), whole)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[:-20])
    with pytest.raises(JobError, match=f"^{cut}: not a readable Parquet file"):
        read_jobs([str(cut)], DEFAULTS)


def test_truncated_gzip_raises_after_good_lines(tmp_path: Path) -> None:
    path = tmp_path / "jobs.jsonl.gz"
    data = gzip.compress(lines({"prompt": f"p{i}"} for i in range(2000)))
    path.write_bytes(data[: len(data) // 2])
    seen = []
    with pytest.raises(JobError, match=f"^{path}: read failed after line"):
        for item in read_jobs([str(path)], DEFAULTS):
            seen.append(item)
    assert seen and all(isinstance(i, Job) for i in seen)


def test_bad_template_raises_up_front(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "j.jsonl", [{"text": "x"}])
    with pytest.raises(JobError, match="positional field"):
        read_jobs([path], DEFAULTS, prompt_template="Say {}")


def test_template_and_system(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "r.jsonl", [{"text": "Nice mug", "label": 1}, {"body": "no text"}])
    items = read_all([path], prompt_template="Rewrite: {text}", system="You rewrite reviews.")
    job, bad = items
    assert isinstance(job, Job) and job.prompt is None
    assert job.messages == [{"role": "system", "content": "You rewrite reviews."},
                            {"role": "user", "content": "Rewrite: Nice mug"}]
    assert job.extra == {"text": "Nice mug", "label": 1}
    assert isinstance(bad, InvalidRow)
    assert str(bad) == (f"{path}:2: prompt template needs column 'text', which this row does "
                        "not have (columns: body)")


def test_save_to_disk_dataset_and_dataset_dict(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "a", "k": 1}, {"prompt": "b", "k": 2}])
    ds.save_to_disk(str(tmp_path / "single"))
    jobs = jobs_only(read_all([str(tmp_path / "single")]))
    assert [(j.prompt, j.extra, j.id) for j in jobs] == [("a", {"k": 1}, 0), ("b", {"k": 2}, 1)]
    assert str(jobs[1].location) == f"{tmp_path / 'single'}:row 1"

    test = datasets.Dataset.from_list([{"prompt": "t"}])
    datasets.DatasetDict({"train": ds, "test": test}).save_to_disk(str(tmp_path / "dd"))
    assert [j.prompt for j in jobs_only(read_all([str(tmp_path / "dd")], split="test"))] == ["t"]
    assert len(read_all([str(tmp_path / "dd")])) == 2
    with pytest.raises(JobError, match="no split 'validation'; available: train, test"):
        read_all([str(tmp_path / "dd")], split="validation")
    schema = input_schema([str(tmp_path / "single")])
    assert schema is not None and schema.names == ["prompt", "k"]


def test_dataset_name_via_load_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    local = tmp_path / "local_ds"
    local.mkdir()
    write_jsonl(local / "train.jsonl", [{"prompt": "from hub-style dir", "src": "x"}])
    jobs = jobs_only(read_all([], dataset=str(local), split="train"))
    assert [(j.prompt, j.extra) for j in jobs] == [("from hub-style dir", {"src": "x"})]
    assert str(jobs[0].location) == f"{local}[train]:row 0"
    with pytest.raises(JobError, match="cannot load dataset"):
        read_all([], dataset=str(tmp_path / "missing_ds"))


def test_openai_batch_input(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}},
        {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "Once", "max_completion_tokens": 6, "n": 2}},
        {"custom_id": "c3", "method": "POST", "url": "/v1/completions", "body": {"prompt": ""}},
    ])
    c1, c2, c3 = read_all([path])
    assert isinstance(c1, Job) and (c1.custom_id, c1.endpoint, c1.max_new_tokens) == \
        ("c1", "/v1/chat/completions", 5)
    assert isinstance(c2, Job) and (c2.prompt, c2.endpoint, c2.n, c2.max_new_tokens) == \
        ("Once", "/v1/completions", 2, 6)
    assert isinstance(c3, InvalidRow) and c3.job_id == "c3"
    assert str(c3) == f"{path}:3: field 'body.prompt' must be a non-empty string, got ''"


# --- the sample files under data/ must stay valid -----------------------------------------

def test_sample_system_prompt() -> None:
    jobs = jobs_only(read_all([str(DATA / "system_prompt.jsonl")]))
    assert 20 <= len(jobs) <= 30
    systems = {j.messages[0]["content"] for j in jobs}  # type: ignore[index]
    assert len(systems) == 1 and len(systems.pop().split()) >= 100
    assert len({j.messages[1]["content"] for j in jobs}) == len(jobs)  # type: ignore[index]
    sampled = [j for j in jobs if j.n == 2]
    assert sampled and all(j.seed is not None for j in sampled)


def test_sample_fewshot() -> None:
    jobs = jobs_only(read_all([str(DATA / "fewshot.jsonl")]))
    assert len(jobs) == 18
    assert {j.extra["subject"] for j in jobs} == {"arithmetic", "capitals", "antonyms"}
    assert all(j.max_new_tokens == 8 and j.stop == ("\n",) for j in jobs)
    headers = {j.prompt.rsplit("Q: ", 1)[0] for j in jobs}  # type: ignore[union-attr]
    assert len(headers) == 3 and all(h.count("Q: ") == 5 for h in headers)


def test_sample_openai_batch() -> None:
    jobs = jobs_only(read_all([str(DATA / "openai_batch.jsonl")]))
    assert [j.endpoint for j in jobs].count("/v1/chat/completions") == 4
    assert [j.endpoint for j in jobs].count("/v1/completions") == 2
    assert all(j.custom_id == j.id for j in jobs)


def test_sample_augment_parquet() -> None:
    path = DATA / "augment.parquet"
    assert pq.read_schema(path).names == ["text", "label"]
    jobs = jobs_only(read_all([str(path)], prompt_template="Paraphrase: {text}"))
    assert len(jobs) == 12 and all(j.prompt.startswith("Paraphrase: ") for j in jobs)  # type: ignore[union-attr]
    assert set(jobs[0].extra) == {"text", "label"}


def test_sample_files_are_small() -> None:
    for name in os.listdir(DATA):
        assert (DATA / name).stat().st_size < 20_000, name


def test_uri_inputs_through_pyarrow_filesystems(tmp_path):
    """s3://, gs:// and hf:// take the same path as file:// URIs (no network here)."""
    import gzip as _gzip
    import json as _json

    import pyarrow as _pa
    import pyarrow.parquet as _pq

    from batchgen.jobs import GenerationDefaults, Job, read_jobs

    parts = tmp_path / "parts"
    parts.mkdir()
    _pq.write_table(_pa.table({"prompt": ["a", "b"], "k": [1, 2]}), parts / "p0.parquet")
    with _gzip.open(parts / "p1.jsonl.gz", "wt") as f:
        f.write(_json.dumps({"prompt": "c", "k": 3}) + "\n" + "{bad\n")
    items = list(read_jobs([f"file://{parts}"], GenerationDefaults()))
    jobs = [i for i in items if isinstance(i, Job)]
    assert [(j.prompt, j.extra["k"]) for j in jobs] == [("a", 1), ("b", 2), ("c", 3)]
    bad = [i for i in items if not isinstance(i, Job)]
    assert len(bad) == 1 and str(bad[0].location) == f"file://{parts}/p1.jsonl.gz:2"
    import pytest as _pytest

    from batchgen.jobs import JobError
    with _pytest.raises(JobError, match="no such file"):
        list(read_jobs([f"file://{tmp_path}/missing.jsonl"], GenerationDefaults()))
