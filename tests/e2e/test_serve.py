"""`batchgen serve` as a real server (a subprocess on a free loopback port, the tiny model), driven
by the real `openai` client: a round trip equal to `batchgen process` on the same file, SIGKILL
and restart mid-batch, cancel, expiry (the server's clock a day later), a wrong key, invalid
files, pagination, concurrent and oversized uploads."""
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from click.testing import CliRunner

from batchgen.pipeline.cli import main

pytestmark = pytest.mark.slow

KEY = "test-key-0123456789"
# a batch long enough to stop in the middle, also on a fast machine: one row at a time
# (--max-batch-tokens), EOS kept out of most requests so they run to max_tokens, a commit every two
# requests, and the run's pace (child.py: seconds per finished request, for tests only)
SERVER_OPTIONS = ["--commit-every", "2", "--max-batch-tokens", "160", "--max-new-tokens", "16"]
PACE = {"BATCHGEN_SERVE_TEST_PACE": "0.1"}
SYSTEM = "You are a helpful assistant. Answer in one short sentence. "


def chat(cid, text, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny-llama", "messages": [{"role": "system", "content": SYSTEM},
                                                         {"role": "user", "content": text}], **body}}


REQUESTS = [chat(f"q{i}", f"Question number {i}?", max_tokens=48 if i % 4 else 12,
                 **({"logit_bias": {"2": -100}} if i % 3 else {})) for i in range(20)]
REQUESTS.insert(7, chat("bad-tools", "Weather?", tools=[{"type": "function", "function": {"name": "w"}}]))


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


class Server:
    """`batchgen serve` in a subprocess; ready once it answers an authorized request."""

    def __init__(self, data, model_dir, *extra, env=None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.data, self.port, self.url = data, port, f"http://127.0.0.1:{port}/v1"
        self.log = data.parent / f"{data.name}-{port}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "batchgen", "serve", "--host", "127.0.0.1", "--port", str(port), "--data",
                 str(data), "--api-key", KEY, "--model", str(model_dir), *SERVER_OPTIONS, *extra],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **PACE, **(env or {})})
        deadline = time.monotonic() + 120
        while raw_get(self.url + "/batches?limit=1", KEY)[0] != 200:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.2)

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0)

    def output(self):
        return self.log.read_text(encoding="utf-8", errors="replace")[-4000:]

    def kill(self, sig=signal.SIGKILL):
        self.proc.send_signal(sig)
        self.proc.wait(60)


def raw_get(url, key=None):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return None, b""


def upload(client, path, purpose="batch"):
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose=purpose)


def wait(client, batch_id, until, timeout=240):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.1)


def done(b):
    return b.status in ("completed", "failed", "cancelled", "expired")


def lines_of(client, file_id):
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def answers(lines):
    """custom_id -> what a run decides of its answer (not the random ids, nor `created`)."""
    out = {}
    for line in lines:
        assert line["custom_id"] not in out
        body = line["response"]["body"]
        out[line["custom_id"]] = {k: body[k] for k in ("object", "model", "choices", "usage", "system_fingerprint")}
    return out


def exactly_once(output, errors):
    ids = [x["custom_id"] for x in output + errors]
    assert sorted(ids) == sorted(r["custom_id"] for r in REQUESTS)


def statuses(data, batch_id):
    with sqlite3.connect(data / "batchgen.sqlite3") as db:
        return [s for (s,) in db.execute("SELECT status FROM batch_events WHERE batch_id = ? ORDER BY rowid",
                                         (batch_id,))]


