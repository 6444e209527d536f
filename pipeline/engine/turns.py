"""Conversations in the engine: a sample's later turns continue in the slot that holds its keys
and values, cut where the next turn's prompt parts from what the slot holds.

A request with `next_turn` is a conversation. When one of its samples ends a turn, the caller
(pipeline/text, which renders the conversation) gives the next turn's whole prompt. The slot holds
the keys and values of the last prompt and the generated tokens but the last (never fed); the
next prompt usually starts with all of them, but a re-tokenized reply may differ from the
generated ids at its end, and a chat template may rewrite a reply. So the slot keeps the longest
common prefix of the two (at least one prompt token is always fed again: its logits start the turn)
and the row prefills only the rest, as a row prefills its suffix, while the other rows decode.
The row keeps its shared prefixes (the tree's system prompt or few-shot header) for all its turns.

A turn that cannot continue in its slot (its prompt outgrows the slot, or parts from the row
within its shared prefix) gives the slot back and reruns from its prompt in a later pass of the
same run: slower, and the same tokens.

Each turn's completion waits in `Conversations` until the sample's last turn, which is yielded
once with all of them (`Completion.turns`), under the request's own key and sample index: a
conversation reaches the caller whole or not at all.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Hashable, NamedTuple

from batchgen.pipeline.engine.types import Completion, Request


class Turn(NamedTuple):
    """The key of a conversation's later turn: the first request's key, the sample, the turn (1 on)."""

    root: Hashable
    sample: int
    turn: int


def root_of(key: Hashable, sample: int) -> tuple[Hashable, int]:
    """The (first request's key, sample index) a row's completion is reported under."""
    return (key.root, key.sample) if isinstance(key, Turn) else (key, sample)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def carry_point(held: list[int], next_ids: list[int]) -> int:
    """How many of the held tokens' keys and values the next turn keeps: their longest common
    prefix with its prompt, less the prompt's last token (fed again, for its logits)."""
    return min(common_prefix(held, next_ids), len(next_ids) - 1)


class Conversations:
    """The finished turns of each conversation's samples until its last: kept across a run's
    passes (a turn rerun in a later pass finds them)."""

    def __init__(self) -> None:
        self.turns: dict[tuple[Hashable, int], list[Completion]] = {}

    def keyed(self, root: tuple[Hashable, int], request: Request) -> Request:
        """The next turn's request as the engine runs it: one sample (each sample is its own
        branch from its first turn on), keyed `Turn`."""
        turn = len(self.turns.get(root, []))
        return replace(request, key=Turn(root[0], root[1], turn), params=replace(request.params, n=1))

    def record(self, root: tuple[Hashable, int], done: Completion) -> None:
        self.turns.setdefault(root, []).append(done)

    def last(self, request: Request, done: Completion) -> Completion:
        """A sample's last completion as yielded: with every turn, when it is a conversation's."""
        earlier = self.turns.pop((done.key, done.sample_index), None)
        if earlier is None and request.next_turn is None and not isinstance(request.key, Turn):
            return done
        done.turns = [*(earlier or []), replace(done)]
        return done
