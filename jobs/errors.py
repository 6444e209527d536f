"""batchgen's errors, and where a bad row came from. Every error batchgen raises for a user to
read is a BatchgenError: the CLI turns one into a one-line message (exit code 1, or 2 for an
OptionError) and lets anything else show as the bug it is. A JobValidationError about one row
becomes that row's InvalidRow.

This is the lowest layer (jobs/ never imports pipeline/): pipeline/errors.py re-exports it."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator


class BatchgenError(Exception):
    """Base class of every error batchgen raises about its input, options, model or files."""


class JobError(BatchgenError):
    """Base class for errors raised by the jobs package (bad input, bad output path)."""


# --- how the caller's face names an option --------------------------------------------------
# One message serves two faces: the CLI names its flags (`-o`, `--overwrite`), the Python API its
# keyword arguments (`output=`, `overwrite=True`). Library code words an option with `option()`;
# the face that calls it chooses the spelling (`option_names`; the CLI's is the default).
_CLI_FLAGS = {"output": "-o", "stop_token_ids": "--stop-token-id"}
_BOOLEAN = frozenset({"overwrite", "trust_remote_code", "logprobs", "prompt_logprobs"})


def cli_flag(name: str) -> str:
    """The CLI's flag for option `name` (its keyword spelling: output, json_schema)."""
    return _CLI_FLAGS.get(name, "--" + name.replace("_", "-"))


def cli_option(name: str, value: object = None) -> str:
    if value is None:
        return cli_flag(name)
    return f"{cli_flag(name)} {value}"


# the CLI's repeatable flags are plural keywords in the Python API (`--server URL`: servers=[...])
_KEYWORDS = {"server": "servers", "vllm_arg": "vllm_args"}


def keyword_option(name: str, value: object = None) -> str:
    name = _KEYWORDS.get(name, name)
    if value is not None:
        return f"{name}={value!r}"
    return f"{name}=True" if name in _BOOLEAN else f"{name}="


_FACE: ContextVar[Callable[[str, object], str]] = ContextVar("batchgen_option_face", default=cli_option)


def option(name: str, value: object = None) -> str:
    """Option `name` (with `value`, if given) as the calling face writes it: `-o out.parquet`,
    `--overwrite` from the CLI; `output='out.parquet'`, `overwrite=True` from the Python API."""
    return _FACE.get()(name, value)


@contextmanager
def option_names(face: Callable[[str, object], str]) -> Iterator[None]:
    """Errors raised inside name options as `face` spells them (`keyword_option`: the Python API)."""
    token = _FACE.set(face)
    try:
        yield
    finally:
        _FACE.reset(token)


class OptionError(JobError):
    """A bad option value, or options that contradict each other: the CLI reports it as a usage
    error of that option (exit code 2). `name` is the option's keyword spelling (output, shard),
    `value` what was given, shown before the reason ("-o jobs.jsonl: is the input ..."); without
    one, the reason follows the option's name ("--json-schema cannot be used: ...")."""

    def __init__(self, name: str, reason: str, value: object = None) -> None:
        self.name, self.reason, self.value = name, reason, value
        super().__init__(f"{option(name)} {reason}" if value is None else f"{option(name, value)}: {reason}")

    def __reduce__(self):  # rebuilt from its parts (a Ray worker's error travels pickled)
        return type(self), (self.name, self.reason, self.value)


@dataclass(frozen=True)
class Location:
    """Where a row came from. JSONL uses 1-based ``line``; Parquet/datasets 0-based ``row``."""

    path: str
    line: int | None = None
    row: int | None = None

    def __str__(self) -> str:
        # The path is printed exactly as the user typed it so it can be pasted back.
        if self.line is not None:
            return f"{self.path}:{self.line}"
        if self.row is not None:
            return f"{self.path}:row {self.row}"
        return self.path


class JobValidationError(JobError):
    """One row is invalid. ``str(e)`` = ``<location>: field '<field>' <reason>``."""

    def __init__(self, location: Location, field: str | None, reason: str,
                 job_id: str | int | None = None) -> None:
        self.location, self.field, self.reason, self.job_id = location, field, reason, job_id
        super().__init__(f"{location}: {self.detail}")

    @property
    def detail(self) -> str:
        """The message without the location (what InvalidRow.reason stores)."""
        return f"field '{self.field}' {self.reason}" if self.field else self.reason
