"""A job's generation parameters: the one list of reserved names, and the checks of their values.

Every name in ``RESERVED`` means a generation parameter to someone (batchgen, OpenAI, vLLM or
transformers). A row field with one of these names is either used (``PARAMS``, ``CONSTRAINTS``
and their ``ALIASES``) or refused with its location (``UNSUPPORTED``): it is never carried through
as a plain column, so a job never silently runs without a parameter it asked for. A value that
asks for what batchgen does anyway (``stream: false``, ``best_of: 1``, see
``INERT``) is accepted, and null means "not set". Every other field is carried through.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from collections.abc import Mapping  # isinstance is faster than with typing's alias (a check per row)
from typing import Any

from .checks import TOO_DEEP, Checker, bad_type, show, too_deep

MAX_NEW_TOKENS_LIMIT = 1_000_000
MAX_N = 10_000
# torch.Generator.manual_seed's range; outside it the engine would fail without naming the row.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_TOKEN_ID = 2**31 - 1  # the model's vocabulary is checked once the tokenizer is known (preflight)


@dataclass(frozen=True)
class Constraint:
    """What a job's output must match (pipeline/text/grammar.py compiles it)."""

    kind: str  # "json_schema", "json_object", "regex" or "choice"
    spec: str  # the schema as JSON text, the regular expression, the choices as a JSON list; "" for json_object
    source: str = field(default="", compare=False)  # the field that set it, for error messages


# batchgen's names, each a job field and a CLI default (--max-new-tokens, --repetition-penalty, ...)
PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "min_tokens", "logit_bias", "stop_token_ids", "logprobs",
          "top_logprobs", "prompt_logprobs")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
# at most one per job: the output must be JSON of a schema, match a regex, or be one of the choices
CONSTRAINTS = ("json_schema", "regex", "choice", "response_format")
# other spellings of the same parameters: OpenAI's, vLLM's and transformers'
ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
           "min_new_tokens": "min_tokens", "guided_json": "json_schema", "guided_regex": "regex",
           "guided_choice": "choice", "echo": "prompt_logprobs"}
_TOOLS = "batchgen does not call tools or functions"
_GRAMMAR = "use json_schema, regex or choice"
UNSUPPORTED: dict[str, str] = {
    # OpenAI
    "suffix": "batchgen does not insert text", "best_of": "use n (batchgen returns every sample)",
    "stream": "a batch is not streamed", "stream_options": "a batch is not streamed",
    "tools": _TOOLS, "tool_choice": _TOOLS, "parallel_tool_calls": _TOOLS, "functions": _TOOLS,
    "function_call": _TOOLS, "modalities": "batchgen generates text only", "audio": "batchgen generates text only",
    "prediction": "batchgen has no predicted outputs", "reasoning_effort": "not a parameter of these models",
    "web_search_options": "batchgen does not search", "verbosity": "not a parameter of these models",
    # vLLM
    "min_p": "not supported yet", "typical_p": "not supported", "use_beam_search": "batchgen samples, no beams",
    "length_penalty": "batchgen samples, no beams", "early_stopping": "batchgen samples, no beams",
    "ignore_eos": "not supported", "include_stop_str_in_output": "stop strings are always cut",
    "skip_special_tokens": "special tokens are always skipped", "spaces_between_special_tokens": "not supported",
    "truncate_prompt_tokens": "prompts are never truncated",
    "bad_words": "use logit_bias", "allowed_token_ids": "use logit_bias", "logits_processors": "not supported",
    "guided_grammar": _GRAMMAR, "guided_decoding_backend": "batchgen uses llguidance",
    "guided_whitespace_pattern": "JSON is compact", "structured_outputs": _GRAMMAR,
    "guided_json_object": 'use response_format {"type": "json_object"}',
    "lora_request": "use the field adapter", "lora": "use the field adapter", "lora_name": "use the field adapter",
    "priority": "batchgen orders by shared prefix", "detokenize": "not supported",
    # transformers
    "do_sample": "temperature 0 is greedy, above 0 samples", "num_beams": "batchgen samples, no beams",
    "num_return_sequences": "use n", "max_length": "use max_new_tokens", "min_length": "use min_tokens",
    "no_repeat_ngram_size": "not supported", "sequence_bias": "use logit_bias", "bad_words_ids": "use logit_bias",
    "epsilon_cutoff": "not supported", "eta_cutoff": "not supported", "top_a": "not supported",
}
# values of unsupported names that ask for nothing batchgen does not do anyway
INERT: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "stream": (False,),
    "tools": ([],), "tool_choice": ("none",), "modalities": (["text"],), "use_beam_search": (False,),
    "ignore_eos": (False,), "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "min_p": (0,), "typical_p": (1,), "num_beams": (1,), "num_return_sequences": (1,),
}
RESERVED = frozenset(PARAMS) | frozenset(CONSTRAINTS) | frozenset(ALIASES) | frozenset(UNSUPPORTED)


