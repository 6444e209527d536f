"""The chunked reader's fast path for plain rows (jobs/chunks.py) against the reference reader
(`read_jobs`): the same items, in the same order, with the same ids, locations, carried values
and messages, on random lines (plain rows, rows carrying columns of mixed types, any other
field, malformed JSON, blank lines, unicode and lone surrogates in values and names, odd ids,
repeated ids, deep nesting, huge numbers), in plain, gzip and JSON-array files; and preflight's
plain rows in columns against the same rows as Jobs."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from batchgen.jobs import GenerationDefaults, InvalidRow, Job
from batchgen.jobs.chunks import plain_template, read_chunks
from batchgen.jobs.readers import read_jobs

DEFAULTS = GenerationDefaults(max_new_tokens=3)
PROMPTS = st.one_of(st.sampled_from(["hello there", "", "   ", "\u3000", "x\x1c", "lone \ud800", "é ü", "\ud83d\ude00 ok"]),
                    st.text(max_size=8))
IDS = st.one_of(st.integers(-3, 3), st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 1.0, 1.5, True, None, "",
                                                     "a", "1", "\udc00", [1]]), st.text(max_size=3))
PLAIN = st.one_of(st.builds(lambda p: {"prompt": p}, PROMPTS),
                  st.builds(lambda i, p: {"id": i, "prompt": p}, IDS, PROMPTS),
                  st.builds(lambda i, p: {"prompt": p, "id": i}, IDS, PROMPTS))
OTHER = st.one_of(
    st.builds(lambda i, p, k, v: {"id": i, "prompt": p, k: v}, IDS, PROMPTS,
              st.sampled_from(["n", "meta", "max_tokens", "stream", "completion", "continuations", "messages"]),
              st.one_of(st.integers(0, 3), st.text(max_size=3), st.just(["a", "b"]), st.none())),
    st.just({"messages": [{"role": "user", "content": "hi"}]}),
    st.just({"custom_id": "c1", "body": {"prompt": "p"}}),
    st.just({"id": 1}), st.just({"text": "no prompt"}))

def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


# values a carried column may hold (and some it may not: a lone surrogate, nesting past the fast
# path's bound, and past json's recursion limit, which both readers hit alike)
VALUES = st.one_of(
    st.integers(-3, 3), st.text(max_size=4), st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from([2**63, -(2**70), 1.5, 1.0, -0.0, 1e308, True, False, None, "", "é ü", [], {}, [1, "a", None],
                     {"k": [1, {"j": "v"}]}, {"": 0}]),
    st.sampled_from(["lone \ud800", {"\udc00": 1}, [["\udfff"]], {"a": [{"b": "\ud800"}]}, json.loads(nested(32)),
                     json.loads(nested(31))]))
COLUMNS = st.one_of(st.sampled_from(["meta", "tag", "", "é", "ID", "custom_id"]),
                    st.sampled_from(["\ud800", "n", "max_tokens", "stream", "completion", "scores", "body", "messages",
                                     "continuations", "json_schema", "seed"]))
# mostly rows the fast path takes but for their columns: a good prompt, an id of their own or none
CARRIED = st.builds(lambda head, cols: {**head, **cols},
                    st.one_of(PLAIN, st.builds(lambda p: {"prompt": p}, st.sampled_from(["ok", "fine é"])),
                              st.builds(lambda i: {"id": i, "prompt": "ok"}, st.uuids().map(str))),
                    st.dictionaries(COLUMNS, VALUES, min_size=1, max_size=3))
RAW_CARRIED = st.sampled_from([
    '{"prompt": "p", "meta": NaN}', '{"prompt": "p", "meta": Infinity, "id": 3}', '{"prompt": "p", "big": 1e400}',
    '{"prompt": "p", "int": 123456789012345678901234567890}', '{"meta": 1, "prompt": "p", "meta": 2}',
    '{"prompt": "p", "m": %s}' % nested(30), '{"prompt": "p", "m": %s}' % nested(31), '{"prompt": "p", "m": %s}' % nested(33),
    '{"prompt": "p", "m": %s}' % nested(900), '{"prompt": "p", "m": %s}' % nested(5000),
    '{"prompt": "p", "m": {"a": %s}}' % nested(31), '{"id": "x", "prompt": "p", "m": "\ud83d\ude00"}'])
LINES = st.one_of(
    PLAIN.map(lambda r: json.dumps(r)), PLAIN.map(lambda r: json.dumps(r, ensure_ascii=False)),
    CARRIED.map(json.dumps), CARRIED.map(lambda r: json.dumps(r, ensure_ascii=False)), RAW_CARRIED,
    OTHER.map(json.dumps),
    st.sampled_from(["{not json", "[1, 2]", '"text"', "", "   ", '{"prompt": "a"} {"prompt": "b"}', '{"prompt": "a"}  ',
                     '{"prompt": "tab"}\t', ' {"prompt": "lead"}', '{"prompt": "x", "prompt": "y"}', '{"prompt": NaN}',
                     '{"prompt": "\\ud800"}', '{"id": 1e400, "prompt": "big"}', '\ufeff{"prompt": "bom"}',
                     '{"prompt": "a"}\r', '{"prompt": "ctrl\x01"}']))


def items_of(paths, size=3, **kw):
    """read_chunks' items as read_jobs gives them, and the orders they came with."""
    template = plain_template(kw.get("defaults", DEFAULTS))
    kw.pop("defaults", None)
    chunks = list(read_chunks(paths, DEFAULTS, size=size, **kw))
    pairs = [pair for chunk in chunks for pair in chunk.in_order(template)]
    assert all(len(c) == size for c in chunks[:-1]) and len(chunks[-1]) <= size
    assert chunks[-1].end == len(pairs)
    return [o for o, _ in pairs], [item for _, item in pairs]


