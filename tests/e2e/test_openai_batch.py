"""An OpenAI Batch file mixing valid requests, bad requests, response_format and logprobs: the
output and error files have the Batch API's documented shapes, field by field."""
import json
import re
import time

import jsonschema
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import batchgen
from batchgen.pipeline.cli import main

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
    # the message's tokens (not the special ones its text skips, such as EOS): joined, its content
    assert 0 < len(logprobs["content"]) <= chat_body["usage"]["completion_tokens"]
    assert b"".join(bytes(t["bytes"]) for t in logprobs["content"]) == choice["message"]["content"].encode()
    for t in logprobs["content"]:
        assert set(t) == {"token", "logprob", "bytes", "top_logprobs"} and t["logprob"] <= 0
        assert len(t["top_logprobs"]) == 5
        assert all(set(a) == {"token", "logprob", "bytes"} and all(0 <= b < 256 for b in a["bytes"])
                   for a in t["top_logprobs"])
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


# --- requests are keyed by their line, never by a name made from a custom_id -------------------

def completion(cid, prompt, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "davinci-002", "prompt": prompt, "max_tokens": 3, **body}}


def run_batch(tmp_path, model_dir, requests, fmt="openai"):
    """`process` of these request lines: (input, output lines, error lines, summary)."""
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / ("out.jsonl" if fmt == "openai" else "out.parquet")
    args = ["process", str(src), "-o", str(out), "--model", str(model_dir), "--overwrite"]
    res = CliRunner().invoke(main, args + (["--output-format", "openai"] if fmt == "openai" else []))
    assert res.exit_code == 0, res.output + repr(res.exception)
    summary = json.loads((tmp_path / (out.name + ".summary.json")).read_text())
    if fmt != "openai":
        return src, pq.read_table(out).to_pylist(), summary
    errors = tmp_path / "out.jsonl.errors.jsonl"
    return (src, [json.loads(x) for x in out.read_text().splitlines()],
            [json.loads(x) for x in errors.read_text().splitlines()] if errors.exists() else [], summary)


def test_a_repeated_custom_id_fails_the_repeat_only_and_bodies_outside_the_batch_api_limits_fail(tmp_path,
                                                                                                 model_dir):
    """req-1, req-2, req-1 again, req-3: the first req-1 is answered (it used to be dropped while the
    summary said completed 3), the repeat is an error line. Bodies the Batch API refuses
    (temperature 2.5, n 129, an integer custom_id) are error lines too, and `validate` lists them."""
    requests = [chat("req-1", "One.", max_tokens=3), chat("req-2", "Two.", max_tokens=3),
                chat("req-1", "Again.", max_tokens=3), chat("req-3", "Three.", max_tokens=3),
                chat("hot", "Hot.", max_tokens=3, temperature=2.5), chat("many", "Many.", max_tokens=3, n=129),
                chat(5, "Number.", max_tokens=3)]
    src, lines, errors, summary = run_batch(tmp_path, model_dir, requests)
    assert [x["custom_id"] for x in lines] == ["req-1", "req-2", "req-3"]
    assert [len(x["response"]["body"]["choices"]) for x in lines] == [1, 1, 1]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("req-1", "invalid_request"), ("hot", "invalid_request"), ("many", "invalid_request"), ("5", "invalid_request")]
    messages = [e["error"]["message"] for e in errors]
    assert messages == [
        f"{src}:3: duplicate custom_id 'req-1': an earlier request already uses it; custom_ids must be unique",
        f"{src}:5: field 'body.temperature' must be a number in [0, 2] (the Batch API's range), got 2.5",
        f"{src}:6: field 'body.n' must be an integer in [1, 128] (the Batch API's range), got 129",
        f"{src}:7: field 'custom_id' must be a non-empty string, got the number 5; write it as a string (\"5\")"]
    assert (summary["jobs"], summary["completed"], summary["failed"]) == (7, 3, 4)
    res = CliRunner().invoke(main, ["validate", str(src), "--model", str(model_dir)])
    assert res.exit_code == 1 and all(m in res.output for m in messages)


def test_list_prompt_elements_never_collide_with_a_users_ids(tmp_path, model_dir):
    """A request `a#0`, then a list prompt `a` of two elements: both answered whole (the element used
    to be named `a#0`, which dropped the request `a#0` and half of `a`). A list prompt `c` whose
    second element is too long fails as `c`, and the request `c#1` still runs."""
    requests = [completion("a#0", SYSTEM + "Zero"), completion("a", [SYSTEM + "p one", SYSTEM + "q two"]),
                completion("c", [SYSTEM + "Fine.", "word " * 400]), completion("c#1", SYSTEM + "Fine.")]
    src, lines, errors, summary = run_batch(tmp_path, model_dir, requests)
    assert [(x["custom_id"], len(x["response"]["body"]["choices"])) for x in lines] == [
        ("a#0", 1), ("a", 2), ("c#1", 1)]
    (error,) = errors
    assert error["custom_id"] == "c" and error["error"]["message"].startswith(f"{src}:3: prompt of ")
    # every element is a job: 6, of which the two of `c` failed (one refused, one not in the output)
    assert (summary["jobs"], summary["completed"], summary["failed"]) == (6, 4, 2)

    # Parquet: an element is (id, prompt_index); the request `a#0` has none
    _, rows, _ = run_batch(tmp_path, model_dir, requests, fmt="parquet")
    assert [(r["id"], r["prompt_index"]) for r in rows] == [("a#0", None), ("a", 0), ("a", 1), ("c", 0), ("c#1", None)]

    # the Python API writes the same lines
    out = tmp_path / "api.jsonl"
    results = batchgen.Engine.load(str(model_dir)).generate(str(src), output=str(out), output_format="openai")
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["a#0", "a", "c#1"]
    assert [(r["id"], r["prompt_index"], r["error"] is None) for r in results] == [
        ("a#0", None, True), ("a", 0, True), ("a", 1, True), ("c", 0, True), ("c", None, False), ("c#1", None, True)]


