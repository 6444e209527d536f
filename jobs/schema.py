"""Job records: validation of one input row into a typed :class:`Job`.

Readers hand raw ``dict`` rows to :meth:`Job.from_row`; everything past that
point works on dataclasses. Validation errors name the input location and the
field so that a user with a million-line file can find and fix the bad row.
"""

from __future__ import annotations

from collections.abc import Mapping  # isinstance is faster than with typing's alias (a check per row)
from dataclasses import dataclass
from typing import Any

from .checks import MESSAGE_ROLES, TOO_DEEP, Checker, show, too_deep_field
from .columns import CREATED, ORDER
from .conversations import check_conversation, check_then, split_messages, then_with_chat
from .errors import JobError, JobValidationError, Location, option
from . import openai_limits
from .params import (CONSTRAINTS, PARAMS, RESERVED, Constraint, choice_min_tokens, completions_logprobs, constraint,
                     continuations_field, normalize, split_fields)
from .templates import TemplateRowError, fill_template, template_fields
from .text import bad_text_at, encodes

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
OPENAI_ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)

# Keys that Job.from_row consumes (with every name in params.RESERVED); the rest go to `extra`.
JOB_KEYS = ("id", "prompt", "messages", "continuations", "adapter", "then") + PARAMS
_OPENAI_TOP_KEYS = ("custom_id", "method", "url", "body")
# Body fields that describe a request without changing its output: accepted, not used.
_OPENAI_INFO_KEYS = ("model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
# Columns batchgen writes itself: a carried-through input column of the same name would clash
# with them (the result columns, the input position that parts and shard outputs carry, and the
# completion time that OpenAI output reports).
RESERVED_COLUMNS = ("sample_index", "completion", "finish_reason", "prompt_tokens", "cached_tokens",
                    "completion_tokens", "scores", "best_continuation", "prompt_index", "adapter", "turns",
                    "turn_finish_reasons", "turn_completion_tokens", ORDER, CREATED)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


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
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: Any = ()  # {token id: bias} or (id, bias) pairs; stored as sorted pairs
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    constraint: Constraint | None = None  # jobs without one of their own get this one

    def __post_init__(self) -> None:
        # CLI values go through the same checks so a bad flag fails before any row is read.
        check = Checker(Location("defaults"))
        norm = normalize(check, {name: getattr(self, name) for name in PARAMS})
        for key, value in norm.items():
            object.__setattr__(self, key, value)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise check.fail("constraint", f"must be a Constraint, got {show(self.constraint)}")

    @staticmethod
    def constraint_of(**fields: Any) -> Constraint | None:
        """A default constraint from job-field spellings (json_schema=..., regex=..., choice=...)."""
        check = Checker(Location("defaults"))
        params, spelled = split_fields(check, fields)
        return constraint(check, params, spelled)


def _check_id(check: Checker, value: Any, default_id: int, name: str = "id") -> str | int:
    if value is None:
        return default_id
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # pandas turns an int column with gaps into floats
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise check.fail(name, f"must be a string or an integer, got {show(value)} ({type(value).__name__})")
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


def _check_depth(location: Location, row: Mapping[str, Any], id_key: str) -> None:
    """A value nested deeper than Parquet stores is refused first: the other checks recurse."""
    field = too_deep_field(row)
    if field is not None:
        raw_id = row.get(id_key)
        job_id = raw_id if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) else None
        raise JobValidationError(location, field, TOO_DEEP, job_id)


def _check_columns(check: Checker, extra: Mapping[str, Any]) -> None:
    for name in extra:
        if name in RESERVED_COLUMNS:
            raise check.fail(name, "is a column batchgen writes itself; rename it in the input "
                                   "(its values would clash with the result column)")


