"""Job records: validation of one input row into a typed :class:`Job`.

Readers hand raw ``dict`` rows to :meth:`Job.from_row`; everything past that
point works on dataclasses. Validation errors name the input location and the
field so that a user with a million-line file can find and fix the bad row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from .errors import JobError, JobValidationError, Location
from .templates import TemplateRowError, fill_template, template_fields
from .text import bad_text_at, encodes

MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
OPENAI_ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)

MAX_NEW_TOKENS_LIMIT = 1_000_000
MAX_N = 10_000
MAX_STOP_SEQUENCES = 16
# torch.Generator.manual_seed's range; outside it the engine would fail without naming the row.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1

# Keys that Job.from_row consumes; every other key of a row goes to `extra`.
JOB_KEYS = ("id", "prompt", "messages", "max_new_tokens", "temperature",
            "top_p", "top_k", "seed", "stop", "n")
_OPENAI_TOP_KEYS = ("custom_id", "method", "url", "body")
# Columns batchgen writes itself: a carried-through input column of the same name would clash
# with them (the result columns, and the input position that parts and shard outputs carry).
RESERVED_COLUMNS = ("sample_index", "completion", "finish_reason", "prompt_tokens", "cached_tokens",
                    "completion_tokens", "_batchgen_order")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _show(value: Any) -> str:
    """Short repr for error messages; long prompts would drown the message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return "_" not in text  # float() accepts 1_000; JSON does not


def _bad_type(value: Any, expected: str) -> str:
    if isinstance(value, str):
        # The commonest mistake is a quoted number coming out of a spreadsheet export;
        # only then is "drop the quotes" the fix ('abc' unquoted would be invalid JSON).
        hint = "; write it without quotes" if _is_number_text(value) else ""
        return f"must be {expected}, got the string {_show(value)}{hint}"
    return f"must be {expected}, got {_show(value)} ({type(value).__name__})"


class _Checker:
    """Field validators bound to one row, so each error carries location and id."""

    def __init__(self, location: Location, job_id: str | int | None = None) -> None:
        self.location = location
        self.job_id = job_id

    def fail(self, name: str | None, reason: str) -> JobValidationError:
        return JobValidationError(self.location, name, reason, self.job_id)

    def integer(self, name: str, value: Any, *, low: int, high: int, what: str) -> int:
        # 3.0 is accepted because JSON writers and pandas often emit integral floats.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, _bad_type(value, what))
        if not low <= value <= high:
            limit = f" (at most {high:_})" if value > high else ""
            raise self.fail(name, f"must be {what}{limit}, got {value}")
        return value

    def number(self, name: str, value: Any, what: str, ok: Callable[[float], bool]) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(name, _bad_type(value, what))
        if not (math.isfinite(value) and ok(value)):
            raise self.fail(name, f"must be {what}, got {value}")
        return float(value)

    def stop(self, value: Any) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise self.fail("stop", _bad_type(value, "a string or a list of strings"))
        if len(items) > MAX_STOP_SEQUENCES:
            raise self.fail("stop", f"has {len(items)} sequences; at most {MAX_STOP_SEQUENCES} are allowed")
        for i, s in enumerate(items):
            if not isinstance(s, str) or not s:
                raise self.fail("stop", f"entry {i} must be a non-empty string, got {_show(s)}")
        return tuple(items)

    def prompt(self, value: Any, name: str = "prompt") -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(name, f"must be a non-empty string, got {_show(value)}")
        return value

    def messages(self, value: Any, name: str = "messages") -> list[dict[str, str]]:
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(name, f"must be a non-empty list of {{role, content}} objects, got {_show(value)}")
        out: list[dict[str, str]] = []
        for i, msg in enumerate(value):
            where = f"{name}[{i}]"
            if not isinstance(msg, Mapping):
                raise self.fail(where, f"must be an object with 'role' and 'content', got {_show(msg)}")
            role = msg.get("role")
            if role not in MESSAGE_ROLES:
                roles = ", ".join(sorted(MESSAGE_ROLES))
                raise self.fail(f"{where}.role", f"must be one of {roles}, got {_show(role)}")
            clean = {"role": role, "content": self._content(f"{where}.content", msg.get("content"))}
            for key, extra in msg.items():
                # Parquet structs fill absent members with null; drop those rather than fail.
                if key in ("role", "content") or extra is None:
                    continue
                if not isinstance(extra, str):
                    raise self.fail(f"{where}.{key}", f"must be a string, got {_show(extra)}")
                clean[key] = extra
            out.append(clean)
        return out

    def _content(self, name: str, value: Any) -> str:
        if isinstance(value, str):
            return value
        # OpenAI clients often send content as a list of text parts; join them.
        parts = value if isinstance(value, (list, tuple)) and value else [value]
        if all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in parts):
            return "".join(p["text"] for p in parts)
        raise self.fail(name, f"must be a string or a list of text parts, got {_show(value)}")


