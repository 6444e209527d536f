"""Generation parameters of a job: the reserved names are used or refused with their location,
never carried through; the new fields' checks; OpenAI bodies; the one documented list."""
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from jobs.params import ALIASES, CONSTRAINTS, PARAMS, RESERVED, UNSUPPORTED, Constraint
from jobs.schema import GenerationDefaults, Job, JobValidationError, Location

LOC = Location("jobs.jsonl", line=3)
DEFAULTS = GenerationDefaults()


def make(row: dict[str, Any]) -> list[Job]:
    return Job.from_record(row, LOC, DEFAULTS, 0)


def error_of(row: dict[str, Any]) -> str:
    with pytest.raises(JobValidationError) as e:
        make(row)
    return str(e.value)


@pytest.mark.parametrize("name, value", [("logprobs", True), ("top_logprobs", 3), ("lora", "adapter-a"),
                                         ("tools", [{"type": "function"}]), ("min_p", 0.1), ("best_of", 4),
                                         ("use_beam_search", True), ("guided_grammar", "root ::= x"),
                                         ("stream", True), ("num_beams", 4)])
def test_an_unsupported_generation_parameter_is_refused_with_its_location(name, value):
    message = error_of({"prompt": "x", name: value})
    assert message.startswith(f"jobs.jsonl:3: field '{name}' is a generation parameter batchgen does not "
                              f"support ({UNSUPPORTED[name]}); remove it")


def test_values_that_ask_for_nothing_new_and_nulls_are_accepted_and_not_carried():
    (job,) = make({"prompt": "x", "logprobs": False, "stream": False, "best_of": 1, "skip_special_tokens": True,
                   "min_p": 0.0, "lora": None, "tools": [], "topic": "kept"})
    assert job.extra == {"topic": "kept"}


def test_every_other_column_is_carried_through():
    (job,) = make({"prompt": "x", "user": "u1", "meta": {"a": 1}, "lang": "en"})
    assert job.extra == {"user": "u1", "meta": {"a": 1}, "lang": "en"}


def test_new_fields_and_aliases():
    (job,) = make({"prompt": "x", "max_tokens": 20, "min_new_tokens": 3, "repetition_penalty": 1.2,
                   "presence_penalty": -0.5, "frequency_penalty": 2, "logit_bias": {"7": -100, "3": 2.5},
                   "stop_token_ids": [5, 9], "guided_json": {"type": "object"}})
    assert (job.max_new_tokens, job.min_tokens, job.repetition_penalty, job.presence_penalty,
            job.frequency_penalty) == (20, 3, 1.2, -0.5, 2.0)
    assert job.logit_bias == ((3, 2.5), (7, -100.0)) and job.stop_token_ids == (5, 9)
    assert job.constraint == Constraint("json_schema", '{"type":"object"}') and job.extra == {}
    # nested values from Parquet or CSV-born columns arrive as JSON text, map columns as pairs
    (job,) = make({"prompt": "x", "logit_bias": '{"4": 1}', "stop_token_ids": "[2]", "choice": '["a", "b"]'})
    assert job.logit_bias == ((4, 1.0),) and job.stop_token_ids == (2,)
    assert job.constraint == Constraint("choice", '["a", "b"]')
    assert make({"prompt": "x", "logit_bias": [("4", 1)]})[0].logit_bias == ((4, 1.0),)


