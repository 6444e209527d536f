"""Field checks bound to one input row, so that every error names the row's location, its id and
the field (``jobs.jsonl:17: field 'max_new_tokens' must be a positive integer, got -3``)."""

from __future__ import annotations

import math
from collections.abc import Mapping  # isinstance is faster than with typing's alias (a check per row)
from typing import Any, Callable

from .errors import JobValidationError, Location

MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
MAX_STOP_SEQUENCES = 16
# A Parquet schema is at most 100 levels deep (pyarrow reads no deeper), its root one of them: a
# list takes two levels (the list, its repeated element), an object one. A deeper value could not
# be stored, and code that recurses over values (json, pickle, the text checks) could not finish.
MAX_LEVELS = 98
TOO_DEEP = ("is nested too deeply: batchgen takes at most 49 levels of nested lists (98 of objects), "
            "as deep as Parquet stores; flatten it")


def show(value: Any) -> str:
    """Short repr for error messages; long prompts would drown the message."""
    try:
        text = repr(value)
    except RecursionError:  # JSON text can parse deeper than repr recurses
        return f"a {type(value).__name__} nested too deeply to show"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return "_" not in text  # float() accepts 1_000; JSON does not


_SCALARS = frozenset({str, int, float, bool, type(None)})  # by exact type: isinstance on Mapping is slow


def too_deep(value: Any, limit: int = MAX_LEVELS) -> bool:
    """Whether `value` nests deeper than `limit` Parquet levels (see MAX_LEVELS). A loop, not a
    recursion: a value of any depth gets an answer. It runs on every row that holds a list or an
    object, so scalars are skipped by their type."""
    stack = [(value, 0)]
    push = stack.append
    while stack:
        value, level = stack.pop()
        if isinstance(value, (list, tuple)):
            level += 2
        elif isinstance(value, Mapping):
            level, value = level + 1, value.values()
        else:
            continue
        if level > limit:
            return True
        for item in value:
            if type(item) not in _SCALARS:
                push((item, level))
    return False


def too_deep_field(row: Mapping[str, Any]) -> str | None:
    """The first field of `row` whose value nests too deeply (too_deep), or None."""
    for key, value in row.items():
        if type(value) not in _SCALARS and too_deep(value):
            return str(key)
    return None


def bad_type(value: Any, expected: str) -> str:
    if isinstance(value, str):
        # The commonest mistake is a quoted number coming out of a spreadsheet export;
        # only then is "drop the quotes" the fix ('abc' unquoted would be invalid JSON).
        hint = "; write it without quotes" if _is_number_text(value) else ""
        return f"must be {expected}, got the string {show(value)}{hint}"
    return f"must be {expected}, got {show(value)} ({type(value).__name__})"


class Checker:
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
            raise self.fail(name, bad_type(value, what))
        if not low <= value <= high:
            limit = f" (at most {high:_})" if value > high else ""
            raise self.fail(name, f"must be {what}{limit}, got {value}")
        return value

    def boolean(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.fail(name, bad_type(value, "true or false"))
        return value

    def number(self, name: str, value: Any, what: str, ok: Callable[[float], bool]) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(name, bad_type(value, what))
        if not (math.isfinite(value) and ok(value)):
            raise self.fail(name, f"must be {what}, got {value}")
        return float(value)

    def stop(self, value: Any) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise self.fail("stop", bad_type(value, "a string or a list of strings"))
        if len(items) > MAX_STOP_SEQUENCES:
            raise self.fail("stop", f"has {len(items)} sequences; at most {MAX_STOP_SEQUENCES} are allowed")
        for i, s in enumerate(items):
            if not isinstance(s, str) or not s:
                raise self.fail("stop", f"entry {i} must be a non-empty string, got {show(s)}")
        return tuple(items)

    def prompt(self, value: Any, name: str = "prompt") -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(name, f"must be a non-empty string, got {show(value)}")
        return value

    def messages(self, value: Any, name: str = "messages", turns: bool = False) -> list[dict[str, Any]]:
        """A chat's messages; with `turns`, an assistant message's content may be null: a turn to
        generate (a conversation: pipeline/text/turns.py), else null content is refused."""
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(name, f"must be a non-empty list of {{role, content}} objects, got {show(value)}")
        out: list[dict[str, str]] = []
        for i, msg in enumerate(value):
            where = f"{name}[{i}]"
            if not isinstance(msg, Mapping):
                raise self.fail(where, f"must be an object with 'role' and 'content', got {show(msg)}")
            role = msg.get("role")
            if role not in MESSAGE_ROLES:
                roles = ", ".join(sorted(MESSAGE_ROLES))
                raise self.fail(f"{where}.role", f"must be one of {roles}, got {show(role)}")
            content = msg.get("content")
            if content is None and "content" in msg:
                self._null_content(f"{where}.content", role, name, turns)
            clean = {"role": role, "content": None if content is None and "content" in msg
                     else self._content(f"{where}.content", content)}
            for key, extra in msg.items():
                # Parquet structs fill absent members with null; drop those rather than fail.
                if key in ("role", "content") or extra is None:
                    continue
                if not isinstance(extra, str):
                    raise self.fail(f"{where}.{key}", f"must be a string, got {show(extra)}")
                clean[key] = extra
            out.append(clean)
        return out

    def _null_content(self, name: str, role: str, field: str, turns: bool) -> None:
        if not turns:  # an OpenAI Batch request: one request is one turn
            raise self.fail(name, "is null: a Batch API request generates one reply, after all its messages; "
                                  "write a conversation whose assistant turns are generated as a batchgen job "
                                  "(messages with \"content\": null for each turn to generate)")
        if role != "assistant":
            raise self.fail(name, "is null, but only an assistant message's content may be null (a turn to generate)")

    def _content(self, name: str, value: Any) -> str:
        if isinstance(value, str):
            return value
        # OpenAI clients often send content as a list of text parts; join them.
        parts = value if isinstance(value, (list, tuple)) and value else [value]
        if all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in parts):
            return "".join(p["text"] for p in parts)
        raise self.fail(name, f"must be a string or a list of text parts, got {show(value)}")