def write(path, lines, bom=False):
    data = ("\ufeff" if bom else "") + "".join(line + "\n" for line in lines)
    raw = data.encode("utf-8", "surrogatepass")
    path.write_bytes(gzip.compress(raw) if path.name.endswith(".gz") else raw)
    return str(path)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(LINES, max_size=14), st.lists(LINES, max_size=6), st.booleans(), st.integers(1, 5))
def test_chunks_hold_what_read_jobs_yields(tmp_path, first, second, bom, size):
    paths = [write(tmp_path / "a.jsonl", first, bom), write(tmp_path / "b.jsonl.gz", second)]
    want = outcome(lambda: list(read_jobs(paths, DEFAULTS)))
    got = outcome(lambda: items_of(paths, size))
    if want[0] == "raised":  # json's recursion limit: the same in both until the readers word it
        assert got == want
        return
    orders, got = got[1]
    want = want[1]
    assert orders == list(range(len(want)))
    assert got == want
    # repr tells apart what == does not: 1, 1.0 and True; NaN is equal to itself
    assert repr(got) == repr(want)
    assert [type(g) for g in got] == [type(w) for w in want]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(CARRIED.map(json.dumps), min_size=1, max_size=8))
def test_rows_carrying_columns_are_what_read_jobs_yields(tmp_path, lines):
    path = write(tmp_path / "a.jsonl", lines)
    want = list(read_jobs([path], DEFAULTS))
    got = items_of([path], 3)[1]
    assert got == want and repr(got) == repr(want)


def test_a_nested_carried_value_is_parsed_by_the_reference_too(tmp_path, monkeypatch):
    """Where the reference parse refuses a line (a nesting limit, say), so does the fast path: rows
    with nested carried values are read by readers._parse_line as well, so its rules carry over."""
    from batchgen.jobs import chunks, readers

    real = readers._parse_line

    def strict(raw):  # a stand-in for a stricter reference parse: at most 3 levels below the row
        return "nested too deep" if raw.count(b"[") > 3 else real(raw)

    monkeypatch.setattr(readers, "_parse_line", strict)
    monkeypatch.setattr(chunks, "_parse_line", strict)
    lines = ['{"prompt": "p%d", "m": %s}' % (d, nested(d)) for d in range(6)]
    path = write(tmp_path / "a.jsonl", lines)
    want = list(read_jobs([path], DEFAULTS))
    assert [type(w).__name__ for w in want] == ["Job"] * 4 + ["InvalidRow"] * 2
    assert items_of([path], 100)[1] == want


