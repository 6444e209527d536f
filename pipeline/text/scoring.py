"""Scoring jobs as engine requests, and their results, by lm-evaluation-harness's conventions.

- A job with `continuations` generates nothing: each continuation becomes one request, context +
  continuation, that scores the continuation's tokens (`Request.score_from`). All of a job's
  continuations share its context, and every job above them its few-shot header, in the radix tree:
  the header and each context are prefilled once, each continuation is a short suffix.
- A job with `prompt_logprobs` scores its prompt's tokens after the first. A prompt longer than the
  context window is scored in disjoint rolling windows, as lm-eval's `loglikelihood_rolling` does:
  the first window predicts all it can from the first token, each later one the next tokens given
  the ones just before them, up to the window's length.
- A scored token inside a shared prefix is scored once, when the prefix is prefilled, for every
  row below it (the engine's prefix scores): the few-shot header of a thousand prompt_logprobs
  jobs is scored once, as it is prefilled once.

Pure Python on token ids; the tokenizer splits context and continuation (`Tokenizer.encode_pair`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence

from batchgen.pipeline.engine.types import Completion, Request, SamplingParams


@dataclass(frozen=True)
class ContinuationScore:
    """One continuation: the sum of its tokens' logprobs given the context, their count, and
    whether greedy decoding would have produced every one of them."""

    logprob: float
    tokens: int
    is_greedy: bool


def continuation_requests(key: Hashable, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Request]:
    """One scoring request per (context ids, continuation ids), keyed (key, i). Their shared
    prefix stops before the context's last token: every continuation, one token long or more,
    runs that token itself, so all of a job's continuations read the same node of the tree."""
    return [Request((key, i), ctx + cont, SamplingParams(max_new_tokens=0), score_from=len(ctx),
                    shareable=len(ctx) - 1) for i, (ctx, cont) in enumerate(pairs)]


def continuation_scores(completions: Sequence[Completion]) -> list[ContinuationScore]:
    """The scores of one job's continuations, from their completions in any order."""
    ordered = sorted(completions, key=lambda c: c.key[1])
    return [ContinuationScore(sum(c.prompt_logprobs), len(c.prompt_logprobs), all(c.prompt_greedy)) for c in ordered]


def rolling_windows(tokens: Sequence[int], window: int) -> Iterator[tuple[list[int], list[int]]]:
    """(context, predicted) windows that predict tokens[1:] in order, each at most `window` tokens
    long in all: lm-eval's get_rolling_token_windows(tokens[1:], prefix_token=tokens[0],
    max_seq_len=window, context_len=1) made disjoint."""
    rest = list(tokens[1:])
    if not rest:
        return
    first = min(window, len(rest))
    yield [tokens[0]], rest[:first]  # disjoint: the first token is the whole context
    done = first
    while done < len(rest):
        n = min(len(rest) - done, window)
        end = done + n
        context = rest[max(0, end - window - 1) : end - 1]
        yield context[: len(context) - (n - 1)], rest[end - n : end]
        done = end


def prompt_requests(key: Hashable, tokens: Sequence[int], window: int | None) -> list[Request]:
    """Requests that score every token of `tokens` after the first, in windows of at most `window`
    tokens (all at once when it fits), keyed (key, i) in order. A prompt that fits may share a
    prefix with other jobs (its logprobs there are computed once); rolling windows share nothing:
    a later window's tokens do not start the prompt, and a job's requests stay at one node."""
    if window is None or len(tokens) <= window:
        return [Request((key, 0), list(tokens), SamplingParams(max_new_tokens=0), score_from=1)]
    return [Request((key, i), ctx + pred, SamplingParams(max_new_tokens=0), score_from=len(ctx), shareable=0)
            for i, (ctx, pred) in enumerate(rolling_windows(tokens, window))]


def prompt_scores(completions: Sequence[Completion]) -> tuple[list[float], list[bool]]:
    """The logprob of every scored prompt token, and whether each was the argmax, in order."""
    logprobs, greedy = [], []
    for c in sorted(completions, key=lambda c: c.key[1]):
        logprobs += c.prompt_logprobs
        greedy += c.prompt_greedy
    return logprobs, greedy
