"""pipeline/serve without vLLM: the request bodies and the answers' parsing, the client's retries and
refusals against a real local HTTP server, and the watchdog that keeps a started server from
outliving batchgen (a stand-in server: a shell script that starts a child of its own)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batchgen.jobs.params import Constraint
from batchgen.pipeline.engine.turns import Turn
from batchgen.pipeline.engine.types import Request, SamplingParams
from batchgen.pipeline.serve.client import Failed, Servers, ServerUnreachable
from batchgen.pipeline.serve.mapping import AnswerError, completions, request_body


class _Job:  # the fields of a Job that request_body reads
    def __init__(self, stop=(), constraint=None):
        self.stop, self.constraint = stop, constraint


def test_every_field_is_sent_explicitly():
    p = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=11, n=3, logit_bias=((4, -2.0),),
                       repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3, min_tokens=2,
                       stop_token_ids=(9,), logprobs=2)
    body = request_body(Request(5, [1, 2, 3], p, score_from=1), _Job(("\n",), Constraint("regex", "[ab]+")), "m")
    assert body["prompt"] == [1, 2, 3] and body["model"] == "m"
    assert (body["max_tokens"], body["n"], body["temperature"], body["top_p"], body["top_k"], body["seed"]) == \
        (7, 3, 0.7, 0.9, 5, 11)
    assert body["logit_bias"] == {"4": -2.0} and body["stop_token_ids"] == [9] and body["stop"] == ["\n"]
    assert (body["repetition_penalty"], body["presence_penalty"], body["frequency_penalty"], body["min_tokens"]) == \
        (1.1, 0.2, 0.3, 2)
    assert body["logprobs"] == 2 and body["prompt_logprobs"] == 0
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert body["structured_outputs"] == {"regex": "[ab]+"}
    greedy = request_body(Request(5, [1], SamplingParams(max_new_tokens=3)), _Job(), "m")
    assert greedy["top_k"] == -1 and greedy["temperature"] == 0.0 and "seed" not in greedy and "logprobs" not in greedy


def test_answers_become_completions():
    r = Request(4, [1, 2, 3], SamplingParams(max_new_tokens=2, logprobs=1), score_from=1)
    answer = {"choices": [{"index": 0, "token_ids": [7, 2], "finish_reason": "stop",
                           "logprobs": {"token_logprobs": [-0.5, -0.1],
                                        "top_logprobs": [{"token_id:7": -0.5, "token_id:8": -1.0},
                                                         {"token_id:2": -0.1}]},
                           "prompt_logprobs": [None, {"2": {"logprob": -1.5, "rank": 1}},
                                               {"3": {"logprob": -2.5, "rank": 4}, "5": {"logprob": -0.2, "rank": 1}}]}],
              "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}
    (c,) = completions(r, answer)
    assert c.token_ids == [7, 2] and c.finish_reason == "stop" and c.cached_tokens == 2 and c.prompt_tokens == 3
    assert [(t.token_id, t.logprob, t.top) for t in c.logprobs] == [(7, -0.5, [(7, -0.5)]), (2, -0.1, [(2, -0.1)])]
    assert c.prompt_logprobs == [-1.5, -2.5] and c.prompt_greedy == [True, False]
    with pytest.raises(AnswerError, match="token ids"):
        completions(Request(1, [1], SamplingParams(max_new_tokens=2)),
                    {"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]})
    scoring = Request((3, 1), [1, 2, 3], SamplingParams(max_new_tokens=0), score_from=2)
    (s,) = completions(scoring, {"choices": [{"index": 0, "token_ids": [4], "finish_reason": "length",
                                              "prompt_logprobs": answer["choices"][0]["prompt_logprobs"]}]})
    assert s.token_ids == [] and s.prompt_logprobs == [-2.5] and s.prompt_greedy == [False] and s.cached_tokens == 0


def test_greedy_samples_are_one_sample_asked_once_and_repeated():
    """vLLM refuses greedy n > 1 ("n must be 1 when using greedy sampling"): greedy samples are the
    one greedy continuation, so the body asks n = 1 and the answer gives each sample that one."""
    r = Request(6, [1, 2], SamplingParams(max_new_tokens=2, n=3, logprobs=0))
    body = request_body(r, _Job(), "m")
    assert body["n"] == 1 and body["temperature"] == 0.0
    answer = {"choices": [{"index": 0, "token_ids": [5, 6], "finish_reason": "length",
                           "logprobs": {"token_logprobs": [-0.1, -0.2], "top_logprobs": [{}, {}]}}]}
    out = completions(r, answer)
    assert [(c.sample_index, c.token_ids, c.finish_reason) for c in out] == [(i, [5, 6], "length") for i in range(3)]
    assert out[0].logprobs == out[2].logprobs and out[0].logprobs is not out[2].logprobs
    sampled = request_body(Request(6, [1, 2], SamplingParams(max_new_tokens=2, n=3, temperature=0.5)), _Job(), "m")
    assert sampled["n"] == 3
    with pytest.raises(AnswerError, match="2 choices"):
        completions(r, {"choices": [answer["choices"][0], {**answer["choices"][0], "index": 1}]})


class _Server:
    """A real HTTP server on loopback: answers each POST with the next status of `statuses` (then 200s)."""

    def __init__(self, statuses):
        server = self
        self.statuses, self.posts = list(statuses), 0
        self.prompts = []  # every POST's prompt, in the order they came

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.posts += 1
                server.prompts.append(body["prompt"])
                status = server.statuses.pop(0) if server.statuses else 200
                payload = {"error": {"message": f"status {status}"}} if status != 200 else \
                    {"choices": [{"index": 0, "token_ids": body["prompt"][::-1], "finish_reason": "length"}]}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_retries_then_refusals():
    server = _Server([500, 429, 503, 200, 400])
    servers = Servers([server.url], concurrency=1, retry_seconds=30)
    try:
        got = list(servers.run([(0, "a", {"prompt": [1, 2]}), (0, "b", {"prompt": [3]})], lambda: False))
    finally:
        servers.close()
        server.close()
    assert got[0] == ("a", {"choices": [{"index": 0, "token_ids": [2, 1], "finish_reason": "length"}]})
    assert got[1] == ("b", Failed(400, "status 400"))  # a 4xx other than 429: the request's own
    assert server.posts == 5


def test_urgent_bodies_go_before_the_rest_and_after_it():
    """A conversation's next turn (added to `urgent` while the answers are read) goes out before
    the requests not yet sent, within the bound; one added after the last of them still goes."""
    server = _Server([])
    servers = Servers([server.url], concurrency=1, retry_seconds=30)
    urgent = deque()
    answered = []
    try:
        for tag, answer in servers.run([(0, ("new", i), {"prompt": [i]}) for i in range(4)], lambda: False, urgent):
            answered.append(tag)
            if tag[0] == "new" and tag[1] in (0, 1, 3):
                urgent.append((0, ("next", tag[1]), {"prompt": [100 + tag[1]]}))
    finally:
        servers.close()
        server.close()
    assert server.prompts == [[0], [100], [1], [101], [2], [3], [103]]
    assert answered == [("new", 0), ("next", 0), ("new", 1), ("next", 1), ("new", 2), ("new", 3), ("next", 3)]


def test_a_later_turn_of_a_sample_is_seeded_as_that_sample():
    """vLLM seeds sample i of an n-sample request seed + i: a conversation's later turn of sample i
    (a request of its own) gets the same."""
    p = SamplingParams(max_new_tokens=3, temperature=0.8, seed=40, n=1)
    assert request_body(Request(Turn(5, 1, 1), [1], p), _Job(), "m")["seed"] == 41
    assert request_body(Request(5, [1], p), _Job(), "m")["seed"] == 40


def test_a_server_that_stays_down_is_unreachable():
    server = _Server([503] * 100)
    servers = Servers([server.url], concurrency=2, retry_seconds=1.5)
    began = time.monotonic()
    try:
        with pytest.raises(ServerUnreachable, match="unreachable for .*HTTP 503"):
            list(servers.run([(0, i, {"prompt": [i]}) for i in range(4)], lambda: False))
    finally:
        servers.close()
        server.close()
    assert time.monotonic() - began < 15
    closed = Servers(["http://127.0.0.1:9"], concurrency=1, retry_seconds=0.5)  # nothing listens there
    with pytest.raises(ServerUnreachable, match="ConnectError"):
        list(closed.run([(0, 0, {"prompt": [1]})], lambda: False))
    closed.close()


FAKE_SERVER = """#!/bin/sh
# a stand-in `vllm`: a child of its own (as vLLM's engine process), both sleeping
sleep 1000 &
exec sleep 1001
"""

PARENT = """
import sys, time
from batchgen.pipeline.serve.vllm_server import VllmServer
s = VllmServer(sys.argv[1], "model", "name", sys.argv[2])
s.spawn()
print(s.process.pid, flush=True)
if sys.argv[3] == "stop":
    time.sleep(1.0)
    s.stop()
    print("stopped", flush=True)