def outcome(read):
    try:
        return "read", read()
    except RecursionError:
        return "raised", "RecursionError"


def test_rows_carrying_columns_stay_in_columns(tmp_path):
    lines = [json.dumps({"id": 10, "prompt": "a", "meta": {"k": [1, "x"]}, "tag": None}),
             json.dumps({"prompt": "b", "é": 2.5}), json.dumps({"prompt": "c", "n": 2}),
             json.dumps({"prompt": "d", "completion": "x"}), json.dumps({"prompt": "e", "m": "lone \ud800"}),
             '{"prompt": "f", "m": %s}' % nested(40), json.dumps({"prompt": "g", "m": [{"\udc00": 1}]}),
             json.dumps({"prompt": "h", "\ud800": 1}), json.dumps({"prompt": "i", "m": {"a": ["\udfff"]}})]
    path = write(tmp_path / "a.jsonl", lines)
    [chunk] = read_chunks([path], DEFAULTS, size=100)
    [rows] = chunk.plain
    assert rows.ids == [10, 1] and rows.extras == {0: {"meta": {"k": [1, "x"]}, "tag": None}, 1: {"é": 2.5}}
    # a parameter, a column batchgen writes, a lone surrogate in a value, deep nesting, a surrogate in a
    # nested name, in a column's name, in a nested value
    assert [o for o, _ in chunk.items] == [2, 3, 4, 5, 6, 7, 8]
    assert items_of([path], 100)[1] == list(read_jobs([path], DEFAULTS))
    [chunk] = read_chunks([path], DEFAULTS, size=100, carried=False)
    assert not chunk.plain and len(chunk.items) == 9


@pytest.mark.parametrize("kw", [{"system": "Be brief."}, {"prompt_template": "Say {prompt}"}])
def test_options_that_change_a_plain_row_take_the_reference_path(tmp_path, kw):
    path = write(tmp_path / "a.jsonl", [json.dumps({"id": i, "prompt": f"p{i}"}) for i in range(4)] + ["{bad"])
    orders, got = items_of([path], 2, **kw)
    assert got == list(read_jobs([path], DEFAULTS, **kw))
    assert all(not c.plain for c in read_chunks([path], DEFAULTS, size=2, **kw))


def test_json_arrays_and_parquet_take_the_reference_path(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"prompt": "one"}, {"id": 7, "prompt": "two"}, 3]))
    table = tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": [8, 9], "prompt": ["three", "four"]}), table)
    lines = write(tmp_path / "c.jsonl", [json.dumps({"id": 7, "prompt": "dup"}), json.dumps({"prompt": "five"})])
    paths = [str(array), str(table), lines]
    orders, got = items_of(paths, 2)
    assert got == list(read_jobs(paths, DEFAULTS))
    assert isinstance(got[5], InvalidRow) and "duplicate id 7" in got[5].reason  # ids checked across paths
    chunks = list(read_chunks(paths, DEFAULTS, size=100))
    assert [len(p) for c in chunks for p in c.plain] == [1]  # only the JSON Lines file's last row is plain


def test_a_plain_job_is_the_reference_job_under_any_defaults(tmp_path):
    path = write(tmp_path / "a.jsonl", [json.dumps({"id": "x", "prompt": "hello"})])
    for defaults in (GenerationDefaults(), GenerationDefaults(max_new_tokens=7, temperature=0.5, n=3, stop=("a",),
                                                              logprobs=True, top_logprobs=2, seed=5),
                     GenerationDefaults(constraint=GenerationDefaults.constraint_of(regex="a+"))):
        [chunk] = read_chunks([path], defaults)
        [(order, job)] = chunk.in_order(plain_template(defaults))
        assert isinstance(job, Job) and job == next(iter(read_jobs([path], defaults)))
        assert job.extra == {} and job.extra is not plain_template(defaults).extra


