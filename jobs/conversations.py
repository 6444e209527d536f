"""Conversations in job rows: every assistant turn generated in order, in one run.

- A chat job's `messages` may hold assistant messages with `"content": null`: each is a turn to
  generate, from every message before it (earlier generated turns filled in).
- A prompt job's `then` (a list of strings) makes rounds: text1 = prompt, and text(k+1) =
  text(k) + out(k) + then[k-1]; len(then) + 1 rounds (`then: ["", ""]` appends each output and
  goes on).

A job keeps its first turn as an ordinary job does (`prompt`, or `messages` up to the first turn
to generate), so everything that reads a job's prompt reads its first turn's; `Job.then` holds
what comes after each generated turn: strings for a prompt job, lists of messages for a chat job.
Validation names the row and the field, as every check here does.
"""
from __future__ import annotations

from typing import Any

from .checks import Checker, show
from .errors import option

NOT_IN_CONVERSATIONS = ("logprobs", "prompt_logprobs")  # per-turn token logprobs have no column yet


def split_messages(check: Checker, messages: list[dict[str, Any]], name: str
                   ) -> tuple[list[dict[str, Any]], tuple[tuple[dict[str, Any], ...], ...] | None]:
    """The first turn's messages (those before the first null content) and, when more turns
    follow, the messages after each turn to generate but the last. One null content at the end is
    an ordinary chat job."""
    nulls = [i for i, m in enumerate(messages) if m["content"] is None]
    if not nulls:
        return messages, None
    if nulls[0] == 0:
        raise check.fail(f"{name}[0].content", "is null, but a turn to generate needs a message before it to answer")
    if nulls[-1] != len(messages) - 1:
        raise check.fail(f"{name}[{nulls[-1] + 1}]", "follows the last turn to generate (the last null content), so "
                                                    "no turn would read it; end the messages with that turn")
    for a, b in zip(nulls, nulls[1:]):
        if b == a + 1:
            raise check.fail(f"{name}[{b}].content", "is null right after another turn to generate; put the "
                                                    "message it answers between them")
    later = tuple(tuple(messages[a + 1 : b]) for a, b in zip(nulls, nulls[1:]))
    return messages[: nulls[0]], later or None


def check_then(check: Checker, value: Any) -> tuple[str, ...] | None:
    """A prompt job's `then`: the text appended after each generated round but the last."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise check.fail("then", f"must be a list of strings (the text after each generated round), got {show(value)}")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise check.fail(f"then[{i}]", f"must be a string (it may be empty), got {show(text)}")
    return tuple(value) or None


def check_conversation(check: Checker, job: Any, then_field: str) -> None:
    """What a conversation cannot be: it generates every turn, and reports no logprobs yet."""
    if job.continuations is not None:
        raise check.fail("continuations", f"cannot be used in a conversation ({then_field}): a scoring job "
                                          "generates nothing")
    if job.max_new_tokens == 0:
        raise check.fail("max_new_tokens", f"must be at least 1 in a conversation ({then_field}): every turn "
                                           "generates (it counts per turn)")
    for name in NOT_IN_CONVERSATIONS:
        if getattr(job, name):
            raise check.fail(name, f"is not supported in a conversation ({then_field}) yet; turn it off")


def then_with_chat(check: Checker, system: bool) -> Exception:
    """`then` on a job that is chat: its turns are messages."""
    why = f"{option('system')} makes this job a chat" if system else "this job has messages"
    return check.fail("then", f"is for prompt jobs, and {why}: write its turns as messages, with "
                              "{\"role\": \"assistant\", \"content\": null} for each turn to generate")