def children_of(batch_dir):
    """Processes running a batch's child in `batch_dir` (its cwd)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            if b"batchgen.pipeline.batchapi.child" in cmd and os.readlink(f"/proc/{pid}/cwd") == str(batch_dir):
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("batch") / "batch.jsonl", REQUESTS)


@pytest.fixture(scope="module")
def reference(batch_file, model_dir):
    """`batchgen process` on the same file with the server's options: what every batch must answer."""
    out = batch_file.parent / "reference.jsonl"
    res = CliRunner().invoke(main, ["process", str(batch_file), "-o", str(out), "--output-format", "openai",
                                    "--model", str(model_dir), *SERVER_OPTIONS])
    assert res.exit_code == 0, res.output
    errors = [json.loads(x) for x in (batch_file.parent / "reference.jsonl.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad-tools"]
    return answers(json.loads(x) for x in out.read_text().splitlines())


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    s = Server(tmp_path_factory.mktemp("serve") / "data", model_dir, "--max-requests", "100",
               "--max-file-bytes", "1000000")
    yield s
    s.kill(signal.SIGTERM)


def test_a_round_trip_answers_as_batchgen_process(server, batch_file, reference):
    client = server.client()
    f = upload(client, batch_file)
    assert (f.object, f.purpose, f.filename, f.bytes) == ("file", "batch", "batch.jsonl", batch_file.stat().st_size)
    assert client.files.content(f.id).content == batch_file.read_bytes()
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"run": "round-trip"})
    assert b.status == "validating" and b.metadata == {"run": "round-trip"} and b.expires_at == b.created_at + 86400
    moving = wait(client, b.id, lambda b: done(b) or 0 < b.request_counts.completed < 20)
    assert not done(moving), "the counts move as parts commit, before the batch ends"
    b = wait(client, b.id, done)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (21, 20, 1)
    assert b.model == "tiny-llama" and b.errors is None
    assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at
    assert statuses(server.data, b.id) == ["validating", "in_progress", "finalizing", "completed"]
    output, errors = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    exactly_once(output, errors)
    assert answers(output) == reference
    (error,) = errors
    assert error["custom_id"] == "bad-tools" and error["error"]["code"] == "invalid_request"
    assert error["error"]["message"].startswith("input.jsonl:8: field 'body.tools'")  # no server path in it
    for fid, name in ((b.output_file_id, "output"), (b.error_file_id, "error")):
        meta = client.files.retrieve(fid)
        assert (meta.purpose, meta.filename) == ("batch_output", f"{b.id}_{name}.jsonl")
        assert meta.bytes == len(client.files.content(fid).content)
    assert b.usage.output_tokens == sum(a["usage"]["completion_tokens"] for a in reference.values())
    with pytest.raises(openai.BadRequestError):  # a batch that completed cannot be cancelled
        client.batches.cancel(b.id)
    client.files.delete(f.id)  # the batch keeps its own copy of its input
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_cancel_keeps_the_finished_requests(server, batch_file, reference):
    client = server.client()
    fid = upload(client, batch_file).id
    b = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    queued = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait(client, b.id, lambda b: done(b) or b.request_counts.completed >= 2)
    assert not done(b), b
    queued = client.batches.cancel(queued.id)  # waiting behind the running one: it never ran
    assert queued.status == "cancelled" and queued.output_file_id is None and queued.error_file_id is None
    assert statuses(server.data, queued.id) == ["validating", "cancelling", "cancelled"]
    b = client.batches.cancel(b.id)
    assert b.status == "cancelling" and b.cancelling_at is not None
    b = wait(client, b.id, done)
    assert b.status == "cancelled" and b.cancelled_at >= b.cancelling_at, b
    assert statuses(server.data, b.id) == ["validating", "in_progress", "cancelling", "cancelled"]
    output, errors = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    exactly_once(output, errors)  # the requests that never ran: error lines batch_cancelled
    assert 2 <= len(output) < 20 and b.request_counts.completed == len(output) and b.request_counts.failed == 1
    assert answers(output) == {k: reference[k] for k in answers(output)}
    codes = {e["custom_id"]: e["error"]["code"] for e in errors}
    assert codes.pop("bad-tools") == "invalid_request" and set(codes.values()) == {"batch_cancelled"}
    assert client.batches.cancel(b.id).status == "cancelled"  # again: the same answer


