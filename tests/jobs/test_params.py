"""Generation parameters of a job: the reserved names are used or refused with their location,
never carried through; the new fields' checks; OpenAI bodies; the one documented list."""
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from batchgen.jobs.params import ALIASES, CONSTRAINTS, PARAMS, RESERVED, UNSUPPORTED, Constraint
from batchgen.jobs.schema import GenerationDefaults, Job, JobValidationError, Location

LOC = Location("jobs.jsonl", line=3)
DEFAULTS = GenerationDefaults()


def make(row: dict[str, Any], defaults: GenerationDefaults = DEFAULTS) -> list[Job]:
    return Job.from_record(row, LOC, defaults, 0)


def error_of(row: dict[str, Any]) -> str:
    with pytest.raises(JobValidationError) as e:
        make(row)
    return str(e.value)


@pytest.mark.parametrize("name, value", [("suffix", "x"), ("lora", "adapter-a"),
                                         ("tools", [{"type": "function"}]), ("min_p", 0.1), ("best_of", 4),
                                         ("use_beam_search", True), ("guided_grammar", "root ::= x"),
                                         ("stream", True), ("num_beams", 4)])
def test_an_unsupported_generation_parameter_is_refused_with_its_location(name, value):
    message = error_of({"prompt": "x", name: value})
    assert message.startswith(f"jobs.jsonl:3: field '{name}' is a generation parameter batchgen does not "
                              f"support ({UNSUPPORTED[name]}); remove it")


def test_values_that_ask_for_nothing_new_and_nulls_are_accepted_and_not_carried():
    (job,) = make({"prompt": "x", "stream": False, "best_of": 1, "skip_special_tokens": True,
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
    ({"logit_bias": {"a": 1}}, "field 'logit_bias.a' must be a token id (an integer >= 0) in the digits 0-9, "
                               "like \"42\"; got the key 'a'"),
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
    ({"choice": ["yes", "no"], "min_tokens": 5}, "field 'min_tokens' is 5, but 'choice' is set: a choice ends "
                                                 "where its text does, so min_tokens cannot hold back its end"),
    ({"guided_choice": ["a"], "min_new_tokens": 2}, "field 'min_new_tokens' is 2, but 'guided_choice' is set"),
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
    (own,) = Job.from_record({"prompt": "x", "regex": "a+"}, LOC, d, 0)
    assert own.constraint.kind == "regex" and own.min_tokens == 2  # a job's own constraint replaces the default
    with pytest.raises(JobValidationError, match="defaults: field 'presence_penalty'"):
        GenerationDefaults(presence_penalty=9)
    with pytest.raises(JobValidationError, match="field 'choice' is set, with min_tokens 2 .the default.: a choice"):
        Job.from_record({"prompt": "x", "choice": ["a"]}, LOC, d, 0)
    (own,) = Job.from_record({"prompt": "x", "choice": ["a"], "min_tokens": 0}, LOC, d, 0)
    assert own.constraint.kind == "choice"  # a job's own constraint replaces the default


# --- OpenAI bodies ---------------------------------------------------------------------------

def chat(**body: Any) -> dict[str, Any]:
    return {"custom_id": "r1", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}}


@pytest.mark.parametrize("body, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "field 'body.tools' is a generation parameter "
                                                                    "batchgen does not support"),
    ({"echo": True}, "field 'body.echo' is not a parameter of /v1/chat/completions (only of /v1/completions)"),
    ({"top_logprobs": 2}, "field 'body.top_logprobs' is 2 but logprobs is not true; set logprobs: true"),
    ({"logprobs": 1}, "field 'body.logprobs' must be true or false, got 1 (int)"),
    ({"frobnicate": 1}, "field 'body.frobnicate' is not a parameter batchgen knows for /v1/chat/completions"),
    ({"response_format": {"type": "json_schema"}}, "field 'body.response_format.json_schema' must be an object"),
    ({"presence_penalty": 3}, "field 'body.presence_penalty' must be a number in [-2, 2]"),
])
def test_an_openai_request_batchgen_cannot_honour_is_refused(body, message):
    assert error_of(chat(**body)).startswith(f"jobs.jsonl:3: {message}")


@pytest.mark.parametrize("body, message", [
    ({"temperature": 2.5}, "field 'body.temperature' must be a number in [0, 2] (the Batch API's range), got 2.5"),
    ({"temperature": -0.5}, "field 'body.temperature' must be a number in [0, 2] (the Batch API's range), got -0.5"),
    ({"top_p": 1.5}, "field 'body.top_p' must be a number in [0, 1] (the Batch API's range), got 1.5"),
    ({"n": 129}, "field 'body.n' must be an integer in [1, 128] (the Batch API's range), got 129"),
    ({"n": 0}, "field 'body.n' must be an integer in [1, 128] (the Batch API's range), got 0"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "field 'body.stop' has 5 sequences; the Batch API takes at most 4"),
    ({"frequency_penalty": -3}, "field 'body.frequency_penalty' must be a number in [-2, 2]"),
    ({"logprobs": True, "top_logprobs": 21}, "field 'body.top_logprobs' must be an integer in [0, 20]"),
    ({"model": 4}, "field 'body.model' must be a string, got 4 (int)"),
    ({"user": ["u"]}, "field 'body.user' must be a string, got ['u'] (list)"),
    ({"store": "yes"}, "field 'body.store' must be true or false, got the string 'yes'"),
    ({"metadata": {"k": 1}}, "field 'body.metadata' must be an object of string values, got {'k': 1}"),
])
def test_a_body_outside_the_batch_api_limits_is_refused(body, message):
    """The Batch API's own limits (wider ones are batchgen's own: a plain job may set temperature 2.5)."""
    assert error_of(chat(**body)).startswith(f"jobs.jsonl:3: {message}")
    completions = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 6}}
    assert error_of(completions).startswith("jobs.jsonl:3: field 'body.logprobs' must be an integer in [0, 5]")
    (plain,) = make({"prompt": "x", "temperature": 2.5, "n": 129})
    assert (plain.temperature, plain.n) == (2.5, 129)


