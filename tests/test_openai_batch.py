"""An OpenAI Batch file mixing valid requests, bad requests, response_format and logprobs: the
output and error files have the Batch API's documented shapes, field by field."""
import json
import re
import time

import jsonschema
from click.testing import CliRunner

from pipeline.cli import main

SYSTEM = "You answer briefly and kindly, in plain words, and you never make things up. "
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"type": "string", "maxLength": 8}, "sure": {"type": "boolean"}}}


def chat(cid, content, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": content}],
                     "max_tokens": 40, **body}}


REQUESTS = [
    chat("plain", "Say hi.", n=2, temperature=0.8, seed=3),
    chat("schema", "Answer as JSON.", response_format={"type": "json_schema",
                                                       "json_schema": {"name": "a", "strict": True, "schema": SCHEMA}}),
    chat("object", "Any JSON object.", response_format={"type": "json_object"}, max_tokens=80),
    chat("quiet-logprobs", "Hello.", logprobs=False),  # asks for nothing batchgen does not do
    chat("logprobs", "Hello.", logprobs=True, top_logprobs=5),
    chat("top-alone", "Hello.", top_logprobs=2),  # alternatives without logprobs: an error line
    chat("tools", "Weather?", tools=[{"type": "function", "function": {"name": "weather"}}]),
    chat("echo", "Hi.", echo=True),  # not a chat parameter
    chat("bad-tokens", "Hi.", max_tokens=-5),
    {"custom_id": "list", "method": "POST", "url": "/v1/completions",
     "body": {"model": "davinci-002", "prompt": [SYSTEM + "One", SYSTEM + "Two"], "max_tokens": 4, "n": 2}},
    {"custom_id": "echo-logprobs", "method": "POST", "url": "/v1/completions",
     "body": {"model": "davinci-002", "prompt": SYSTEM + "Three", "max_tokens": 3, "logprobs": 2, "echo": True}},
    "{not json",
]


