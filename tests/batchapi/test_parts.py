"""`batchgen serve`'s parts without a server: a batch input checked as the Batch API checks it, the
SQLite store's conditional status changes and pages, a streamed upload under its size limit, and
the error line of a request a batch ended before it ran."""
import asyncio
import json
import os

import pytest

from batchgen.jobs.openai_batch import error_line, not_run_reason
from batchgen.pipeline.batchapi.batches import check_input
from batchgen.pipeline.batchapi.errors import ApiError
from batchgen.pipeline.batchapi.files import FILES, clean, keep, receive
from batchgen.pipeline.batchapi.store import Store

CHAT = "/v1/chat/completions"


def line(cid, url=CHAT, model="m", **extra):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}, **extra})


def test_a_batch_input_is_checked_line_by_line(tmp_path):
    path = tmp_path / "in.jsonl"
    rows = ["\ufeff" + line("a"), line("b"), "", '{"custom_id": "d",', line("c", url="/v1/completions"), line("d", model="n"),
            line("a"), json.dumps({"custom_id": 5}), line("e", method="GET"), json.dumps([1]), "  ",
            json.dumps({"custom_id": "f", "method": "POST", "url": CHAT, "body": {"messages": []}})]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    got = check_input(str(path), CHAT)
    assert got.total == 10 and got.model == "m"  # blank lines are not requests; line numbers count them
    assert [(p["code"], p["line"], p["param"]) for p in got.problems] == [
        ("invalid_json_line", 4, None), ("url_mismatch", 5, "url"), ("model_mismatch", 6, "body.model"),
        ("duplicate_custom_id", 7, "custom_id"), ("invalid_request", 8, "custom_id"), ("invalid_request", 9, "method"),
        ("invalid_json_line", 10, None), ("invalid_request", 12, "body.model")]
    # where the line ends, not "column 1" of the line break after it
    assert got.problems[0]["message"] == "Line 4 is not parseable as valid JSON: Expecting property name enclosed " \
                                         "in double quotes at column 19."


def test_the_limits_are_the_batch_apis_and_configurable(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line(f"r{i}") + "\n" for i in range(5)))
    assert check_input(str(path), CHAT).problems == []
    assert [p["code"] for p in check_input(str(path), CHAT, max_requests=4).problems] == ["too_many_tasks"]
    assert [p["code"] for p in check_input(str(path), CHAT, max_bytes=100).problems] == ["file_too_large"]
    path.write_text("\n\n")
    assert [p["code"] for p in check_input(str(path), CHAT).problems] == ["empty_file"]


def test_status_changes_are_conditional_and_recorded(tmp_path):
    store = Store(str(tmp_path))
    store.add_batch("batch_1", CHAT, "file-1", "24h", None, 100, 200)
    assert store.move("batch_1", ("validating",), "cancelling", 101)
    # the worker saw `validating` and would move it on: the cancel has won, nothing changes
    assert not store.move("batch_1", ("validating",), "in_progress", 102)
    assert store.move("batch_1", ("cancelling",), "cancelled", 103)
    row = store.batch("batch_1")
    assert (row["status"], row["cancelling_at"], row["cancelled_at"], row["in_progress_at"]) == ("cancelled", 101, 103,
                                                                                                 None)
    assert [e["status"] for e in store.events("batch_1")] == ["validating", "cancelling", "cancelled"]
    assert store.next_open() is None
    again = Store(str(tmp_path))  # another connection (a restarted server) reads what was committed
    assert again.batch("batch_1")["status"] == "cancelled"


def test_pages_follow_creation_order(tmp_path):
    store = Store(str(tmp_path))
    for i in range(5):
        store.add_file(f"file-{i}", i, f"f{i}", "batch", f"files/file-{i}", 100 + i)
    rows, more = store.files(None, 2, None, ascending=False)
    assert [r["id"] for r in rows] == ["file-4", "file-3"] and more
    rows, more = store.files(None, 2, "file-1", ascending=False)
    assert [r["id"] for r in rows] == ["file-0"] and not more
    rows, more = store.files("batch", 3, "file-1", ascending=True)
    assert [r["id"] for r in rows] == ["file-2", "file-3", "file-4"] and not more
    with pytest.raises(KeyError):
        store.files(None, 2, "file-nope", ascending=True)


def multipart(content: bytes, filename="x.jsonl", purpose=b"batch"):
    head = (b'--BB\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n' + purpose +
            b'\r\n--BB\r\nContent-Disposition: form-data; name="file"; filename="' + filename.encode() + b'"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n")
    return head + content + b"\r\n--BB--\r\n"


def upload(data_dir, body, limit, chunk=7):
    async def stream():
        for i in range(0, len(body), chunk):  # in small pieces: boundaries fall anywhere
            yield body[i:i + chunk]

    return asyncio.run(receive("multipart/form-data; boundary=BB", None, stream(), str(data_dir), limit))


def test_an_upload_is_streamed_whole_or_not_at_all(tmp_path):
    os.makedirs(tmp_path / FILES)
    content = bytes(range(256)) * 40 + b"\r\n--B not the boundary"
    got = upload(tmp_path, multipart(content, filename="../../../etc/passwd"), limit=len(content))
    assert (got.size, got.filename, got.purpose) == (len(content), "../../../etc/passwd", "batch")
    assert open(got.path, "rb").read() == content and os.path.dirname(got.path) == str(tmp_path / FILES)
    rel = keep(got, str(tmp_path), "file-abc")
    assert rel == os.path.join(FILES, "file-abc") and (tmp_path / rel).read_bytes() == content
    for body, limit, status in ((multipart(content), len(content) - 1, 413),  # one byte over the limit
                                (multipart(b"x", purpose=b"nonsense"), 10, 400),
                                (b"--BB\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--BB--\r\n",
                                 10, 400)):  # no file
        with pytest.raises(ApiError) as e:
            upload(tmp_path, body, limit)
        assert e.value.status == status
    assert os.listdir(tmp_path / FILES) == ["file-abc"]  # no temporary file stays behind
    (tmp_path / FILES / ".upload-left").write_bytes(b"half")  # what a killed server left
    assert clean(str(tmp_path), {rel}) == [os.path.join(FILES, ".upload-left")]
    assert os.listdir(tmp_path / FILES) == ["file-abc"]


def test_a_request_the_batch_ended_before_it_ran_has_its_own_code():
    for code in ("batch_cancelled", "batch_expired"):
        got = error_line({"custom_id": "r1", "location": "input.jsonl:3", "reason": not_run_reason(code)})
        assert got["error"]["code"] == code and got["custom_id"] == "r1"
        assert got["error"]["message"].startswith("input.jsonl:3: this request")
    other = error_line({"custom_id": "r2", "location": "input.jsonl:4", "reason": "batch_expired is a word here"})
    assert other["error"]["code"] == "invalid_request"