@pytest.mark.parametrize("custom_id, got", [(5, "the number 5; write it as a string (\"5\")"), ("", "''"),
                                            (True, "True"), (["a"], "['a']")])
def test_a_custom_id_must_be_a_string(custom_id, got):
    assert error_of({**chat(), "custom_id": custom_id}) == f"jobs.jsonl:3: field 'custom_id' must be a non-empty " \
                                                           f"string, got {got}"


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
    # the elements share the request's id (never an id made from it): prompt_index tells them apart
    assert [(j.id, j.custom_id, j.prompt_index, j.prompt, j.n) for j in jobs] == [
        ("c7", "c7", 0, "one", 2), ("c7", "c7", 1, "two", 2), ("c7", "c7", 2, "three", 2)]
    bad = {**row, "body": {"prompt": ["one", "  "]}}
    assert error_of(bad) == "jobs.jsonl:3: field 'body.prompt[1]' must be a non-empty string, got '  '"


# --- the one documented list, and no crash on any value ------------------------------------------

def test_the_docs_document_every_reserved_name():
    section = (Path(__file__).parents[2] / "docs" / "generation.md").read_text()
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


# --- logprobs, prompt logprobs and scoring jobs ------------------------------------------------

def test_logprob_fields_and_their_openai_spellings():
    (job,) = make({"prompt": "x", "logprobs": True, "top_logprobs": 5, "echo": True})
    assert (job.logprobs, job.top_logprobs, job.prompt_logprobs) == (True, 5, True)
    (job,) = make(chat(logprobs=True, top_logprobs=20))
    assert (job.logprobs, job.top_logprobs, job.prompt_logprobs) == (True, 20, False)
    # /v1/completions: logprobs is the number of alternatives; echo scores the prompt
    (job,) = make({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 3, "echo": True}})
    assert (job.logprobs, job.top_logprobs, job.prompt_logprobs) == (True, 3, True)
    (job,) = make({"prompt": "x", "prompt_logprobs": True, "max_new_tokens": 0})
    assert job.max_new_tokens == 0 and "logprobs" in job.generation() and job.generation()["prompt_logprobs"]
    # a row that turns logprobs off drops the default alternatives with them
    (job,) = make({"prompt": "x", "logprobs": False}, GenerationDefaults(logprobs=True, top_logprobs=4))
    assert (job.logprobs, job.top_logprobs) == (False, 0)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x", "logprobs": "yes"}, "field 'logprobs' must be true or false, got the string 'yes'"),
    ({"prompt": "x", "logprobs": True, "top_logprobs": 21}, "field 'top_logprobs' must be an integer in [0, 20]"),
    ({"prompt": "x", "top_logprobs": 3}, "field 'top_logprobs' is 3 but logprobs is not true"),
    ({"prompt": "x", "echo": 1}, "field 'echo' must be true or false"),
    ({"prompt": "x", "max_new_tokens": 0}, "field 'max_new_tokens' must be a positive integer, got 0"),
    ({"prompt": "x", "max_new_tokens": 0, "prompt_logprobs": True, "n": 2}, "field 'n' is 2 with max_new_tokens 0"),
    ({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 6}},
     "field 'body.logprobs' must be an integer in [0, 5]"),
    ({"prompt": "x", "continuations": []}, "field 'continuations' must be a non-empty list of non-empty strings"),
    ({"prompt": "x", "continuations": [" a", ""]}, "field 'continuations' must be a non-empty list of non-empty"),
    ({"prompt": "x", "continuations": " a"}, "field 'continuations' must be a non-empty list"),
    ({"prompt": "x", "continuations": [" a"], "n": 2}, "field 'n' is a generation parameter, but this job has "
                                                       "continuations: a scoring job generates nothing"),
    ({"prompt": "x", "continuations": [" a"], "logprobs": True}, "field 'logprobs' is a generation parameter, but"),
    ({"prompt": "x", "continuations": [" a"], "guided_json": {}}, "field 'guided_json' is a generation parameter"),
    ({"prompt": "x", "continuations": [" a"], "echo": True}, "field 'echo' is a generation parameter"),
])
def test_bad_logprob_and_scoring_fields_are_refused_with_their_location(row, message):
    assert error_of(row).startswith(f"jobs.jsonl:3: {message}")


def test_a_scoring_job_ignores_the_generation_defaults_and_joins_the_digest():
    defaults = GenerationDefaults(n=3, logprobs=True, top_logprobs=2, constraint=Constraint("regex", "a+"))
    (job,) = make({"prompt": "Q: 2+2? A:", "continuations": [" 4", " 5"], "topic": "math"}, defaults)
    assert job.is_scoring and job.continuations == (" 4", " 5") and job.extra == {"topic": "math"}
    assert (job.n, job.logprobs, job.constraint) == (1, False, None)
    assert job.generation()["continuations"] == [" 4", " 5"]
    with pytest.raises(JobValidationError, match="'top_logprobs' is 3 but logprobs is not true"):
        GenerationDefaults(top_logprobs=3)