def _check_adapter(check: Checker, value: Any) -> str | None:
    """A row's `adapter`: a registered name or a path, as text (null: the run's default)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise check.fail("adapter", f"must be a non-empty string (a name given with --adapter NAME=PATH, or an "
                                    f"adapter directory), got {show(value)}")
    return value


def _fill_template(check: Checker, template: str, row: Mapping[str, Any]) -> str:
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
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False  # each generated token's logprob (and top_logprobs alternatives)
    top_logprobs: int = 0
    prompt_logprobs: bool = False  # each prompt token's logprob after the first (echo)
    constraint: Constraint | None = None
    # which element of an OpenAI completions request's prompt list: the elements share the request's
    # id (its custom_id), so a job is (id, prompt_index), never a name made from the id
    prompt_index: int | None = None
    request_model: str | None = None  # an OpenAI request's body.model (OpenAI output echoes it)
    # a scoring job: these are scored after the prompt, nothing is generated (pipeline/text/expand.py)
    continuations: tuple[str, ...] | None = None
    # the LoRA adapter it runs with: a name registered with --adapter NAME=PATH, or a path; None:
    # the base model. The row's own field as read; the run resolves it (pipeline/run/adapters.py:
    # an OpenAI request's body.model naming a registered adapter, else the run's default) and
    # the output's `adapter` column reports what ran
    adapter: str | None = None
    # a conversation (jobs/conversations.py): what follows each generated turn but the last, the
    # text of a prompt job's rounds or the messages of a chat job's; None: one turn
    then: tuple[Any, ...] | None = None

    @property
    def turns(self) -> int:
        """Turns generated: one, or one more than `then` has."""
        return 1 + len(self.then or ())

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def openai_endpoint(self) -> str:
        """Endpoint to report in OpenAI-format output (the input's, or implied by the job kind)."""
        return self.endpoint or (CHAT_ENDPOINT if self.is_chat else COMPLETIONS_ENDPOINT)

    def generation(self) -> dict[str, Any]:
        """Every generation parameter, as plain values (what a run's fingerprint records)."""
        out = {name: getattr(self, name) for name in PARAMS}
        out["constraint"] = None if self.constraint is None else [self.constraint.kind, self.constraint.spec]
        out["continuations"] = None if self.continuations is None else list(self.continuations)
        return out

    @property
    def is_scoring(self) -> bool:
        return self.continuations is not None

    @classmethod
    def from_row(cls, row: Mapping[str, Any], location: Location, defaults: GenerationDefaults,
                 default_id: int, *, prompt_template: str | None = None,
                 system: str | None = None) -> Job:
        """Validate one input row into one job; raise JobValidationError naming the bad field."""
        jobs = cls.from_record(row, location, defaults, default_id, prompt_template=prompt_template,
                               system=system)
        if len(jobs) != 1:
            raise JobValidationError(location, "body.prompt", "is a list: this row makes several jobs")
        return jobs[0]

    @classmethod
    def from_record(cls, row: Mapping[str, Any], location: Location, defaults: GenerationDefaults,
                    default_id: int, *, prompt_template: str | None = None,
                    system: str | None = None) -> list[Job]:
        """Validate one input row into its jobs (one, or one per element of an OpenAI completions
        request's list prompt); raise JobValidationError naming the bad field.

        OpenAI Batch API rows (with ``custom_id`` and ``body``) are recognised per row.
        ``prompt_template`` builds ``prompt`` from the row's columns (the columns stay
        in ``extra``); ``system`` turns the job into chat messages with that system
        prompt, unless the row's own messages already start with a system message.
        """
        if not isinstance(row, Mapping):
            raise JobValidationError(location, None, f"expected a JSON object, got {type(row).__name__}")
        openai = "custom_id" in row and "body" in row
        _check_depth(location, row, "custom_id" if openai else "id")
        _check_text(location, row, "custom_id" if openai else "id")
        if openai:
            if prompt_template is not None:
                cid = row["custom_id"]
                raise JobValidationError(location, None, f"{option('prompt_template')} cannot be used with OpenAI "
                                         "batch rows", cid if isinstance(cid, (str, int)) else None)
            return cls._from_openai_row(row, location, defaults, default_id, system)
        raw_id = row.get("id")
        check = Checker(location, raw_id if isinstance(raw_id, (str, int)) else None)
        job_id = _check_id(check, raw_id, default_id)
        check.job_id = job_id
        # a generation parameter is used or refused, never carried through as a plain column
        params, spelled = split_fields(check, row, keys=[k for k in row if k in RESERVED])
        extra = {k: v for k, v in row.items() if k not in ("id", "prompt", "messages", "continuations", "adapter",
                                                             "then") and k not in RESERVED}
        _check_columns(check, extra)
        continuations = continuations_field(check, row.get("continuations"), params, spelled)

        prompt, messages = row.get("prompt"), row.get("messages")
        if prompt_template is not None:
            if messages is not None:
                raise check.fail("messages", f"is set, but {option('prompt_template')} builds a prompt; "
                                             "use one or the other")
            if prompt is not None:
                extra["prompt"] = prompt  # the template may read it; keep the original too
            prompt = _fill_template(check, prompt_template, row)
        if continuations is not None:
            defaults = _SCORING_DEFAULTS
        then = check_then(check, row.get("then"))
        job = cls._build(check, job_id, prompt, messages, params, spelled, defaults, extra, system, then=then)
        job.continuations = continuations
        job.adapter = _check_adapter(check, row.get("adapter"))
        if job.then is not None:
            check_conversation(check, job, "then" if then is not None else "messages")
        return [job]

    @classmethod
    def _from_openai_row(cls, row: Mapping[str, Any], location: Location,
                         defaults: GenerationDefaults, default_id: int, system: str | None) -> list[Job]:
        raw_id = row.get("custom_id")
        check = Checker(location, raw_id if isinstance(raw_id, (str, int)) else None)
        custom_id = openai_limits.custom_id(check, raw_id)
        method = row.get("method", "POST")
        if method != "POST":
            raise check.fail("method", f"must be 'POST', got {show(method)}")
        body = row["body"]
        if not isinstance(body, Mapping):
            raise check.fail("body", f"must be an object, got {show(body)}")
        url = row.get("url") or (CHAT_ENDPOINT if "messages" in body else COMPLETIONS_ENDPOINT)
        if url not in OPENAI_ENDPOINTS:
            raise check.fail("url", f"must be one of {', '.join(OPENAI_ENDPOINTS)}, got {show(url)}")
        wanted, other = ("messages", "prompt") if url == CHAT_ENDPOINT else ("prompt", "messages")
        if body.get(wanted) is None:
            raise check.fail(f"body.{wanted}", f"is required for {url}")
        if body.get(other) is not None:
            raise check.fail(f"body.{other}", f"is not allowed for {url}; send body.{wanted}")

        # OpenAI's names map onto ours (params.ALIASES); max_completion_tokens replaces max_tokens.
        # Any field batchgen cannot honour fails the request, as the API refuses unknown ones.
        keys = [k for k in body if k not in ("messages", "prompt") + _OPENAI_INFO_KEYS
                and not (k == "max_tokens" and body.get("max_completion_tokens") is not None)]
        if url == CHAT_ENDPOINT and body.get("echo") is not None:
            raise check.fail("body.echo", f"is not a parameter of {url} (only of {COMPLETIONS_ENDPOINT}); remove it")
        params, spelled = split_fields(check, body, keys=keys, prefix="body.",
                                       unknown=f"is not a parameter batchgen knows for {url}; remove it")
        openai_limits.check_body(check, body)
        if url == COMPLETIONS_ENDPOINT:
            completions_logprobs(check, params, spelled)
        extra = {k: v for k, v in row.items() if k not in _OPENAI_TOP_KEYS}
        _check_columns(check, extra)
        if body.get("model") is not None:
            extra.setdefault("model", body["model"])
        prompt = body.get("prompt")
        if url == COMPLETIONS_ENDPOINT and not isinstance(prompt, str):
            jobs = cls._list_prompt(check, custom_id, prompt, params, spelled, defaults, extra, system)
        else:
            jobs = [cls._build(check, custom_id, prompt, body.get("messages"), params, spelled, defaults, extra,
                               system, field_prefix="body.")]
        for job in jobs:
            job.custom_id, job.endpoint, job.request_model = custom_id, url, body.get("model")
        return jobs

    @classmethod
    def _list_prompt(cls, check: Checker, custom_id: str, prompt: Any, params: dict[str, Any],
                     spelled: dict[str, str], defaults: GenerationDefaults, extra: dict[str, Any],
                     system: str | None) -> list[Job]:
        """A list prompt is one job per element, as the API runs one completion per element; the
        request stays whole: one bad element fails it all, and its output line holds them all."""
        if not isinstance(prompt, (list, tuple)) or not prompt or not all(isinstance(p, str) for p in prompt):
            raise check.fail("body.prompt", f"must be a string or a non-empty list of strings (token ids "
                                            f"are not supported), got {show(prompt)}")
        jobs = []
        for i, text in enumerate(prompt):
            job = cls._build(check, custom_id, text, None, params, spelled, defaults, dict(extra),
                             system, field_prefix="body.", prompt_field=f"body.prompt[{i}]")
            job.prompt_index = i
            jobs.append(job)
        return jobs

    @classmethod
    def _build(cls, check: Checker, job_id: str | int, prompt: Any, messages: Any,
               params: Mapping[str, Any], spelled: Mapping[str, str], defaults: GenerationDefaults,
               extra: dict[str, Any], system: str | None, field_prefix: str = "",
               prompt_field: str | None = None, then: tuple[str, ...] | None = None) -> Job:
        if (prompt is None) == (messages is None):
            which = "both" if prompt is not None else "neither"
            raise check.fail(None, f"row has {which} of 'prompt' and 'messages'; exactly one is required")
        if prompt is not None:
            prompt = check.prompt(prompt, prompt_field or field_prefix + "prompt")
        else:  # null contents (turns to generate) in batchgen's own rows only: a Batch request is one turn
            messages = check.messages(messages, field_prefix + "messages", turns=not field_prefix)
            if then is not None:
                raise then_with_chat(check, system=False)
            messages, then = split_messages(check, messages, field_prefix + "messages")

        # Per-row None means "use the default", same as leaving the key out.
        # the default seed is the run's seed, not each job's: a job without one derives its own from it
        # and its id (preflight.job_seed), so two jobs with one prompt do not give the same samples
        merged = {name: (None if name == "seed" else getattr(defaults, name)) if params.get(name) is None
                  else params[name] for name in PARAMS}
        if params.get("logprobs") is False and params.get("top_logprobs") is None:
            merged["top_logprobs"] = 0  # the row turns logprobs off: the default alternatives go with them
        try:
            # defaults were normalized once (GenerationDefaults.__post_init__): a row that sets no
            # parameter takes them as they are (most rows of a big file; a quarter of reading time)
            norm = normalize(check, merged) if params else merged  # (split_fields keeps no null values)
        except JobValidationError as e:
            # Report the name the user wrote (body.max_tokens, guided_json), not our internal one.
            root = (e.field or "").split(".")[0].split("[")[0]
            if root not in spelled:
                raise
            raise check.fail(spelled[root] + e.field[len(root):], e.reason) from None
        given = any(params.get(name) is not None for name in CONSTRAINTS)
        rule = constraint(check, params, spelled) if given else defaults.constraint
        choice_min_tokens(check, rule, norm["min_tokens"], spelled)

        if system is not None:
            if messages is None:
                if then is not None:
                    raise then_with_chat(check, system=True)
                messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
                prompt = None
            elif messages[0]["role"] not in ("system", "developer"):
                messages = [{"role": "system", "content": system}, *messages]
        return cls(id=job_id, prompt=prompt, messages=messages, extra=extra,
                   location=check.location, constraint=rule, then=then, **norm)


# The defaults a scoring job takes: the CLI's generation defaults (--logprobs, --n, a default
# constraint) are for the generating jobs; a scoring job beside them in the same file generates nothing.
_SCORING_DEFAULTS = GenerationDefaults()


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
           "COMPLETIONS_ENDPOINT", "JOB_KEYS", "RESERVED_COLUMNS", "Constraint"]
