"""A corpus of bad inputs, each pinned to the exact message a user will see.

Row problems become InvalidRow (``<file>:<line>: <what is wrong>``) and reading
continues; whole-input problems raise JobError naming the path.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from batchgen.jobs.readers import jobs_of_records, read_jobs
from batchgen.jobs.params import RESERVED
from batchgen.jobs.schema import JOB_KEYS, GenerationDefaults, InvalidRow, Job, JobError, Location

DEFAULTS = GenerationDefaults(max_new_tokens=16)
CHAT = [{"role": "user", "content": "hi"}]


# what Parquet stores (a list takes two schema levels, an object one, of the 100 pyarrow reads)
TOO_DEEP = ("is nested too deeply: batchgen takes at most 49 levels of nested lists (98 of objects), "
            "as deep as Parquet stores; flatten it")


def nested(depth: int, kind: str) -> Any:
    """A value `depth` lists or objects deep."""
    value: Any = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def dumps(row: dict[str, Any]) -> bytes:
    return json.dumps(row).encode()


# Every bad line is written as line 3 of jobs.jsonl, after two good rows:
# line 1 has id "first" (the duplicate-id case reuses it), line 2 has no id.
GOOD_PREFIX = [dumps({"id": "first", "prompt": "one"}), dumps({"prompt": "two"})]

BAD_LINES = [
    pytest.param(b'{"prompt": "hi"',
                 "jobs.jsonl:3: malformed JSON: Expecting ',' delimiter at column 16", id="json-unclosed"),
    pytest.param(b'{"prompt": "hi",}',
                 "jobs.jsonl:3: malformed JSON: Expecting property name enclosed in double quotes "
                 "at column 17", id="json-trailing-comma"),
    pytest.param(b'{"prompt": "unterminated',
                 "jobs.jsonl:3: malformed JSON: Unterminated string starting at column 12",
                 id="json-unterminated-string"),
    pytest.param(b"\xff\xfe",
                 "jobs.jsonl:3: line is not valid UTF-8 (byte 0xff at offset 0)", id="not-utf8"),
    pytest.param(b'[{"prompt": "x"}]',
                 "jobs.jsonl:3: expected a JSON object per line, got an array", id="json-array"),
    pytest.param(b"42", "jobs.jsonl:3: expected a JSON object per line, got a number", id="json-number"),
    pytest.param(b'"prompt"', "jobs.jsonl:3: expected a JSON object per line, got a string",
                 id="json-string"),
    pytest.param(b"null", "jobs.jsonl:3: expected a JSON object per line, got null", id="json-null"),
    pytest.param(b'{"id": "a", "text": "x"}',
                 "jobs.jsonl:3: row has neither of 'prompt' and 'messages'; exactly one is required",
                 id="neither-prompt-nor-messages"),
    pytest.param(dumps({"prompt": "x", "messages": CHAT}),
                 "jobs.jsonl:3: row has both of 'prompt' and 'messages'; exactly one is required",
                 id="both-prompt-and-messages"),
    pytest.param(b'{"prompt": 5}',
                 "jobs.jsonl:3: field 'prompt' must be a non-empty string, got 5", id="prompt-not-string"),
    pytest.param(b'{"prompt": ["a", "b"]}',
                 "jobs.jsonl:3: field 'prompt' must be a non-empty string, got ['a', 'b']",
                 id="prompt-list"),
    pytest.param(b'{"prompt": ""}',
                 "jobs.jsonl:3: field 'prompt' must be a non-empty string, got ''", id="prompt-empty"),
    pytest.param(b'{"prompt": " \\n\\t"}',
                 "jobs.jsonl:3: field 'prompt' must be a non-empty string, got ' \\n\\t'",
                 id="prompt-whitespace"),
    pytest.param(b'{"messages": "hi"}',
                 "jobs.jsonl:3: field 'messages' must be a non-empty list of {role, content} objects, "
                 "got 'hi'", id="messages-not-list"),
    pytest.param(b'{"messages": []}',
                 "jobs.jsonl:3: field 'messages' must be a non-empty list of {role, content} objects, "
                 "got []", id="messages-empty"),
    pytest.param(b'{"messages": ["hi"]}',
                 "jobs.jsonl:3: field 'messages[0]' must be an object with 'role' and 'content', got 'hi'",
                 id="message-not-object"),
    pytest.param(dumps({"messages": [*CHAT, {"role": "wizard", "content": "x"}]}),
                 "jobs.jsonl:3: field 'messages[1].role' must be one of assistant, developer, system, "
                 "tool, user, got 'wizard'", id="message-unknown-role"),
    pytest.param(b'{"messages": [{"content": "x"}]}',
                 "jobs.jsonl:3: field 'messages[0].role' must be one of assistant, developer, system, "
                 "tool, user, got None", id="message-missing-role"),
    pytest.param(b'{"messages": [{"role": "user"}]}',
                 "jobs.jsonl:3: field 'messages[0].content' must be a string or a list of text parts, "
                 "got None", id="message-missing-content"),
    pytest.param(b'{"messages": [{"role": "user", "content": 5}]}',
                 "jobs.jsonl:3: field 'messages[0].content' must be a string or a list of text parts, "
                 "got 5", id="message-content-number"),
    pytest.param(b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
                 "jobs.jsonl:3: field 'messages[0].content' must be a string or a list of text parts, "
                 "got [{'type': 'image_url'}]", id="message-content-image-part"),
    pytest.param(b'{"id": 1.5, "prompt": "x"}',
                 "jobs.jsonl:3: field 'id' must be a string or an integer, got 1.5 (float)", id="id-float"),
    pytest.param(b'{"id": [1], "prompt": "x"}',
                 "jobs.jsonl:3: field 'id' must be a string or an integer, got [1] (list)", id="id-list"),
    pytest.param(b'{"id": true, "prompt": "x"}',
                 "jobs.jsonl:3: field 'id' must be a string or an integer, got True (bool)", id="id-bool"),
    pytest.param(b'{"id": "", "prompt": "x"}',
                 "jobs.jsonl:3: field 'id' must not be an empty string; leave it out to use the row number",
                 id="id-empty"),
    pytest.param(b'{"prompt": "x", "max_new_tokens": -3}',
                 "jobs.jsonl:3: field 'max_new_tokens' must be a positive integer, got -3",
                 id="max_new_tokens-negative"),
    pytest.param(b'{"prompt": "x", "max_new_tokens": 0}',
                 "jobs.jsonl:3: field 'max_new_tokens' must be a positive integer, got 0",
                 id="max_new_tokens-zero"),
    pytest.param(b'{"prompt": "x", "max_new_tokens": 1000000000}',
                 "jobs.jsonl:3: field 'max_new_tokens' must be a positive integer (at most 1_000_000), "
                 "got 1000000000", id="max_new_tokens-absurd"),
    pytest.param(b'{"prompt": "x", "max_new_tokens": "3"}',
                 "jobs.jsonl:3: field 'max_new_tokens' must be a positive integer, got the string '3'; "
                 "write it without quotes", id="max_new_tokens-string"),
    pytest.param(b'{"prompt": "x", "max_new_tokens": 2.5}',
                 "jobs.jsonl:3: field 'max_new_tokens' must be a positive integer, got 2.5 (float)",
                 id="max_new_tokens-fraction"),
    pytest.param(b'{"prompt": "x", "n": 0}',
                 "jobs.jsonl:3: field 'n' must be a positive integer, got 0", id="n-zero"),
    pytest.param(b'{"prompt": "x", "n": 1000000}',
                 "jobs.jsonl:3: field 'n' must be a positive integer (at most 10_000), got 1000000",
                 id="n-absurd"),
    pytest.param(b'{"prompt": "x", "temperature": -0.5}',
                 "jobs.jsonl:3: field 'temperature' must be a number >= 0, got -0.5", id="temperature-negative"),
    pytest.param(b'{"prompt": "x", "temperature": "hot"}',
                 "jobs.jsonl:3: field 'temperature' must be a number >= 0, got the string 'hot'",
                 id="temperature-word"),
    pytest.param(b'{"prompt": "x", "top_p": 0}',
                 "jobs.jsonl:3: field 'top_p' must be a number in (0, 1] (1 disables it), got 0", id="top_p-zero"),
    pytest.param(b'{"prompt": "x", "top_p": 1.5}',
                 "jobs.jsonl:3: field 'top_p' must be a number in (0, 1] (1 disables it), got 1.5",
                 id="top_p-above-one"),
    pytest.param(b'{"prompt": "x", "top_k": -1}',
                 "jobs.jsonl:3: field 'top_k' must be an integer >= 0 (0 disables top-k), got -1",
                 id="top_k-negative"),
    pytest.param(b'{"prompt": "x", "seed": "42"}',
                 "jobs.jsonl:3: field 'seed' must be an integer or null, got the string '42'; "
                 "write it without quotes", id="seed-numeric-string"),
    pytest.param(b'{"prompt": "x", "seed": "abc"}',
                 "jobs.jsonl:3: field 'seed' must be an integer or null, got the string 'abc'",
                 id="seed-word"),
    pytest.param(b'{"prompt": "x", "stop": 5}',
                 "jobs.jsonl:3: field 'stop' must be a string or a list of strings, got 5 (int)",
                 id="stop-number"),
    pytest.param(b'{"prompt": "x", "stop": ["a", ""]}',
                 "jobs.jsonl:3: field 'stop' entry 1 must be a non-empty string, got ''", id="stop-empty-entry"),
    pytest.param(b'{"prompt": "x", "stop": ""}',
                 "jobs.jsonl:3: field 'stop' entry 0 must be a non-empty string, got ''", id="stop-empty-string"),
    pytest.param(dumps({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}),
                 "jobs.jsonl:3: field 'stop' has 17 sequences; at most 16 are allowed", id="stop-too-many"),
    pytest.param(b'{"id": "first", "prompt": "again"}',
                 "jobs.jsonl:3: duplicate id 'first': an earlier job already uses it; ids must be unique",
                 id="duplicate-id"),
    pytest.param(b'{"custom_id": "r1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}',
                 "jobs.jsonl:3: field 'url' must be one of /v1/chat/completions, /v1/completions, "
                 "got '/v1/embeddings'", id="openai-bad-url"),
    pytest.param(b'{"custom_id": "r2", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}',
                 "jobs.jsonl:3: field 'method' must be 'POST', got 'GET'", id="openai-bad-method"),
    pytest.param(b'{"custom_id": "r3", "url": "/v1/chat/completions", "body": {"model": "m"}}',
                 "jobs.jsonl:3: field 'body.messages' is required for /v1/chat/completions",
                 id="openai-missing-messages"),
    pytest.param(dumps({"custom_id": "r4", "url": "/v1/chat/completions",
                        "body": {"messages": CHAT, "max_tokens": -5}}),
                 "jobs.jsonl:3: field 'body.max_tokens' must be a positive integer, got -5",
                 id="openai-max_tokens-negative"),
    pytest.param(dumps({"custom_id": "r5", "url": "/v1/chat/completions",
                        "body": {"messages": CHAT, "max_completion_tokens": 0}}),
                 "jobs.jsonl:3: field 'body.max_completion_tokens' must be a positive integer, got 0",
                 id="openai-max_completion_tokens-zero"),
    pytest.param(b'{"custom_id": "r6", "body": "x"}',
                 "jobs.jsonl:3: field 'body' must be an object, got 'x'", id="openai-body-not-object"),
    # nested deeper than Parquet stores: json's parser gives up (RecursionError), or the row is refused
    pytest.param(b'{"prompt": "x", "meta": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                 f"jobs.jsonl:3: a value {TOO_DEEP}", id="nested-5000-deep"),
    pytest.param(dumps({"prompt": "x", "meta": nested(50, "list")}),
                 f"jobs.jsonl:3: field 'meta' {TOO_DEEP}", id="nested-50-lists"),
    pytest.param(dumps({"prompt": "x", "meta": nested(99, "object")}),
                 f"jobs.jsonl:3: field 'meta' {TOO_DEEP}", id="nested-99-objects"),
    pytest.param(dumps({"custom_id": "r7", "body": {"messages": CHAT, "metadata": nested(60, "list")}}),
                 f"jobs.jsonl:3: field 'body' {TOO_DEEP}", id="openai-body-nested"),
    pytest.param(dumps({"prompt": "x", "logit_bias": {"²": 5}}),
                 "jobs.jsonl:3: field 'logit_bias.²' must be a token id (an integer >= 0) in the digits 0-9, "
                 "like \"42\"; got the key '²'", id="logit_bias-superscript-key"),
    pytest.param(dumps({"prompt": "x", "logit_bias": {"4.5": 5}}),
                 "jobs.jsonl:3: field 'logit_bias.4.5' must be a token id (an integer >= 0) in the digits 0-9, "
                 "like \"42\"; got the key '4.5'", id="logit_bias-fraction-key"),
    pytest.param(dumps({"prompt": "x", "logit_bias": {"-5": 5}}),
                 "jobs.jsonl:3: field 'logit_bias.-5' must be a token id (an integer >= 0) in the digits 0-9, "
                 "like \"42\"; got the key '-5'", id="logit_bias-negative-key"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_bad_line_message(line: bytes, message: str, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # so the message shows the path as typed: jobs.jsonl
    Path("jobs.jsonl").write_bytes(b"\n".join([*GOOD_PREFIX, line]) + b"\n")
    items = list(read_jobs(["jobs.jsonl"], DEFAULTS))
    assert len(items) == 3
    first, second, bad = items
    # The rows before stay valid (for the duplicate, the first row keeps the id).
    assert isinstance(first, Job) and first.id == "first"
    assert isinstance(second, Job) and second.id == 1
    assert isinstance(bad, InvalidRow)
    assert str(bad) == message


# --- whole-input problems ------------------------------------------------------------------

def _truncated_parquet(name: str) -> None:
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(200)]}), name)
    data = Path(name).read_bytes()
    Path(name).write_bytes(data[:len(data) // 2])


def _truncated_gzip(name: str) -> None:
    # Two gzip members: the first (3 rows) is whole, the second is cut mid-stream,
    # so the line the damage is reported after does not depend on zlib's output.
    whole = gzip.compress(b"".join(dumps({"prompt": f"p{i}"}) + b"\n" for i in range(3)), mtime=0)
    cut = gzip.compress(dumps({"prompt": "lost " * 40}) + b"\n", mtime=0)
    Path(name).write_bytes(whole + cut[:len(cut) // 2])


WHOLE_INPUT = [
    pytest.param("missing.jsonl", lambda name: None, 0,
                 "missing.jsonl: no such file or directory", id="missing-path"),
    pytest.param("trunc.parquet", _truncated_parquet, 0,
                 "trunc.parquet: not a readable Parquet file (Parquet magic bytes not found in footer. "
                 "Either the file is corrupted or this is not a parquet file.)", id="truncated-parquet"),
    pytest.param("fake.parquet", lambda name: Path(name).write_text('{"prompt": "x"}\n'), 0,
                 "fake.parquet: not a readable Parquet file (Parquet magic bytes not found in footer. "
                 "Either the file is corrupted or this is not a parquet file.)", id="not-parquet"),
    pytest.param("empty.parquet", lambda name: Path(name).write_bytes(b""), 0,
                 "empty.parquet: not a readable Parquet file (Parquet file size is 0 bytes)",
                 id="empty-parquet"),
    pytest.param("jobs.csv", lambda name: Path(name).write_text("prompt\nx\n"), 0,
                 "jobs.csv: unknown input format; expected one of .jsonl, .json, .jsonl.gz, .json.gz, "
                 ".jsonl.zst, .jsonl.zstd, .json.zst, .json.zstd, .parquet, .pq", id="unknown-extension"),
    pytest.param("trunc.jsonl.gz", _truncated_gzip, 3,
                 "trunc.jsonl.gz: read failed after line 3: Compressed file ended before the "
                 "end-of-stream marker was reached", id="truncated-gzip"),
]


@pytest.mark.parametrize("name, make, good_before, message", WHOLE_INPUT)
def test_bad_input_raises_job_error(name: str, make: Callable[[str], Any], good_before: int,
                                    message: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    make(name)
    items: list[Job | InvalidRow] = []
    with pytest.raises(JobError) as info:
        for item in read_jobs([name], DEFAULTS):
            items.append(item)
    assert str(info.value) == message
    # Rows before the damage were still delivered (and valid).
    assert len(items) == good_before and all(isinstance(i, Job) for i in items)


# --- reading continues past every bad line ------------------------------------------------

def test_reading_continues_past_bad_lines(tmp_path: Path) -> None:
    bad = [p.values[0] for p in BAD_LINES]
    good = [dumps({"id": "first", "prompt": "one"})]  # the duplicate-id case refers to it
    good += [dumps({"prompt": f"plain {i}"}) if i % 2 else dumps({"id": f"g{i}", "prompt": f"p{i}"})
             for i in range(1, 10)]
    good.append(dumps({"custom_id": "ok", "url": "/v1/chat/completions", "body": {"messages": CHAT}}))
    # Interleave: good, bad, bad, good, bad, bad, ..., with a blank line now and then.
    lines: list[bytes] = [good[0]]
    rest_good, rest_bad = good[1:], list(bad)
    while rest_good or rest_bad:
        lines += rest_bad[:5]
        rest_bad = rest_bad[5:]
        if rest_good:
            lines.append(rest_good.pop(0))
        if len(lines) % 3 == 0:
            lines.append(b"   ")
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")

    # Expected: the record number (0-based, blank lines excluded) is the default id.
    good_set, bad_set = set(good), set(bad)
    expected_jobs, expected_bad_lines, record = [], [], 0
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if raw in good_set:
            row = json.loads(raw)
            expected_jobs.append((line_no, row.get("id", row.get("custom_id", record))))
        else:
            assert raw in bad_set
            expected_bad_lines.append(line_no)
        record += 1

    items = list(read_jobs([str(path)], DEFAULTS))
    jobs = [i for i in items if isinstance(i, Job)]
    invalid = [i for i in items if isinstance(i, InvalidRow)]
    assert len(items) == len(good) + len(bad)
    assert len(jobs) == len(good)
    assert [(j.location.line, j.id) for j in jobs] == expected_jobs
    assert [r.location.line for r in invalid] == expected_bad_lines
    assert all(r.location.path == str(path) for r in invalid)


# --- property: one item per non-blank line, whatever the line holds ----------------------

_NO_NEWLINE = st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",))
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(_NO_NEWLINE, max_size=10),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(_NO_NEWLINE, max_size=8), inner, max_size=4),
    max_leaves=10)
# Real key names make the junk reach field validation, not just the JSON parser.
_keys = (st.sampled_from(JOB_KEYS + tuple(sorted(RESERVED)) + ("custom_id", "body", "url", "method"))
         | st.text(_NO_NEWLINE, max_size=8))
_junk = st.one_of(
    st.text(_NO_NEWLINE, max_size=40).map(str.encode),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(_keys, _json_values, max_size=5).map(lambda d: json.dumps(d).encode()),
)
_blank = st.sampled_from([b"", b" ", b"\t", b"  \t "])


@st.composite
def _valid_row(draw: st.DrawFn) -> dict[str, Any]:
    text = st.text(_NO_NEWLINE, min_size=1, max_size=20).filter(lambda s: s.strip())
    if draw(st.booleans()):
        row: dict[str, Any] = {"prompt": draw(text)}
    else:
        row = {"messages": [{"role": draw(st.sampled_from(["system", "user", "assistant"])),
                             "content": draw(st.text(max_size=20))}
                            for _ in range(draw(st.integers(1, 3)))]}
    row.update(draw(st.fixed_dictionaries({}, optional={
        "max_new_tokens": st.integers(1, 1000), "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 100), "seed": st.integers(0, 2**32),
        "stop": st.lists(text, max_size=3), "n": st.integers(1, 4), "topic": _json_values})))
    return row


_line = st.one_of(
    st.tuples(st.just("valid"), _valid_row()),
    st.tuples(st.just("junk"), _junk),
    st.tuples(st.just("blank"), _blank),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_line, max_size=25), crlf=st.booleans(), ascii_only=st.booleans())
def test_every_nonblank_line_yields_one_item(lines: list[tuple[str, Any]], crlf: bool,
                                             ascii_only: bool,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    raws: list[bytes] = []
    valid_ids: dict[int, str] = {}  # line number -> id
    for line_no, (kind, value) in enumerate(lines, start=1):
        if kind == "valid":
            value = {"id": f"valid-{line_no}", **value}
            valid_ids[line_no] = value["id"]
            value = json.dumps(value, ensure_ascii=ascii_only).encode()
        raws.append(value)
    path = tmp_path_factory.mktemp("prop") / "jobs.jsonl"
    path.write_bytes(b"".join(r + (b"\r\n" if crlf else b"\n") for r in raws))

    def counts(line_no: int, raw: bytes) -> bool:
        if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # the reader drops a UTF-8 BOM on line 1
        return bool(raw.strip())

    expected_lines = [n for n, raw in enumerate(raws, start=1) if counts(n, raw)]
    items = list(read_jobs([str(path)], DEFAULTS))
    assert [i.location.line for i in items] == expected_lines
    for item in items:
        if isinstance(item, InvalidRow):
            assert str(item).startswith(f"{path}:{item.location.line}: ")
            assert item.location.line not in valid_ids, str(item)
    by_line = {i.location.line: i for i in items}
    for line_no, job_id in valid_ids.items():
        job = by_line[line_no]
        assert isinstance(job, Job) and job.id == job_id
    job_ids = [i.id for i in items if isinstance(i, Job)]
    assert all(job_ids.count(v) == 1 for v in valid_ids.values())


# --- values nested deeper than Parquet stores: a located row, never a crash ----------------------

DEEP_TEXT = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("column", ["logit_bias", "stop_token_ids", "json_schema", "choice", "continuations"])
def test_deep_json_text_in_a_parquet_column_is_a_located_row(column: str, tmp_path: Path) -> None:
    # Parquet cannot hold such a value itself; its JSON text can, and these fields read JSON text
    path = tmp_path / "jobs.parquet"
    pq.write_table(pa.table({"prompt": ["ok", "deep"], column: [None, DEEP_TEXT]}), path)
    ok, deep = read_jobs([str(path)], DEFAULTS)
    assert isinstance(ok, Job) and isinstance(deep, InvalidRow)
    assert str(deep).startswith(f"{path}:row 1: field '{column}' ")
    assert "nested too deeply" in deep.reason or column == "continuations"  # that one is no list of strings


def test_deep_values_of_every_source_are_located_rows(tmp_path: Path) -> None:
    from batchgen.jobs.chunks import read_chunks

    rows = [{"prompt": "a"}, {"prompt": "b", "meta": nested(5000, "list")},
            {"prompt": "c", "meta": nested(49, "list")}, {"prompt": "d", "meta": nested(98, "object")}]
    # the Python API's records: Python values of any depth
    items = list(jobs_of_records(((Location("jobs", row=i), r) for i, r in enumerate(rows)), DEFAULTS))
    assert [type(i).__name__ for i in items] == ["Job", "InvalidRow", "Job", "Job"]
    assert str(items[1]) == f"jobs:row 1: field 'meta' {TOO_DEEP}"
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n" + '{"prompt": "b", "meta": ' + DEEP_TEXT + "}\n")
    chunked = [item for chunk in read_chunks([str(path)], DEFAULTS) for _, item in chunk.in_order(
        Job.from_row({"prompt": "x"}, Location(""), DEFAULTS, 0))]
    assert [str(i) for i in chunked[1:]] == [f"{path}:2: a value {TOO_DEEP}"]


def test_a_deep_json_array_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    path.write_text('[{"prompt": "a"}, {"prompt": "b", "meta": ' + DEEP_TEXT + "}]")
    with pytest.raises(JobError, match=f"^{path}: a value in the array is nested too deeply"):
        list(read_jobs([str(path)], DEFAULTS))