def test_sigkill_mid_batch_then_restart_finishes_each_request_once(tmp_path, model_dir, batch_file, reference):
    data = tmp_path / "data"
    first = Server(data, model_dir)
    client = first.client()
    # an upload the kill will cut: half its body sent, its temporary file begun
    half = socket.create_connection(("127.0.0.1", first.port))
    head = (b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: multipart/form-data; boundary=b0undary\r\nContent-Length: 500000\r\n\r\n")
    half.sendall(head + b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
                 + b"x" * 200_000)
    deadline = time.monotonic() + 30
    while not any(n.startswith(".upload-") for n in os.listdir(data / "files")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    b = client.batches.create(input_file_id=upload(client, batch_file).id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    b = wait(client, b.id, lambda b: done(b) or b.request_counts.completed >= 4)
    batch_dir = data / "batches" / b.id
    running = children_of(batch_dir)
    first.kill()
    half.close()
    assert not done(b) and running, b
    deadline = time.monotonic() + 10
    while children_of(batch_dir):  # the child dies with the server
        assert time.monotonic() < deadline, "the batch's child outlived its server"
        time.sleep(0.05)

    again = Server(data, model_dir)
    client = again.client()
    assert [f.filename for f in client.files.list()] == ["batch.jsonl"]  # the cut upload is absent ...
    assert [n for n in os.listdir(data / "files") if n.startswith(".")] == []  # ... and its temporary file gone
    b = wait(client, b.id, done)
    assert b.status == "completed", b
    output, errors = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    exactly_once(output, errors)
    assert answers(output) == reference
    summary = json.loads((batch_dir / "output.jsonl.summary.json").read_text())
    assert summary["resumed_jobs"] >= 4  # resumed from the committed parts, not run again
    again.kill(signal.SIGTERM)


def test_expiry_ends_the_batch_with_what_it_finished(tmp_path, model_dir, batch_file, reference):
    data = tmp_path / "data"
    first = Server(data, model_dir)
    client = first.client()
    fid = upload(client, batch_file).id
    b = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    queued = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait(client, b.id, lambda b: done(b) or b.request_counts.completed >= 2)
    assert not done(b), b
    first.kill(signal.SIGTERM)  # a graceful stop: the running batch commits, then the server exits
    assert "batchgen serve: stopped" in first.output()
    assert not children_of(data / "batches" / b.id)

    later = Server(data, model_dir, env={"BATCHGEN_SERVE_CLOCK_OFFSET": str(25 * 3600)})
    client = later.client()
    b = wait(client, b.id, done)
    assert b.status == "expired" and b.expired_at >= b.expires_at, b
    output, errors = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    exactly_once(output, errors)
    assert len(output) >= 2 and answers(output) == {k: reference[k] for k in answers(output)}
    codes = {e["custom_id"]: e["error"]["code"] for e in errors}
    assert codes.pop("bad-tools") == "invalid_request" and set(codes.values()) == {"batch_expired"}
    queued = wait(client, queued.id, done)  # never started: expired with no files
    assert queued.status == "expired" and queued.output_file_id is None and queued.error_file_id is None
    later.kill(signal.SIGTERM)


def test_a_wrong_key_gets_401_and_stores_nothing(server, batch_file):
    before = sorted(os.listdir(server.data / "files"))
    listed = [f.id for f in server.client().files.list()]
    for key in ("wrong-key", KEY + "x", KEY[:-1]):
        bad = server.client(key)
        with pytest.raises(openai.AuthenticationError) as e:
            upload(bad, batch_file)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.batches.list()
    assert raw_get(server.url + "/batches")[0] == 401  # no Authorization header
    assert raw_get(server.url + "/nowhere")[0] == 401  # every route, known or not
    assert sorted(os.listdir(server.data / "files")) == before
    assert [f.id for f in server.client().files.list()] == listed


def test_an_invalid_file_fails_the_batch_with_line_numbers(server):
    client = server.client()
    rows = [chat("a", "One?"), chat("b", "Two?"), chat("c", "Three?"), '{"custom_id": "d", "method": "POST",',
            {**chat("e", "Five?"), "url": "/v1/completions"}, {**chat("f", "Six?"), "body": {"model": "other"}},
            chat("a", "Again?"), "", "[1, 2]"]
    path = write_jsonl(server.data.parent / "invalid.jsonl", rows)
    b = client.batches.create(input_file_id=upload(client, path).id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    b = wait(client, b.id, done)
    assert b.status == "failed" and b.failed_at is not None and b.output_file_id is None
    got = [(e.code, e.line, e.param) for e in b.errors.data]
    assert got == [("invalid_json_line", 4, None), ("url_mismatch", 5, "url"), ("model_mismatch", 6, "body.model"),
                   ("duplicate_custom_id", 7, "custom_id"), ("invalid_json_line", 9, None)]
    assert b.errors.data[0].message.startswith("Line 4 is not parseable as valid JSON")
    assert statuses(server.data, b.id) == ["validating", "failed"]
    for rows, code in (([], "empty_file"), ([chat(f"r{i}", "Hi?") for i in range(101)], "too_many_tasks")):
        path = write_jsonl(server.data.parent / "limits.jsonl", rows)
        b = client.batches.create(input_file_id=upload(client, path).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        assert [e.code for e in wait(client, b.id, done).errors.data] == [code]
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=b.input_file_id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")


def test_pagination_of_batches_and_files(server):
    client = server.client()
    empty = write_jsonl(server.data.parent / "empty.jsonl", [])
    files = [upload(client, empty).id for _ in range(3)]
    mine = [client.batches.create(input_file_id=files[0], endpoint="/v1/completions", completion_window="24h").id
            for _ in range(5)]
    first = client.batches.list(limit=2)
    assert [x.id for x in first.data] == mine[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert [x.id for x in second.data] == mine[::-1][2:4]
    every = [x.id for x in client.batches.list(limit=2)]  # the client follows `after` page by page
    assert every[:5] == mine[::-1] and len(every) == len(set(every))
    ascending = [f.id for f in client.files.list(limit=1, order="asc")]
    assert ascending[-3:] == files and len(ascending) == len(set(ascending))
    with pytest.raises(openai.NotFoundError):
        client.batches.list(after="batch_nope")


def test_concurrent_uploads_are_each_stored_whole(server):
    client = server.client()
    names = [f"part-{i}.jsonl" for i in range(7)] + ["../../escape.jsonl"]
    payloads = [(name, os.urandom(40_000 + 977 * i)) for i, name in enumerate(names)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: client.files.create(file=p, purpose="batch"), payloads))
    assert len({f.id for f in got}) == len(got)
    for f, (name, content) in zip(got, payloads):
        assert f.filename == name and f.bytes == len(content)  # the name is data, never a path
        assert client.files.content(f.id).content == content
    assert not (server.data.parent / "escape.jsonl").exists() and not (server.data / "escape.jsonl").exists()
    with pytest.raises(openai.APIStatusError) as e:  # over --max-file-bytes
        client.files.create(file=("big.jsonl", b"x" * 1_100_000), purpose="batch")
    assert e.value.status_code == 413
    assert [n for n in os.listdir(server.data / "files") if n.startswith(".")] == []


def test_no_key_means_loopback_only(tmp_path):
    res = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--data", str(tmp_path / "d")],
                             env={"BATCHGEN_API_KEY": None})
    assert res.exit_code == 2 and "is not a loopback address" in res.output
    assert not (tmp_path / "d").exists()