# --- preflight: plain rows in columns (validate, plan) against the same rows as Jobs -----------

def checked(paths, model_dir, purpose, fast, monkeypatch, **defaults):
    from batchgen.pipeline.run import inputrows
    from batchgen.pipeline.run import preflight
    from batchgen.pipeline.run.runner import RunOptions

    real = inputrows.Rows.__init__
    with monkeypatch.context() as patch:  # columnar=False: every row a Job, as `process` has them
        patch.setattr(inputrows.Rows, "__init__", lambda self, inputs, options, columnar=False, adapters=None:
                      real(self, inputs, options, columnar and fast, adapters))
        return preflight.check_inputs(paths, RunOptions(model=str(model_dir), defaults=GenerationDefaults(**defaults)),
                                      purpose=purpose)


@pytest.mark.parametrize("purpose", ["validate", "plan"])
@pytest.mark.parametrize("defaults", [{"max_new_tokens": 4}, {"max_new_tokens": 200, "n": 2},
                                      {"max_new_tokens": 4, "logit_bias": {"999": 1}},
                                      {"max_new_tokens": 0, "prompt_logprobs": True}])  # prompts scored alone
def test_plain_rows_in_columns_are_checked_and_indexed_as_jobs(tmp_path, model_dir, monkeypatch, purpose, defaults):
    head = "A header every job here shares, long enough to be cached. "
    lines = []
    for i in range(40):
        if i % 7 == 3:
            lines.append(json.dumps({"id": i, "prompt": head + "x" * 400}))  # over the context window of 512
        elif i % 9 == 4:
            lines.append(json.dumps({"id": i, "prompt": head + f"job {i}", "n": 3, "meta": i}))
        elif i % 11 == 5:
            lines.append("{broken")
        elif i % 5 == 1:  # columns carried through: plain rows in columns too, of mixed types
            lines.append(json.dumps({"id": i, "prompt": head + f"job {i}", "tag": [i] if i % 2 else str(i),
                                     "deep": {"a": {"b": i}}}))
        elif i % 8 == 2:
            lines.append(json.dumps({"id": i, "prompt": head + f"job {i}", "completion": 1}))  # a column batchgen writes
        else:
            lines.append(json.dumps({"id": i % 30, "prompt": head + f"job {i}"}))  # some ids repeat
    paths = [write(tmp_path / "a.jsonl", lines), write(tmp_path / "b.jsonl", lines[:5])]
    from batchgen.pipeline.run import inputrows
    from batchgen.pipeline.run import preflight

    counted = []
    monkeypatch.setattr(preflight, "tokenize_plain", lambda tok, rows, *args: counted.extend(map(len, rows))
                        or inputrows.tokenize_plain(tok, rows, *args))
    fast = checked(paths, model_dir, purpose, True, monkeypatch, **defaults)
    plain_rows = sum(counted)
    slow = checked(paths, model_dir, purpose, False, monkeypatch, **defaults)
    assert plain_rows >= 25 and sum(counted) == plain_rows  # the plain rows took the columns' path once
    assert fast.total == slow.total == 45
    assert fast.invalid.table().equals(slow.invalid.table())
    assert len(fast.invalid) > 5
    assert fast.orders.tolist() == slow.orders.tolist() and fast.schema == slow.schema
    if purpose == "plan":
        for name in ("order", "lcp", "tails", "ends", "lengths", "weights", "first"):
            assert np.array_equal(getattr(fast.index, name), getattr(slow.index, name)), name
        for a, b in zip(fast.index.shapes, slow.index.shapes):
            assert np.array_equal(a, b)