@pytest.mark.parametrize("extra, message", [
    ({"repetition_penalty": 0}, "field 'repetition_penalty' must be a number > 0 (1 disables it), got 0"),
    ({"presence_penalty": 2.5}, "field 'presence_penalty' must be a number in [-2, 2] (0 disables it), got 2.5"),
    ({"frequency_penalty": "1"}, "field 'frequency_penalty' must be a number in [-2, 2] (0 disables it), got the "
                                 "string '1'; write it without quotes"),
    ({"min_tokens": 9, "max_new_tokens": 4}, "field 'min_tokens' is 9, more than max_new_tokens (4)"),
    ({"logit_bias": {"a": 1}}, "field 'logit_bias.a' must be a token id (an integer >= 0), got the string 'a'"),
    ({"logit_bias": {"5": 101}}, "field 'logit_bias.5' must be a bias in [-100, 100], got 101"),
    ({"logit_bias": [1, 2]}, "field 'logit_bias' must map token ids to biases, got the entry 1"),
    ({"stop_token_ids": [1, -2]}, "field 'stop_token_ids[1]' must be a token id (an integer >= 0), got -2"),
    ({"max_tokens": 5, "max_new_tokens": 6}, "field 'max_new_tokens' sets max_new_tokens again (as 'max_tokens')"),
    ({"regex": "a", "guided_choice": ["a"]}, "field 'guided_choice' and 'regex' are both set; a job takes one"),
    ({"json_schema": [1]}, "field 'json_schema' must be a JSON Schema object, got [1] (list)"),
    ({"json_schema": "{oops"}, "field 'json_schema' is a string that is not valid JSON"),
    ({"choice": []}, "field 'choice' must be a non-empty list of non-empty strings, got []"),
    ({"regex": ""}, "field 'regex' must be a non-empty regular expression"),
    ({"response_format": {"type": "yaml"}}, "field 'response_format.type' must be 'text', 'json_object' or "
                                            "'json_schema', got 'yaml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "field 'response_format.json_schema' must be an object with a 'schema'"),
    ({"guided_json": 3}, "field 'guided_json' must be a JSON Schema object, got 3 (int)"),
    ({"max_tokens": 0}, "field 'max_tokens' must be a positive integer, got 0"),
])
def test_new_field_errors_name_the_field_as_written(extra, message):
    assert error_of({"prompt": "x", **extra}).startswith(f"jobs.jsonl:3: {message}")


@pytest.mark.parametrize("value, kind, spec", [
    ({"type": "text"}, None, None),
    ({"type": "json_object"}, "json_object", ""),
    ({"type": "json_schema", "json_schema": {"name": "r", "strict": True, "schema": {"type": "integer"}}},
     "json_schema", '{"type":"integer"}'),
])
def test_response_format(value, kind, spec):
    (job,) = make({"prompt": "x", "response_format": value})
    assert (job.constraint and (job.constraint.kind, job.constraint.spec)) == (kind and (kind, spec))


def test_defaults_give_every_new_field_and_a_constraint():
    rule = GenerationDefaults.constraint_of(regex="[ab]+")
    d = GenerationDefaults(repetition_penalty=1.1, logit_bias='{"3": -1}', min_tokens=2, constraint=rule)
    (job,) = Job.from_record({"prompt": "x"}, LOC, d, 0)
    assert (job.repetition_penalty, job.logit_bias, job.min_tokens, job.constraint) == (1.1, ((3, -1.0),), 2, rule)
    (own,) = Job.from_record({"prompt": "x", "choice": ["a"]}, LOC, d, 0)
    assert own.constraint.kind == "choice"  # a job's own constraint replaces the default
    with pytest.raises(JobValidationError, match="defaults: field 'presence_penalty'"):
        GenerationDefaults(presence_penalty=9)


# --- OpenAI bodies ---------------------------------------------------------------------------

def chat(**body: Any) -> dict[str, Any]:
    return {"custom_id": "r1", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}}


@pytest.mark.parametrize("body, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "field 'body.tools' is a generation parameter "
                                                                    "batchgen does not support"),
    ({"echo": True}, "field 'body.echo' is a generation parameter batchgen does not support"),
    ({"logprobs": True, "top_logprobs": 2}, "field 'body.logprobs' is a generation parameter"),
    ({"frobnicate": 1}, "field 'body.frobnicate' is not a parameter batchgen knows for /v1/chat/completions"),
    ({"response_format": {"type": "json_schema"}}, "field 'body.response_format.json_schema' must be an object"),
    ({"presence_penalty": 3}, "field 'body.presence_penalty' must be a number in [-2, 2]"),
])
def test_an_openai_request_batchgen_cannot_honour_is_refused(body, message):
    assert error_of(chat(**body)).startswith(f"jobs.jsonl:3: {message}")


def test_openai_request_fields_are_honoured():
    (job,) = make(chat(max_completion_tokens=9, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"3": 1},
                       response_format={"type": "json_object"}, user="u", metadata={"k": "v"}, store=False,
                       logprobs=False, stream=False, top_k=5, repetition_penalty=1.1, min_tokens=2))
    assert (job.max_new_tokens, job.presence_penalty, job.frequency_penalty, job.logit_bias, job.top_k,
            job.repetition_penalty, job.min_tokens) == (9, 0.5, 0.25, ((3, 1.0),), 5, 1.1, 2)
    assert job.constraint == Constraint("json_object", "") and job.extra == {"model": "m"}


def test_an_openai_list_prompt_is_one_job_per_element_and_fails_whole():
    row = {"custom_id": "c7", "url": "/v1/completions", "body": {"prompt": ["one", "two", "three"], "n": 2}}
    jobs = make(row)
    assert [(j.id, j.custom_id, j.prompt_index, j.prompt, j.n) for j in jobs] == [
        ("c7#0", "c7", 0, "one", 2), ("c7#1", "c7", 1, "two", 2), ("c7#2", "c7", 2, "three", 2)]
    bad = {**row, "body": {"prompt": ["one", "  "]}}
    assert error_of(bad) == "jobs.jsonl:3: field 'body.prompt[1]' must be a non-empty string, got '  '"


# --- the one documented list, and no crash on any value ------------------------------------------

def test_the_readme_documents_every_reserved_name():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Generation parameters", 1)[1].split("\n## ", 1)[0]
    missing = sorted(n for n in RESERVED if not re.search(rf"`{re.escape(n)}`", section))
    assert missing == []


_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=True) |
                       st.text(max_size=6), lambda inner: st.lists(inner, max_size=3) |
                       st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(PARAMS + CONSTRAINTS + tuple(ALIASES))), _values, max_size=4))
def test_any_value_of_any_parameter_is_a_job_or_a_located_error(fields):
    try:
        jobs = make({"prompt": "x", **fields})
    except JobValidationError as e:
        assert str(e).startswith("jobs.jsonl:3: ")
    else:
        assert len(jobs) == 1 and jobs[0].extra == {}
        json.dumps(jobs[0].generation())  # what the resume fingerprint records