def test_openai_output_and_error_files_match_the_batch_api(tmp_path, model_dir):
    src = tmp_path / "batch.jsonl"
    src.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in REQUESTS))
    out = tmp_path / "out.jsonl"
    started = int(time.time())
    args = ["process", str(src), "-o", str(out), "--output-format", "openai", "--min-shared-tokens", "4",
            "--model", str(model_dir)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["plain", "schema", "object", "quiet-logprobs", "logprobs", "list",
                                               "echo-logprobs"]
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert re.fullmatch(r"batch_req_[0-9a-f]{24}", line["id"])
        response = line["response"]
        assert set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 200
        assert re.fullmatch(r"req_[0-9a-f]{24}", response["request_id"])
        body = response["body"]
        chat_kind = line["custom_id"] not in ("list", "echo-logprobs")
        assert set(body) == {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
        assert body["object"] == ("chat.completion" if chat_kind else "text_completion")
        assert body["id"].startswith("chatcmpl-" if chat_kind else "cmpl-")
        assert started <= body["created"] <= time.time() + 1
        assert body["model"] == ("gpt-4o-mini" if chat_kind else "davinci-002")  # body.model, echoed
        assert body["system_fingerprint"] == f"batchgen-0.1.0:{model_dir}:float32"
        for i, choice in enumerate(body["choices"]):
            assert choice["index"] == i
            assert (choice["logprobs"] is None) == (line["custom_id"] not in ("logprobs", "echo-logprobs"))
            assert choice["finish_reason"] in ("stop", "length")
            if chat_kind:
                assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
                assert set(choice["message"]) == {"role", "content", "refusal", "annotations"}
                assert choice["message"]["role"] == "assistant" and choice["message"]["refusal"] is None
            else:
                assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
        if chat_kind:
            assert usage["completion_tokens_details"] == {"reasoning_tokens": 0, "audio_tokens": 0,
                                                          "accepted_prediction_tokens": 0,
                                                          "rejected_prediction_tokens": 0}
        else:
            assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    by_id = {x["custom_id"]: x["response"]["body"] for x in lines}
    assert len(by_id["plain"]["choices"]) == 2
    answer = by_id["schema"]["choices"][0]
    assert answer["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer["message"]["content"]), SCHEMA)
    assert isinstance(json.loads(by_id["object"]["choices"][0]["message"]["content"]), dict)
    # a list prompt: one line, a choice per element and sample (index = element * n + sample)
    assert len(by_id["list"]["choices"]) == 4 and by_id["list"]["usage"]["completion_tokens"] <= 16
    check_logprob_shapes(by_id["logprobs"], by_id["echo-logprobs"])
    ids = [x["id"] for x in lines] + [x["response"]["request_id"] for x in lines] + [b["id"] for b in by_id.values()]
    assert len(set(ids)) == len(ids)

    assert not (tmp_path / "out.jsonl.errors.parquet").exists()  # OpenAI output has error lines instead
    errors = [json.loads(x) for x in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["top-alone", "tools", "echo", "bad-tokens", None]
    for e in errors:
        assert set(e) == {"id", "custom_id", "response", "error"} and e["response"] is None
        assert re.fullmatch(r"batch_req_[0-9a-f]{24}", e["id"])
        assert set(e["error"]) == {"code", "message"} and e["error"]["code"] == "invalid_request"
    messages = [e["error"]["message"] for e in errors]
    assert messages[0].startswith(f"{src}:6: field 'body.top_logprobs' is 2 but logprobs is not true")
    assert messages[1].startswith(f"{src}:7: field 'body.tools'")
    assert messages[2].startswith(f"{src}:8: field 'body.echo' is not a parameter of /v1/chat/completions")
    assert messages[3] == f"{src}:9: field 'body.max_tokens' must be a positive integer, got -5"
    assert messages[4].startswith(f"{src}:12: malformed JSON")

    # a second run: every id is new
    res = CliRunner().invoke(main, args + ["--overwrite"])
    assert res.exit_code == 0
    again = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert not set(again) & set(ids)


def check_logprob_shapes(chat_body, echo_body):
    """logprobs: true, top_logprobs: 5 on chat, and logprobs: 2 with echo on /v1/completions, come
    back in the shapes the two APIs document."""
    (choice,) = chat_body["choices"]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"content", "refusal"} and logprobs["refusal"] is None
    assert len(logprobs["content"]) == chat_body["usage"]["completion_tokens"] > 0
    for t in logprobs["content"]:
        assert set(t) == {"token", "logprob", "bytes", "top_logprobs"}
        assert t["bytes"] == list(t["token"].encode("utf-8")) and t["logprob"] <= 0
        assert len(t["top_logprobs"]) == 5
        assert all(set(a) == {"token", "logprob", "bytes"} for a in t["top_logprobs"])
        tops = [a["logprob"] for a in t["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        assert t["logprob"] == tops[0] and t["token"] == t["top_logprobs"][0]["token"]  # greedy: the argmax
    (choice,) = echo_body["choices"]
    assert choice["text"].startswith(SYSTEM + "Three")  # echo: the prompt, then the completion
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    prompt, generated = echo_body["usage"]["prompt_tokens"], echo_body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == prompt + generated
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["top_logprobs"][:prompt] == [None] * prompt
    assert all(isinstance(d, dict) and len(d) <= 2 for d in lp["top_logprobs"][prompt:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_a_list_prompt_with_an_element_too_long_fails_as_one_request(tmp_path, model_dir):
    """An element refused after tokenizing (longer than the context window) fails its whole request:
    one error line under the request's custom_id, no output line; other requests run."""
    requests = [{"custom_id": "half", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": [SYSTEM + "Fine.", "word " * 400], "max_tokens": 4}},
                chat("ok", "Hello.", max_tokens=4)]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(out), "--output-format", "openai",
                                    "--model", str(model_dir)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["ok"]
    (error,) = [json.loads(x) for x in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert error["custom_id"] == "half" and error["error"]["code"] == "invalid_request"
    assert error["error"]["message"].startswith(f"{src}:1: prompt of ") and "context window" in error["error"]["message"]
