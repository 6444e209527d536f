"""The jobs package's errors, and where a bad row came from. The CLI turns them into one-line
messages (exit code 1); a JobValidationError about one row becomes that row's InvalidRow."""

from __future__ import annotations

from dataclasses import dataclass


class JobError(Exception):
    """Base class for errors raised by the jobs package (bad input, bad output path)."""


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