def split_fields(check: Checker, row: Mapping[str, Any], keys: Mapping[str, Any] | None = None,
                 prefix: str = "", unknown: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The generation parameters a row sets (batchgen's names; null ones left out), and the name
    each was spelled with. Refuses unsupported names with their location. ``keys`` are the row's
    fields to look at (default: all of them); with ``unknown`` set, a name outside RESERVED is
    refused too, with that reason (an OpenAI body has no free-form fields)."""
    params: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key in (row if keys is None else keys):
        value = row[key]
        name = ALIASES.get(key, key)
        if name in PARAMS or name in CONSTRAINTS:
            if value is None:
                continue
            if name in params:
                raise check.fail(prefix + key, f"sets {name} again (as '{spelled[name]}'); give it once")
            params[name], spelled[name] = value, prefix + key
        elif key in UNSUPPORTED:
            if value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                    for v in INERT.get(key, ())):
                continue
            raise check.fail(prefix + key, f"is a generation parameter batchgen does not support "
                                           f"({UNSUPPORTED[key]}); remove it")
        elif unknown is not None:
            raise check.fail(prefix + key, unknown)
    return params, spelled


def normalize(check: Checker, values: Mapping[str, Any]) -> dict[str, Any]:
    """Checked values of every name in PARAMS (``values`` holds all of them, defaults filled in)."""
    out = {
        "max_new_tokens": check.integer("max_new_tokens", values["max_new_tokens"], low=0,
                                        high=MAX_NEW_TOKENS_LIMIT, what="a positive integer"),
        "temperature": check.number("temperature", values["temperature"], "a number >= 0", lambda t: t >= 0),
        "top_p": check.number("top_p", values["top_p"], "a number in (0, 1] (1 disables it)",
                              lambda p: 0 < p <= 1),
        "top_k": check.integer("top_k", values["top_k"], low=0, high=2**31 - 1,
                               what="an integer >= 0 (0 disables top-k)"),
        "seed": None if values["seed"] is None else check.integer(
            "seed", values["seed"], low=SEED_MIN, high=SEED_MAX, what="an integer or null"),
        "stop": check.stop(values["stop"]),
        "n": check.integer("n", values["n"], low=1, high=MAX_N, what="a positive integer"),
        "repetition_penalty": check.number("repetition_penalty", values["repetition_penalty"],
                                           "a number > 0 (1 disables it)", lambda p: p > 0),
        "presence_penalty": check.number("presence_penalty", values["presence_penalty"],
                                         "a number in [-2, 2] (0 disables it)", lambda p: -2 <= p <= 2),
        "frequency_penalty": check.number("frequency_penalty", values["frequency_penalty"],
                                          "a number in [-2, 2] (0 disables it)", lambda p: -2 <= p <= 2),
        "min_tokens": check.integer("min_tokens", values["min_tokens"], low=0, high=MAX_NEW_TOKENS_LIMIT,
                                    what="an integer >= 0"),
        "logit_bias": logit_bias(check, values["logit_bias"]),
        "stop_token_ids": token_ids(check, "stop_token_ids", values["stop_token_ids"]),
        "logprobs": check.boolean("logprobs", values["logprobs"]),
        "top_logprobs": check.integer("top_logprobs", values["top_logprobs"], low=0, high=MAX_TOP_LOGPROBS,
                                      what=f"an integer in [0, {MAX_TOP_LOGPROBS}]"),
        "prompt_logprobs": check.boolean("prompt_logprobs", values["prompt_logprobs"]),
    }
    if out["top_logprobs"] and not out["logprobs"]:
        raise check.fail("top_logprobs", f"is {out['top_logprobs']} but logprobs is not true; set logprobs: true "
                                         "(top_logprobs adds alternatives to each token's logprob)")
    if out["max_new_tokens"] == 0 and not out["prompt_logprobs"]:
        # 0 (score the prompt, generate nothing) is for prompt_logprobs jobs only
        raise check.fail("max_new_tokens", "must be a positive integer, got 0")
    if out["max_new_tokens"] == 0 and out["n"] > 1:
        raise check.fail("n", f"is {out['n']} with max_new_tokens 0: there is nothing to sample; remove n")
    if out["min_tokens"] > out["max_new_tokens"]:
        raise check.fail("min_tokens", f"is {out['min_tokens']}, more than max_new_tokens "
                                       f"({out['max_new_tokens']})")
    return out


def _json_value(check: Checker, name: str, value: Any) -> Any:
    """Parquet and CSV-born columns hold nested values as JSON text: read it."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise check.fail(name, f"is a string that is not valid JSON ({e.args[0][:60]})") from None
    except RecursionError:
        raise check.fail(name, f"holds JSON text that {TOO_DEEP}") from None
    if too_deep(parsed):  # what a row's own values may not be (schema._check_depth), nor may its JSON text
        raise check.fail(name, f"holds JSON text that {TOO_DEEP}")
    return parsed


def logit_bias(check: Checker, value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's shape, {"token id": bias in [-100, 100]}, as sorted (id, bias) pairs. Parquet map
    columns arrive as lists of (key, value) pairs."""
    value = _json_value(check, "logit_bias", value)
    items = value.items() if isinstance(value, Mapping) else value
    if not isinstance(items, (list, tuple)) and not isinstance(value, Mapping):
        raise check.fail("logit_bias", bad_type(value, 'an object mapping token ids to biases, {"42": -100}'))
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise check.fail("logit_bias", f"must map token ids to biases, got the entry {show(item)}")
        key, bias = item
        where = f"logit_bias.{key}"
        tid = check.integer(where, _token_key(check, where, key), low=0, high=MAX_TOKEN_ID,
                            what="a token id (an integer >= 0)")
        out[tid] = check.number(where, bias, "a bias in [-100, 100]", lambda b: -100 <= b <= 100)
    return tuple(sorted(out.items()))


def _token_key(check: Checker, where: str, key: Any) -> Any:
    """A logit_bias key as a token id: JSON object keys are always strings, so "42" is one; a key
    of another type (a Parquet map's integer keys) is checked as it is."""
    if not isinstance(key, str):
        return key
    digits = key.strip()
    # ASCII digits only: isdigit() also says yes to "²" and "٣", which are no token ids
    if digits.isascii() and digits.isdigit():
        return int(digits)
    raise check.fail(where, f"must be a token id (an integer >= 0) in the digits 0-9, like \"42\"; got the key "
                            f"{show(key)}")


def token_ids(check: Checker, name: str, value: Any) -> tuple[int, ...]:
    value = _json_value(check, name, value)
    if not isinstance(value, (list, tuple)):
        raise check.fail(name, bad_type(value, "a list of token ids"))
    return tuple(check.integer(f"{name}[{i}]", v, low=0, high=MAX_TOKEN_ID, what="a token id (an integer >= 0)")
                 for i, v in enumerate(value))


def constraint(check: Checker, params: Mapping[str, Any], spelled: Mapping[str, str]) -> Constraint | None:
    """The one constraint a row sets (None if none); ``params`` as split_fields returns them."""
    given = [name for name in CONSTRAINTS if params.get(name) is not None]
    if len(given) > 1:
        a, b = (spelled.get(n, n) for n in given[:2])
        raise check.fail(b, f"and '{a}' are both set; a job takes one constraint")
    if not given:
        return None
    name = given[0]
    where, value = spelled.get(name, name), params[name]
    if name == "json_schema":
        return _schema(check, where, value)
    if name == "regex":
        if not isinstance(value, str) or not value:
            raise check.fail(where, bad_type(value, "a non-empty regular expression"))
        return Constraint("regex", value, where)
    if name == "choice":
        value = _json_value(check, where, value) if isinstance(value, str) and value.startswith("[") else value
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise check.fail(where, f"must be a non-empty list of non-empty strings, got {show(value)}")
        return Constraint("choice", json.dumps(list(value), ensure_ascii=False), where)
    return _response_format(check, where, _json_value(check, where, value))


def choice_min_tokens(check: Checker, rule: Constraint | None, min_tokens: int, spelled: Mapping[str, str]) -> None:
    """A choice ends where its text does, so min_tokens (which holds back the end) cannot apply to it.
    (A schema or regex can allow more text: there min_tokens holds back EOS, and a text that is
    complete before min_tokens fails its row, see pipeline/engine/sampling.py.)"""
    if rule is None or rule.kind != "choice" or not min_tokens:
        return
    choice = rule.source or "choice"
    why = "a choice ends where its text does, so min_tokens cannot hold back its end; remove one of them"
    if "min_tokens" in spelled:
        raise check.fail(spelled["min_tokens"], f"is {min_tokens}, but '{choice}' is set: {why}")
    raise check.fail(choice, f"is set, with min_tokens {min_tokens} (the default): {why}")


def _schema(check: Checker, where: str, value: Any) -> Constraint:
    value = _json_value(check, where, value)
    if not isinstance(value, Mapping):
        raise check.fail(where, bad_type(value, "a JSON Schema object"))
    # key order is kept: it is the order in which the model writes the properties
    return Constraint("json_schema", json.dumps(value, ensure_ascii=False, separators=(",", ":")), where)


def _response_format(check: Checker, where: str, value: Any) -> Constraint | None:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""
    if not isinstance(value, Mapping):
        raise check.fail(where, bad_type(value, 'an object such as {"type": "json_object"}'))
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", where)
    if kind != "json_schema":
        raise check.fail(f"{where}.type", f"must be 'text', 'json_object' or 'json_schema', got {show(kind)}")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or spec.get("schema") is None:
        raise check.fail(f"{where}.json_schema", f"must be an object with a 'schema', got {show(spec)}")
    return _schema(check, f"{where}.json_schema.schema", spec["schema"])


# Fields a scoring job (one with continuations) must not set: it generates nothing, and scores
# under the model's raw distribution, so a sampling or output parameter would be silently ignored.
_NOT_FOR_SCORING = PARAMS + CONSTRAINTS


def continuations_field(check: Checker, value: Any, params: Mapping[str, Any],
                   spelled: Mapping[str, str]) -> tuple[str, ...] | None:
    """A scoring job's continuations (None: a generating job). Refuses generation parameters
    beside them: nothing is generated, so they could only be ignored."""
    if value is None:
        return None
    if isinstance(value, str) and value.startswith("["):  # Parquet/CSV-born JSON text
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            pass  # refused below, as the string it is
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
        raise check.fail("continuations", f"must be a non-empty list of non-empty strings, got {show(value)}")
    given = [spelled.get(n, n) for n in _NOT_FOR_SCORING if params.get(n) is not None]
    if given:
        raise check.fail(given[0], "is a generation parameter, but this job has continuations: a scoring job "
                                   "generates nothing; remove it, or make a separate job that generates")
    return tuple(value)


def completions_logprobs(check: Checker, params: dict[str, Any], spelled: dict[str, str]) -> None:
    """/v1/completions spells logprobs as an integer, the number of alternatives (0 to 5), where
    chat has logprobs: true and top_logprobs: k."""
    value = params.get("logprobs")
    if value is None or isinstance(value, bool):
        return
    where = spelled["logprobs"]
    k = check.integer(where, value, low=0, high=5, what="an integer in [0, 5] (the alternatives per token)")
    if params.get("top_logprobs") is not None:
        raise check.fail(spelled["top_logprobs"], "is not a parameter of /v1/completions: its logprobs "
                                                  "gives the number of alternatives; remove it")
    params["logprobs"], params["top_logprobs"] = True, k
    spelled["top_logprobs"] = where