def test_model_echoes_an_openai_requests_body_model_never_a_plain_jobs_column(tmp_path, model_dir):
    """A judge file's `model` column is data: its OpenAI line reports --model. An OpenAI request
    reports its body.model, also beside a carried top-level `model` field."""
    requests = [{"id": "judge-1", "prompt": SYSTEM + "Verdict?", "model": "gpt-4o", "max_new_tokens": 3},
                {**chat("req", "Hi.", max_tokens=3), "model": "a carried field"}]
    _, lines, errors, _ = run_batch(tmp_path, model_dir, requests)
    assert not errors
    assert [x["response"]["body"]["model"] for x in lines] == [str(model_dir), "gpt-4o-mini"]


# --- chat logprobs: the message's tokens, each with its own bytes ------------------------------

@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer (byte-level BPE, SmolLM2's)."""
    import transformers as T

    from batchgen.pipeline.model.load import default_model_path

    tok = T.AutoTokenizer.from_pretrained(default_model_path())
    config = T.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                           bos_token_id=1, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    d = tmp_path_factory.mktemp("smol-tiny")
    T.AutoModelForCausalLM.from_config(config).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_chat_logprobs_list_the_messages_tokens_with_their_own_bytes(tmp_path, smol_dir):
    """"𝔘€" comes in tokens holding parts of a character: their bytes used to be U+FFFD's, and the EOS
    that ends the message was listed. Now the tokens' bytes, joined, are the content, and neither
    EOS nor a token past a stop string is listed."""
    requests = [chat("chars", "Hi.", guided_regex="𝔘€", logprobs=True, top_logprobs=3),
                chat("stop", "Hi.", guided_regex="ab\ncd", stop=["\n"], logprobs=True),
                chat("eos", "Hi.", logit_bias={"2": 100}, logprobs=True)]  # 2: the EOS, <|im_end|>
    _, lines, errors, _ = run_batch(tmp_path, smol_dir, requests)
    assert not errors
    chars, stop, eos = (x["response"]["body"] for x in lines)
    (choice,) = chars["choices"]
    assert choice["message"]["content"] == "𝔘€" and choice["finish_reason"] == "stop"
    content = choice["logprobs"]["content"]
    parts = [bytes(t["bytes"]) for t in content]
    assert b"".join(parts) == "𝔘€".encode()
    assert any(not _utf8(p) for p in parts)  # some token holds part of a character
    assert len(content) == chars["usage"]["completion_tokens"]  # the grammar ended it: no EOS was drawn
    assert all(len(t["top_logprobs"]) == 3 for t in content)
    (choice,) = stop["choices"]
    assert choice["message"]["content"] == "ab" and choice["finish_reason"] == "stop"
    parts = [bytes(t["bytes"]) for t in choice["logprobs"]["content"]]
    # the tokens of "ab": a last one may reach into the stop string, none lies past it
    assert b"".join(parts).startswith(b"ab") and len(b"".join(parts[:-1])) < 2
    assert stop["usage"]["completion_tokens"] > len(parts)
    (choice,) = eos["choices"]  # the EOS came first: an empty message has no tokens
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"] == [] and eos["usage"]["completion_tokens"] == 1


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's decoders): `<0xNN>` byte pieces, `▁` for a space."""
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "a", "b", "▁a", "€"):
        vocab.setdefault(piece, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback", "metaspace"])
def test_token_bytes_join_to_the_decoded_text(kind):
    """What each token adds to the decoded text, as bytes, for the three kinds of decoder: the
    default model's byte-level BPE, SentencePiece byte fallback, and the tests' tiny tokenizer
    (whose word-start marker a token decoded alone loses)."""
    from batchgen.pipeline.model.load import default_model_path
    from batchgen.pipeline.text.tokenize import Tokenizer
    from tests.helpers.tiny_tokenizer import make_tokenizer

    tok = Tokenizer({"byte-level": lambda: Tokenizer.load(str(default_model_path())).hf,
                     "byte-fallback": _byte_fallback_tokenizer, "metaspace": make_tokenizer}[kind]())
    text = "a b 𝔘€ a" if kind != "metaspace" else "the cat in the hat"
    ids = tok.hf(text, add_special_tokens=False)["input_ids"] + [tok.hf.eos_token_id]
    pieces = tok.text_bytes(ids)
    assert pieces[-1] is None  # the EOS adds nothing: the text skips it
    assert b"".join(p for p in pieces if p is not None) == tok.decode(ids).encode()
    if kind != "metaspace":  # 𝔘 is split over tokens: each has its own bytes of it
        assert any(p and not _utf8(p) for p in pieces)
        assert b"".join(tok.token_bytes(ids[:-1])) in (text.encode(), b" " + text.encode())
    assert tok.token_bytes([tok.hf.eos_token_id]) == [tok.hf.eos_token.encode()]
