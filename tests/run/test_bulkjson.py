"""Plain rows through Arrow's JSON reader (jobs/bulkjson.py, jobs/chunks.py's runs) against the
reference reader (`read_jobs`, json.loads line by line): the same items, ids, locations and
messages, on files of mostly plain rows with the lines where Arrow and json.loads part ways (a
key given twice, lone surrogates, bytes that are not UTF-8, NaN and Infinity, integers past
int64, float ids, blank lines, a BOM, CRLF, two objects on a line, an object over two lines,
date-like strings, blank prompts in any of Python's spaces, repeated and colliding ids), with
runs cut at any line; and a truncated gzip stops where the reference stops."""
from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from batchgen.jobs import GenerationDefaults, JobError, bulkjson, chunks
from batchgen.jobs.chunks import plain_template, read_chunks
from batchgen.jobs.readers import read_jobs

DEFAULTS = GenerationDefaults(max_new_tokens=3)
ODD = [
    b'{"prompt": "a", "prompt": "b"}', b'{"id": 1, "prompt": "b", "id": 2}', b'{"prompt": "a", "\\u0070rompt": "b"}',
    b'{"prompt": "lone \\ud800"}', b'{"prompt": "\\udc00 low"}', b'{"prompt": "a\\ud800\\u0041"}',
    b'{"prompt": "pair \\ud83d\\ude00"}', b'{"id": "\\udfff", "prompt": "p"}', b'{"prompt": "raw \xed\xa0\x80"}',
    b'{"prompt": "bad \xff byte"}', b'{"prompt": "ok"}\xff', b'{"prompt": "a", "id": NaN}',
    b'{"prompt": "a", "id": Infinity}', b'{"prompt": "a", "id": -Infinity}', b'{"prompt": NaN}',
    b'{"prompt": "a", "id": 99999999999999999999}', b'{"prompt": "a", "id": 9223372036854775808}',
    b'{"prompt": "a", "id": 9223372036854775807}', b'{"prompt": "a", "id": -9223372036854775808}',
    b'{"prompt": "a", "id": -9223372036854775809}', b'{"prompt": "a", "id": 16.0}', b'{"prompt": "a", "id": 1e2}',
    b'{"prompt": "a", "id": -0}', b'{"prompt": "a", "id": -0.0}', b'{"prompt": "a", "id": 1e400}', b"", b"   ",
    b"\t", b'{"prompt": "crlf"}\r', b'{"prompt": "a"} {"prompt": "b"}', b'{"prompt": "a"}{"prompt": "b"}',
    b'{"prompt": "two', b'lines"}', b'{"prompt": "open",', b'"id": 3}', b'{"prompt": "2024-01-01"}',
    b'{"prompt": "a", "id": "2024-01-01T00:00:00"}', b'{"prompt": 5}', b'{"prompt": true}', b'{"prompt": null}',
    b'{"prompt": ["a"]}', b'{"prompt": {"a": 1}}', b'{"prompt": "a", "id": true}', b'{"prompt": "a", "id": null}',
    b'{"prompt": "a", "id": ""}', b'{"prompt": "a", "id": "x"}', b'{"prompt": "a", "id": "3"}', b'{"prompt": "a", "id": 3}',
    b'{"prompt": ""}', b'{"prompt": " "}', b'{"prompt": "\\u3000\\u2028"}', b'{"prompt": "\\u000b\\u001c"}',
    b'{"prompt": "\\u0085\\u00a0 x"}', b'{"prompt": "\\u200b"}', b'{"prompt": "nul \\u0000"}',
    b'{"prompt": "tab\tin"}', b'{"prompt": "\\/\\b\\f\\n\\r\\t"}', b"{}", b"{not json", b"[1, 2]", b'"text"', b"7",
    b'{"prompt": "a", "meta": [1]}', b'{"prompt": "a", "n": 2}', b'{"prompt": "a"} x', b'{"prompt": "a"},',
    b' {"prompt": "lead"}', b'{"prompt": "a", "id": 01}', b'{"prompt": "\xc3\xa9 \xe2\x82\xac"}',
    b'{"prompt": "a", "m": ' + b"[" * 40 + b"]" * 40 + b"}",
]
PLAIN = st.one_of(st.builds(lambda i, p: json.dumps({"id": i, "prompt": p}).encode(), st.integers(-2, 40),
                            st.sampled_from(["hello there", "é ü", "x\x1c y", "\u3000z"])),
                  st.builds(lambda p: json.dumps({"prompt": p}, ensure_ascii=False).encode("utf-8", "surrogatepass"),
                            st.text(max_size=6)),
                  st.builds(lambda i: json.dumps({"prompt": "p", "id": i}).encode(), st.text("ab1", max_size=2)))
