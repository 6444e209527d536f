"""Row validation: Job.from_row, defaults, OpenAI rows, templates, error messages."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.jobs.schema import (GenerationDefaults, InvalidRow, Job, JobError, JobValidationError,
                         Location, template_fields)

LOC = Location("jobs.jsonl", line=17)
DEFAULTS = GenerationDefaults()


def make(row: dict[str, Any], **kw: Any) -> Job:
    return Job.from_row(row, LOC, kw.pop("defaults", DEFAULTS), kw.pop("default_id", 0), **kw)


def error_of(row: dict[str, Any], **kw: Any) -> JobValidationError:
    with pytest.raises(JobValidationError) as info:
        make(row, **kw)
    return info.value


def test_location_str() -> None:
    assert str(Location("jobs.jsonl", line=17)) == "jobs.jsonl:17"
    assert str(Location("data/jobs.parquet", row=5)) == "data/jobs.parquet:row 5"
    assert str(Location("jobs.parquet", row=0)) == "jobs.parquet:row 0"
    assert str(Location("x")) == "x"


def test_prompt_job_uses_defaults_and_keeps_extra_columns() -> None:
    defaults = GenerationDefaults(max_new_tokens=32, temperature=0.7, stop=["END"], n=2, seed=4)
    job = make({"prompt": "Hello", "subject": "greeting", "score": 3.5, "max_new_tokens": None},
               defaults=defaults, default_id=9)
    assert job.id == 9
    assert job.prompt == "Hello" and job.messages is None and not job.is_chat
    assert (job.max_new_tokens, job.temperature, job.top_p, job.top_k) == (32, 0.7, 1.0, 0)
    # the default seed is the run's: a job without its own derives one from it (preflight.job_seed)
    assert (job.seed, job.stop, job.n) == (None, ("END",), 2)
    assert job.extra == {"subject": "greeting", "score": 3.5}
    assert job.location == LOC
    assert job.openai_endpoint == "/v1/completions"


def test_row_values_override_defaults_and_normalize() -> None:
    job = make({"id": "a-1", "messages": [{"role": "user", "content": "hi"}],
                "max_new_tokens": 8.0, "temperature": 1, "top_p": 0.9, "top_k": 40,
                "seed": 123, "stop": "\n", "n": 3})
    assert job.id == "a-1" and job.is_chat
    assert job.max_new_tokens == 8 and isinstance(job.max_new_tokens, int)
    assert job.temperature == 1.0 and isinstance(job.temperature, float)
    assert (job.top_p, job.top_k, job.seed, job.stop, job.n) == (0.9, 40, 123, ("\n",), 3)
    assert job.openai_endpoint == "/v1/chat/completions"


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x", "max_new_tokens": -3},
     "jobs.jsonl:17: field 'max_new_tokens' must be a positive integer, got -3"),
    ({"prompt": "x", "max_new_tokens": 0},
     "jobs.jsonl:17: field 'max_new_tokens' must be a positive integer, got 0"),
    ({"prompt": "x", "max_new_tokens": "3"},
     "jobs.jsonl:17: field 'max_new_tokens' must be a positive integer, got the string '3'; "
     "write it without quotes"),
    ({"prompt": "x", "max_new_tokens": 1_000_001},
     "jobs.jsonl:17: field 'max_new_tokens' must be a positive integer (at most 1_000_000), got 1000001"),
    ({"prompt": "x", "max_new_tokens": 2.5},
     "jobs.jsonl:17: field 'max_new_tokens' must be a positive integer, got 2.5 (float)"),
    ({"prompt": "x", "n": 0}, "jobs.jsonl:17: field 'n' must be a positive integer, got 0"),
    ({"prompt": "x", "n": 10_001},
     "jobs.jsonl:17: field 'n' must be a positive integer (at most 10_000), got 10001"),
    ({"prompt": "x", "n": True}, "jobs.jsonl:17: field 'n' must be a positive integer, got True (bool)"),
    ({"prompt": "x", "temperature": -0.1},
     "jobs.jsonl:17: field 'temperature' must be a number >= 0, got -0.1"),
    ({"prompt": "x", "temperature": "0.7"},
     "jobs.jsonl:17: field 'temperature' must be a number >= 0, got the string '0.7'; write it without quotes"),
    ({"prompt": "x", "temperature": float("inf")},
     "jobs.jsonl:17: field 'temperature' must be a number >= 0, got inf"),
    ({"prompt": "x", "top_p": 0}, "jobs.jsonl:17: field 'top_p' must be a number in (0, 1] (1 disables it), got 0"),
    ({"prompt": "x", "top_p": 1.5}, "jobs.jsonl:17: field 'top_p' must be a number in (0, 1] (1 disables it), got 1.5"),
    ({"prompt": "x", "top_k": -1},
     "jobs.jsonl:17: field 'top_k' must be an integer >= 0 (0 disables top-k), got -1"),
    ({"prompt": "x", "seed": "7"},
     "jobs.jsonl:17: field 'seed' must be an integer or null, got the string '7'; write it without quotes"),
    ({"prompt": "x", "stop": ["a", ""]}, "jobs.jsonl:17: field 'stop' entry 1 must be a non-empty string, got ''"),
    ({"prompt": "x", "stop": 5}, "jobs.jsonl:17: field 'stop' must be a string or a list of strings, got 5 (int)"),
    ({"prompt": "x", "stop": [str(i) for i in range(17)]},
     "jobs.jsonl:17: field 'stop' has 17 sequences; at most 16 are allowed"),
    ({"prompt": ""}, "jobs.jsonl:17: field 'prompt' must be a non-empty string, got ''"),
    ({"prompt": 12}, "jobs.jsonl:17: field 'prompt' must be a non-empty string, got 12"),
    ({"messages": []}, "jobs.jsonl:17: field 'messages' must be a non-empty list of {role, content} objects, got []"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
     "jobs.jsonl:17: field 'messages[1].role' must be one of assistant, developer, system, tool, user, got 'bot'"),
    ({"messages": [{"role": "user"}]},
     "jobs.jsonl:17: field 'messages[0].content' must be a string or a list of text parts, got None"),
    ({"messages": ["hi"]},
     "jobs.jsonl:17: field 'messages[0]' must be an object with 'role' and 'content', got 'hi'"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
     "jobs.jsonl:17: row has both of 'prompt' and 'messages'; exactly one is required"),
    ({"text": "x"}, "jobs.jsonl:17: row has neither of 'prompt' and 'messages'; exactly one is required"),
    ({"prompt": "x", "id": True}, "jobs.jsonl:17: field 'id' must be a string or an integer, got True (bool)"),
    ({"prompt": "x", "id": [1]}, "jobs.jsonl:17: field 'id' must be a string or an integer, got [1] (list)"),
    ({"prompt": "x", "id": ""},
     "jobs.jsonl:17: field 'id' must not be an empty string; leave it out to use the row number"),
])
def test_validation_messages(row: dict[str, Any], message: str) -> None:
    err = error_of(row)
    assert str(err) == message
    assert err.location == LOC
    assert str(err).startswith(f"{LOC}: ")


def test_error_attributes_and_invalid_row() -> None:
    err = error_of({"id": "q7", "prompt": "x", "max_new_tokens": -3})
    assert (err.field, err.reason, err.job_id) == ("max_new_tokens", "must be a positive integer, got -3", "q7")
    bad = InvalidRow.from_error(err)
    assert bad.to_row() == {"id": "q7", "location": "jobs.jsonl:17",
                            "reason": "field 'max_new_tokens' must be a positive integer, got -3"}
    assert InvalidRow(Location("a.parquet", row=2), 5, "boom").to_row() == \
        {"id": "5", "location": "a.parquet:row 2", "reason": "boom"}
    assert InvalidRow(LOC, None, "malformed JSON").to_row()["id"] is None
    assert isinstance(err, JobError)


def test_integral_float_id_and_none_id() -> None:
    assert make({"prompt": "x", "id": 3.0}).id == 3
    assert make({"prompt": "x", "id": None}, default_id=41).id == 41
    assert make({"prompt": "x", "id": 0}, default_id=41).id == 0


def test_messages_keep_string_fields_drop_nulls_and_join_text_parts() -> None:
    job = make({"messages": [
        {"role": "system", "content": "S", "name": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "alice"},
    ]})
    assert job.messages == [{"role": "system", "content": "S"},
                            {"role": "user", "content": "ab", "name": "alice"}]
    err = error_of({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]})
    assert err.field == "messages[0].content"


def test_defaults_are_validated_and_normalized() -> None:
    with pytest.raises(JobValidationError, match=r"^defaults: field 'top_p' must be a number in \(0, 1\]"):
        GenerationDefaults(top_p=0)
    with pytest.raises(JobError, match="'max_new_tokens'"):
        GenerationDefaults(max_new_tokens=0)
    assert GenerationDefaults(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    assert GenerationDefaults(stop="\n").stop == ("\n",)  # type: ignore[arg-type]


# --- OpenAI batch rows ---------------------------------------------------------------

CHAT_ROW = {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-x", "messages": [{"role": "system", "content": "S"},
                                                    {"role": "user", "content": "U"}],
                     "max_tokens": 50, "temperature": 0.2, "top_p": 0.5, "seed": 1,
                     "stop": ["\n\n"], "n": 2, "logprobs": False}}


def test_openai_chat_row() -> None:
    job = make(CHAT_ROW)
    assert (job.id, job.custom_id, job.endpoint) == ("req-1", "req-1", "/v1/chat/completions")
    assert job.messages == CHAT_ROW["body"]["messages"] and job.prompt is None
    assert (job.max_new_tokens, job.temperature, job.top_p, job.seed, job.stop, job.n) == \
        (50, 0.2, 0.5, 1, ("\n\n",), 2)
    assert job.extra == {"model": "gpt-x"}


def test_openai_completions_row_and_max_completion_tokens() -> None:
    row = {"custom_id": "c", "url": "/v1/completions",
           "body": {"prompt": "Once", "max_completion_tokens": 7, "max_tokens": 99}}
    job = make(row)
    assert (job.prompt, job.messages, job.max_new_tokens, job.endpoint) == \
        ("Once", None, 7, "/v1/completions")
    assert job.openai_endpoint == "/v1/completions"


@pytest.mark.parametrize("row, message", [
    ({**CHAT_ROW, "body": {**CHAT_ROW["body"], "max_tokens": -1}},
     "jobs.jsonl:17: field 'body.max_tokens' must be a positive integer, got -1"),
    ({**CHAT_ROW, "body": {**CHAT_ROW["body"], "max_tokens": None, "max_completion_tokens": 0}},
     "jobs.jsonl:17: field 'body.max_completion_tokens' must be a positive integer, got 0"),
    ({**CHAT_ROW, "url": "/v1/embeddings"},
     "jobs.jsonl:17: field 'url' must be one of /v1/chat/completions, /v1/completions, got '/v1/embeddings'"),
    ({**CHAT_ROW, "method": "GET"}, "jobs.jsonl:17: field 'method' must be 'POST', got 'GET'"),
    ({**CHAT_ROW, "body": {"prompt": "x"}},
     "jobs.jsonl:17: field 'body.messages' is required for /v1/chat/completions"),
    ({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": [1, 2]}},
     "jobs.jsonl:17: field 'body.prompt' must be a string or a non-empty list of strings (token ids "
     "are not supported), got [1, 2]"),
    ({"custom_id": None, "body": {"prompt": "x"}},
     "jobs.jsonl:17: field 'custom_id' must be a non-empty string, got null"),
    ({"custom_id": "c", "body": "text"}, "jobs.jsonl:17: field 'body' must be an object, got 'text'"),
])
def test_openai_validation_messages(row: dict[str, Any], message: str) -> None:
    assert str(error_of(row)) == message


# --- template and system ---------------------------------------------------------------

def test_template_fills_prompt_and_keeps_columns() -> None:
    job = make({"text": "Great kettle", "label": "pos"}, prompt_template="Review: {text} ({label})")
    assert job.prompt == "Review: Great kettle (pos)"
    assert job.extra == {"text": "Great kettle", "label": "pos"}


def test_template_can_read_prompt_column_and_keeps_original() -> None:
    job = make({"prompt": "2+2"}, prompt_template="Q: {prompt}\nA:")
    assert job.prompt == "Q: 2+2\nA:" and job.extra == {"prompt": "2+2"}


def test_template_errors() -> None:
    err = error_of({"body_text": "x"}, prompt_template="Summarize: {text}")
    assert str(err) == ("jobs.jsonl:17: prompt template needs column 'text', which this row "
                        "does not have (columns: body_text)")
    err = error_of({"text": None}, prompt_template="Summarize: {text}")
    assert str(err) == "jobs.jsonl:17: field 'text' is null but the prompt template uses it"
    with pytest.raises(JobError, match="positional field"):
        template_fields("Summarize: {}")
    with pytest.raises(JobError, match="invalid prompt template"):
        template_fields("Summarize: {text")
    assert template_fields("{a.b} {c[0]} {{literal}} {a}") == ["a", "c", "a"]
    # a position is what str.format takes as one: decimal digits ("٣" is one, "²" is a name)
    assert template_fields("{²}") == ["²"] and "{²}".format(**{"²": "x"}) == "x"
    with pytest.raises(JobError, match="positional field"):
        template_fields("{٣}")
    with pytest.raises(JobError, match="is empty"):
        template_fields("  ")


def test_system_wraps_prompt_and_prepends_to_messages() -> None:
    job = make({"prompt": "Hi"}, system="Be brief.")
    assert job.prompt is None
    assert job.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    job = make({"messages": [{"role": "user", "content": "Hi"}]}, system="Be brief.")
    assert job.messages[0] == {"role": "system", "content": "Be brief."} and len(job.messages) == 2
    # The row's own system message is more specific than the command-line default.
    job = make({"messages": [{"role": "system", "content": "Mine"}, {"role": "user", "content": "Hi"}]},
               system="Be brief.")
    assert [m["content"] for m in job.messages] == ["Mine", "Hi"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
keys = st.sampled_from(["id", "prompt", "messages", "max_new_tokens", "temperature", "top_p",
                        "top_k", "seed", "stop", "n", "custom_id", "body", "url", "other"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, json_values, max_size=6))
def test_arbitrary_rows_either_validate_or_raise_validation_error(row: dict[str, Any]) -> None:
    # Whatever JSON a user feeds in, the only failure mode is a located JobValidationError.
    try:
        job = make(row)
    except JobValidationError as e:
        assert str(e).startswith("jobs.jsonl:17: ")
        return
    assert (job.prompt is None) != (job.messages is None)
    assert job.max_new_tokens >= 1 and job.n >= 1 and 0 < job.top_p <= 1
