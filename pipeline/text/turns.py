"""A conversation job's turns as engine requests: each later turn's prompt rendered from the text
batchgen wrote for the turns before it (jobs/conversations.py has the job format).

The engine sees token ids only: when a sample's turn ends it calls the turn's `next_turn`
(`Conversation.next_turn`), which decodes the turn's text as the output writes it (special
tokens skipped, cut before a stop string), renders the conversation so far (a prompt job:
prompt + text1 + then[0] + text2 + ...; a chat job: its messages with each generated turn as an
assistant message, through the chat template with the generation prompt), and tokenizes it whole,
exactly as a job with that prompt would be. The engine keeps the row's keys and values up to where
the new ids part from what it holds (pipeline/engine/turns.py), so each turn equals plain
`generate` on the conversation rendered up to it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Callable

from batchgen.jobs import Job
from batchgen.pipeline.engine.types import MatcherFactory, Request, SamplingParams, StopCheck, TurnError
from batchgen.pipeline.text.tokenize import Tokenizer, TokenizerError

# tokens a turn's reply may take in the next prompt beyond its generated ids (a re-tokenized
# reply, a template's end-of-turn marks): what a row's slot keeps room for, not a limit; a turn
# that outgrows its slot reruns (slower, the same tokens)
TURN_SLACK = 8


def turn_seed(seed: int, turn: int) -> int:
    """A later turn's seed: its own, from the job's, so that no two turns draw the same numbers."""
    if turn == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}:turn {turn}".encode(), digest_size=8).digest(), "little") >> 1


def render_turn(job: Job, texts: list[str]) -> tuple[str | None, list[dict[str, Any]] | None]:
    """The conversation before turn len(texts) + 1 (0-based: len(texts)), with these earlier
    turns' texts: (prompt, None) for a prompt job, (None, messages) for a chat job."""
    then = job.then or ()
    if job.prompt is not None:
        return job.prompt + "".join(text + after for text, after in zip(texts, then)), None
    messages = list(job.messages)
    for text, after in zip(texts, then):
        messages += [{"role": "assistant", "content": text}, *after]
    return None, messages


def encode_turn(tokenizer: Tokenizer, job: Job, texts: list[str]) -> list[int]:
    """Turn len(texts)'s prompt ids, tokenized whole as a job of that prompt is (`encode_many`)."""
    prompt, messages = render_turn(job, texts)
    [ids] = tokenizer.encode_many([prompt], [messages])
    if isinstance(ids, TokenizerError):
        raise ids
    return ids


def full_length(tokenizer: Tokenizer, job: Job) -> int:
    """The last turn's prompt ids with every earlier reply empty: what the conversation adds to its
    first prompt, besides its replies."""
    return len(encode_turn(tokenizer, job, [""] * len(job.then or ())))


def conversation_problem(tokenizer: Tokenizer, job: Job, window: int | None) -> str | None:
    """Why a conversation cannot run: it does not render or tokenize, or its last turn's prompt
    (replies empty) with every turn's max_new_tokens passes the context window."""
    try:
        length = full_length(tokenizer, job)
    except TokenizerError as e:
        return f"its later turns cannot be rendered: {e}"
    most = length + job.turns * job.max_new_tokens
    if window is not None and most > window:
        return (f"the conversation's {job.turns} turns may take {most} tokens (its last prompt with empty replies "
                f"is {length}, and max_new_tokens {job.max_new_tokens} counts per turn), more than the model's "
                f"context window of {window}; shorten it or lower max_new_tokens")
    return None


@dataclass
class Conversation:
    """One conversation job's turns: its first request and, as each turn ends, the next."""

    order: int
    job: Job
    tokenizer: Tokenizer
    window: int | None
    params: SamplingParams  # the first turn's; later turns differ in their seed only
    adapter: int = 0
    stop: StopCheck | None = None
    grammar: MatcherFactory | None = None
    extra: int = 0  # tokens the later turns' prompts add besides the replies (`full_length`)

    def request(self, ids: list[int], texts: list[str]) -> Request:
        k = len(texts)
        later = self.job.turns - 1 - k  # turns after this one
        params = self.params if k == 0 else replace(self.params, seed=turn_seed(self.params.seed or 0, k))
        reserve = later * (self.params.max_new_tokens + TURN_SLACK) + self.extra * later // max(1, self.job.turns - 1)
        next_turn: Callable | None = (lambda sample, out, reason: self.next_turn(texts, out)) if later else None
        return Request(self.order, ids, params, stop=self.stop, grammar=self.grammar, adapter=self.adapter,
                       next_turn=next_turn, reserve=reserve)

    def next_turn(self, texts: list[str], out: list[int]) -> Request:
        """The turn after these texts and this turn's generated ids."""
        text, _ = self.tokenizer.completion_text(out, self.job.stop)
        texts = [*texts, text]
        try:
            ids = encode_turn(self.tokenizer, self.job, texts)
        except TokenizerError as e:
            raise TurnError(f"turn {len(texts) + 1} cannot be rendered: {e}") from None
        if self.window is not None and len(ids) + self.params.max_new_tokens > self.window:
            raise TurnError(f"turn {len(texts) + 1}'s prompt of {len(ids)} tokens + max_new_tokens "
                            f"{self.params.max_new_tokens} exceeds the model's context window of {self.window}")
        return self.request(ids, texts)


def first_request(order: int, job: Job, ids: list[int], tokenizer: Tokenizer, window: int | None,
                  params: SamplingParams, adapter: int, stop: StopCheck | None,
                  grammar: MatcherFactory | None) -> Request:
    """A conversation job's first turn's request, which makes each next turn as it ends."""
    extra = max(0, full_length(tokenizer, job) - len(ids))
    return Conversation(order, job, tokenizer, window, params, adapter, stop, grammar, extra).request(ids, [])
