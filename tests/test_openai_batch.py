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
    chat("logprobs", "Hello.", logprobs=True, top_logprobs=2),  # cannot be honoured: an error line
    chat("tools", "Weather?", tools=[{"type": "function", "function": {"name": "weather"}}]),
    chat("echo", "Hi.", echo=True),  # not a chat parameter
    chat("bad-tokens", "Hi.", max_tokens=-5),
    {"custom_id": "list", "method": "POST", "url": "/v1/completions",
     "body": {"model": "davinci-002", "prompt": [SYSTEM + "One", SYSTEM + "Two"], "max_tokens": 4, "n": 2}},
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
    assert [x["custom_id"] for x in lines] == ["plain", "schema", "object", "quiet-logprobs", "list"]
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert re.fullmatch(r"batch_req_[0-9a-f]{24}", line["id"])
        response = line["response"]
        assert set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 200
        assert re.fullmatch(r"req_[0-9a-f]{24}", response["request_id"])
        body = response["body"]
        chat_kind = line["custom_id"] != "list"
        assert set(body) == {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
        assert body["object"] == ("chat.completion" if chat_kind else "text_completion")
        assert body["id"].startswith("chatcmpl-" if chat_kind else "cmpl-")
        assert started <= body["created"] <= time.time() + 1
        assert body["model"] == ("gpt-4o-mini" if chat_kind else "davinci-002")  # body.model, echoed
        assert body["system_fingerprint"] == f"batchgen-0.1.0:{model_dir}:float32"
        for i, choice in enumerate(body["choices"]):
            assert choice["index"] == i and choice["logprobs"] is None
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
    ids = [x["id"] for x in lines] + [x["response"]["request_id"] for x in lines] + [b["id"] for b in by_id.values()]
    assert len(set(ids)) == len(ids)

    assert not (tmp_path / "out.jsonl.errors.parquet").exists()  # OpenAI output has error lines instead
    errors = [json.loads(x) for x in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["logprobs", "tools", "echo", "bad-tokens", None]
    for e in errors:
        assert set(e) == {"id", "custom_id", "response", "error"} and e["response"] is None
        assert re.fullmatch(r"batch_req_[0-9a-f]{24}", e["id"])
        assert set(e["error"]) == {"code", "message"} and e["error"]["code"] == "invalid_request"
    messages = [e["error"]["message"] for e in errors]
    assert messages[0].startswith(f"{src}:5: field 'body.logprobs' is a generation parameter batchgen does not "
                                  "support")
    assert messages[1].startswith(f"{src}:6: field 'body.tools'")
    assert messages[2].startswith(f"{src}:7: field 'body.echo'")
    assert messages[3] == f"{src}:8: field 'body.max_tokens' must be a positive integer, got -5"
    assert messages[4].startswith(f"{src}:10: malformed JSON")

    # a second run: every id is new
    res = CliRunner().invoke(main, args + ["--overwrite"])
    assert res.exit_code == 0
    again = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert not set(again) & set(ids)