else:
    time.sleep(1000)
"""


def _marked(mark: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SERVE_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                    out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "stop"])
def test_a_started_server_never_outlives_batchgen(tmp_path, how):
    exe = tmp_path / "vllm"
    exe.write_text(FAKE_SERVER)
    exe.chmod(0o755)
    mark = str(uuid.uuid4())
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(exe), str(tmp_path / "log"), how],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "SERVE_TEST_MARK": mark})
    parent.stdout.readline()
    end = time.monotonic() + 10
    while len(_marked(mark)) < 4 and time.monotonic() < end:  # batchgen, the watchdog, the server, its child
        time.sleep(0.05)
    assert len(_marked(mark)) == 4, _marked(mark)
    if how == "sigkill":
        parent.send_signal(signal.SIGKILL)
    else:
        assert parent.stdout.readline().strip() == "stopped"
    parent.wait(timeout=30)
    end = time.monotonic() + 20
    while _marked(mark) and time.monotonic() < end:
        time.sleep(0.1)
    assert _marked(mark) == []
    assert "batchgen: " in (tmp_path / "log").read_text()


BROKEN_VLLM = """#!/bin/sh
echo "loading $2"
echo "RuntimeError: no accelerator here" >&2
exit 3
"""


@pytest.mark.slow
def test_a_server_that_does_not_start_is_one_error_quoting_its_log(tmp_path):
    import transformers

    from tests.helpers.tiny_models import model_from_config
    from tests.helpers.tiny_tokenizer import make_tokenizer

    tok = make_tokenizer()
    model_from_config(transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, bos_token_id=1,
                                               eos_token_id=2)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    exe = tmp_path / "vllm"
    exe.write_text(BROKEN_VLLM)
    exe.chmod(0o755)
    (tmp_path / "jobs.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    out = tmp_path / "out.parquet"
    r = subprocess.run([sys.executable, "-m", "batchgen", "process", str(tmp_path / "jobs.jsonl"), "-o", str(out),
                        "--model", str(tmp_path / "m"), "--engine", "vllm", "--vllm", str(exe)],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "vLLM did not start (it exited with code 3)" in r.stderr and "no accelerator here" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    missing = subprocess.run([sys.executable, "-m", "batchgen", "process", str(tmp_path / "jobs.jsonl"), "-o",
                              str(out), "--model", str(tmp_path / "m"), "--engine", "vllm", "--vllm",
                              str(tmp_path / "nope")], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and "not found or not executable" in missing.stderr