LINES = st.lists(st.one_of(PLAIN, PLAIN, PLAIN, st.sampled_from(ODD)), max_size=24)


def write(path, lines, bom=False, crlf=False):
    raw = (b"\xef\xbb\xbf" if bom else b"") + b"".join(line + (b"\r\n" if crlf else b"\n") for line in lines)
    path.write_bytes(gzip.compress(raw) if path.name.endswith(".gz") else raw)
    return str(path)


def outcome(read):
    try:
        return "read", read()
    except RecursionError:
        return "raised", "RecursionError"


def items_of(paths, size):
    template = plain_template(DEFAULTS)
    pairs = [pair for chunk in read_chunks(paths, DEFAULTS, size=size) for pair in chunk.in_order(template)]
    assert [o for o, _ in pairs] == list(range(len(pairs)))
    return [item for _, item in pairs]


@pytest.fixture
def small_runs(monkeypatch):
    """Arrow's reader on runs of any length, batches of a few lines: every cut is tried."""
    taken = []
    real = bulkjson.plain_columns

    def counted(block, lines):
        found = real(block, lines)
        taken.append(lines if isinstance(found, bulkjson.Columns) else 0)
        return found

    monkeypatch.setattr(chunks, "plain_columns", counted)
    monkeypatch.setattr(chunks, "_BULK_MIN", 1)
    return taken


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(LINES, LINES, st.booleans(), st.booleans(), st.integers(1, 9), st.integers(1, 5))
def test_bulk_rows_are_what_read_jobs_yields(tmp_path, monkeypatch, small_runs, first, second, bom, crlf, batch,
                                            size):
    monkeypatch.setattr(chunks, "_BULK_LINES", batch)
    paths = [write(tmp_path / "a.jsonl", first, bom, crlf), write(tmp_path / "b.jsonl.gz", second)]
    want = outcome(lambda: list(read_jobs(paths, DEFAULTS)))
    got = outcome(lambda: items_of(paths, size))
    assert got == want
    # repr tells apart what == does not: 1, 1.0 and True, an id "3" and 3
    assert repr(got) == repr(want)


def test_plain_rows_take_arrow_in_runs(tmp_path, small_runs):
    lines = [json.dumps({"id": i, "prompt": f"p {i}"}).encode() for i in range(40)]
    lines[7], lines[20], lines[21] = b"{not json", b"", b'{"prompt": "a", "id": 3}'  # a repeated id: alone
    path = write(tmp_path / "a.jsonl", lines)
    assert items_of([path], 8) == list(read_jobs([path], DEFAULTS))
    assert sum(small_runs) == 38  # all but the malformed line and the blank one
    [chunk] = read_chunks([path], DEFAULTS, size=100)
    assert [len(p) for p in chunk.plain] == [37] and [o for o, _ in chunk.items] == [7, 20]


def test_a_read_error_stops_where_the_reference_stops(tmp_path):
    path = tmp_path / "jobs.jsonl.gz"
    data = gzip.compress(b"".join(json.dumps({"prompt": f"p{i}"}).encode() + b"\n" for i in range(20000)))
    path.write_bytes(data[: len(data) // 2])
    messages = []
    for read in (lambda: list(read_jobs([str(path)], DEFAULTS)), lambda: list(read_chunks([str(path)], DEFAULTS))):
        with pytest.raises(JobError) as e:
            read()
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "read failed after line" in messages[0]