@dataclass(frozen=True)
class GenerationDefaults:
    """Values used when a row leaves a generation field out (or sets it to null)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1

    def __post_init__(self) -> None:
        # CLI values go through the same checks so a bad flag fails before any row is read.
        check = _Checker(Location("defaults"))
        norm = _normalize_params(check, {f.name: getattr(self, f.name) for f in fields(self)})
        for key, value in norm.items():
            object.__setattr__(self, key, value)


def _normalize_params(check: _Checker, values: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "max_new_tokens": check.integer("max_new_tokens", values["max_new_tokens"], low=1,
                                        high=MAX_NEW_TOKENS_LIMIT, what="a positive integer"),
        "temperature": check.number("temperature", values["temperature"], "a number >= 0",
                                    lambda t: t >= 0),
        "top_p": check.number("top_p", values["top_p"], "a number in (0, 1] (1 disables it)",
                              lambda p: 0 < p <= 1),
        "top_k": check.integer("top_k", values["top_k"], low=0, high=2**31 - 1,
                               what="an integer >= 0 (0 disables top-k)"),
        "seed": None if values["seed"] is None else check.integer(
            "seed", values["seed"], low=_SEED_MIN, high=_SEED_MAX, what="an integer or null"),
        "stop": check.stop(values["stop"]),
        "n": check.integer("n", values["n"], low=1, high=MAX_N, what="a positive integer"),
    }


def _check_id(check: _Checker, value: Any, default_id: int, name: str = "id") -> str | int:
    if value is None:
        return default_id
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # pandas turns an int column with gaps into floats
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise check.fail(name, f"must be a string or an integer, got {_show(value)} ({type(value).__name__})")
    if isinstance(value, str) and not value:
        raise check.fail(name, "must not be an empty string; leave it out to use the row number")
    if name == "id" and isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
        # Integer ids are written as int64; rather than turn every id of the output into text
        # for one row, the row is refused and says how to keep its id.
        raise check.fail(name, f"is an integer outside the 64-bit range; write it as a string "
                               f"(\"{value}\") to keep it")
    return value


def _check_text(location: Location, row: Mapping[str, Any], id_key: str) -> None:
    where = bad_text_at(row)
    if where is None:
        return
    raw_id = row.get(id_key)
    job_id = raw_id if isinstance(raw_id, int) or (isinstance(raw_id, str) and encodes(raw_id)) else None
    printable = where.encode("utf-8", "backslashreplace").decode("utf-8")  # the message must be writable
    raise JobValidationError(location, printable, "is not valid Unicode text: it holds a lone surrogate "
                             "(a \\ud800-style escape without its pair); fix or remove that text", job_id)


def _check_columns(check: _Checker, extra: Mapping[str, Any]) -> None:
    for name in extra:
        if name in RESERVED_COLUMNS:
            raise check.fail(name, "is a column batchgen writes itself; rename it in the input "
                                   "(its values would clash with the result column)")


def _fill_template(check: _Checker, template: str, row: Mapping[str, Any]) -> str:
    try:
        return fill_template(template, row)
    except TemplateRowError as e:
        raise check.fail(e.field, e.reason) from None


@dataclass
class Job:
    """One validated generation request. Exactly one of ``prompt``/``messages`` is set."""

    id: str | int
    prompt: str | None
    messages: list[dict[str, str]] | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    n: int
    extra: dict[str, Any]
    location: Location
    custom_id: str | None = None
    endpoint: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def openai_endpoint(self) -> str:
        """Endpoint to report in OpenAI-format output (the input's, or implied by the job kind)."""
        return self.endpoint or (CHAT_ENDPOINT if self.is_chat else COMPLETIONS_ENDPOINT)

    @classmethod
    def from_row(cls, row: Mapping[str, Any], location: Location, defaults: GenerationDefaults,
                 default_id: int, *, prompt_template: str | None = None,
                 system: str | None = None) -> Job:
        """Validate one input row; raise JobValidationError naming the bad field.

        OpenAI Batch API rows (with ``custom_id`` and ``body``) are recognised per row.
        ``prompt_template`` builds ``prompt`` from the row's columns (the columns stay
        in ``extra``); ``system`` turns the job into chat messages with that system
        prompt, unless the row's own messages already start with a system message.
        """
        if not isinstance(row, Mapping):
            raise JobValidationError(location, None, f"expected a JSON object, got {type(row).__name__}")
        openai = "custom_id" in row and "body" in row
        _check_text(location, row, "custom_id" if openai else "id")
        if openai:
            if prompt_template is not None:
                cid = row["custom_id"]
                raise JobValidationError(location, None, "--prompt-template cannot be used with OpenAI "
                                         "batch rows", cid if isinstance(cid, (str, int)) else None)
            return cls._from_openai_row(row, location, defaults, default_id, system)
        raw_id = row.get("id")
        check = _Checker(location, raw_id if isinstance(raw_id, (str, int)) else None)
        job_id = _check_id(check, raw_id, default_id)
        check.job_id = job_id
        extra = {k: v for k, v in row.items() if k not in JOB_KEYS}
        _check_columns(check, extra)

        prompt, messages = row.get("prompt"), row.get("messages")
        if prompt_template is not None:
            if messages is not None:
                raise check.fail("messages", "is set, but --prompt-template builds a prompt; "
                                             "use one or the other")
            if prompt is not None:
                extra["prompt"] = prompt  # the template may read it; keep the original too
            prompt = _fill_template(check, prompt_template, row)
        return cls._build(check, job_id, prompt, messages, row, defaults, extra, system)

    @classmethod
    def _from_openai_row(cls, row: Mapping[str, Any], location: Location,
                         defaults: GenerationDefaults, default_id: int, system: str | None) -> Job:
        raw_id = row.get("custom_id")
        check = _Checker(location, raw_id if isinstance(raw_id, (str, int)) else None)
        if raw_id is None:
            raise check.fail("custom_id", "must be a non-empty string, got null")
        custom_id = str(_check_id(check, raw_id, default_id, "custom_id"))
        check.job_id = custom_id
        method = row.get("method", "POST")
        if method != "POST":
            raise check.fail("method", f"must be 'POST', got {_show(method)}")
        body = row["body"]
        if not isinstance(body, Mapping):
            raise check.fail("body", f"must be an object, got {_show(body)}")
        url = row.get("url") or (CHAT_ENDPOINT if "messages" in body else COMPLETIONS_ENDPOINT)
        if url not in OPENAI_ENDPOINTS:
            raise check.fail("url", f"must be one of {', '.join(OPENAI_ENDPOINTS)}, got {_show(url)}")
        wanted, other = ("messages", "prompt") if url == CHAT_ENDPOINT else ("prompt", "messages")
        if body.get(wanted) is None:
            raise check.fail(f"body.{wanted}", f"is required for {url}")
        if body.get(other) is not None:
            raise check.fail(f"body.{other}", f"is not allowed for {url}; send body.{wanted}")

        # Map the OpenAI names onto ours; max_completion_tokens is the newer spelling.
        params: dict[str, Any] = {k: body.get(k) for k in ("temperature", "top_p", "seed", "stop", "n")}
        max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        params["max_new_tokens"] = body.get(max_key)
        extra = {k: v for k, v in row.items() if k not in _OPENAI_TOP_KEYS}
        _check_columns(check, extra)
        if body.get("model") is not None:
            extra.setdefault("model", body["model"])
        prompt = body.get("prompt")
        if url == COMPLETIONS_ENDPOINT and not isinstance(prompt, str):
            raise check.fail("body.prompt", f"must be a single string (lists and token ids are "
                                            f"not supported), got {_show(prompt)}")
        job = cls._build(check, custom_id, prompt, body.get("messages"), params, defaults, extra,
                         system, field_prefix="body.", renames={"max_new_tokens": max_key})
        job.custom_id, job.endpoint = custom_id, url
        return job

    @classmethod
    def _build(cls, check: _Checker, job_id: str | int, prompt: Any, messages: Any,
               params: Mapping[str, Any], defaults: GenerationDefaults, extra: dict[str, Any],
               system: str | None, field_prefix: str = "",
               renames: Mapping[str, str] | None = None) -> Job:
        if (prompt is None) == (messages is None):
            which = "both" if prompt is not None else "neither"
            raise check.fail(None, f"row has {which} of 'prompt' and 'messages'; exactly one is required")
        if prompt is not None:
            prompt = check.prompt(prompt, field_prefix + "prompt")
        else:
            messages = check.messages(messages, field_prefix + "messages")

        # Per-row None means "use the default", same as leaving the key out.
        merged = {f.name: getattr(defaults, f.name) if params.get(f.name) is None else params[f.name]
                  for f in fields(GenerationDefaults)}
        try:
            norm = _normalize_params(check, merged)
        except JobValidationError as e:
            if not field_prefix or not e.field:
                raise
            # Report the name the user wrote (body.max_tokens), not our internal one.
            name = (renames or {}).get(e.field, e.field)
            raise check.fail(field_prefix + name, e.reason) from None

        if system is not None:
            if messages is None:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
                prompt = None
            elif messages[0]["role"] not in ("system", "developer"):
                messages = [{"role": "system", "content": system}, *messages]
        return cls(id=job_id, prompt=prompt, messages=messages, extra=extra,
                   location=check.location, **norm)


@dataclass
class InvalidRow:
    """A row that failed to parse or validate; readers yield it and keep going."""

    location: Location
    job_id: str | int | None
    reason: str

    @classmethod
    def from_error(cls, error: JobValidationError) -> InvalidRow:
        return cls(location=error.location, job_id=error.job_id, reason=error.detail)

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"

    def to_row(self) -> dict[str, Any]:
        """Row for the errors file; ids are strings there because bad rows may mix types."""
        def text(value: str) -> str:
            # a file name with undecodable bytes must not make the errors file unwritable
            return value.encode("utf-8", "backslashreplace").decode("utf-8")

        return {"id": None if self.job_id is None else text(str(self.job_id)),
                "location": text(str(self.location)), "reason": text(self.reason)}


__all__ = ["JobError", "JobValidationError", "Location", "GenerationDefaults", "Job",
           "InvalidRow", "template_fields", "MESSAGE_ROLES", "CHAT_ENDPOINT",
           "COMPLETIONS_ENDPOINT", "JOB_KEYS", "RESERVED_COLUMNS"]
