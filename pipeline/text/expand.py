"""A job as the engine's requests, and how many completions finish it: the one place where a job
becomes requests, for the streaming runner and the Python API alike.

- A generating job is one request (its samples are its completions): with `logprobs`, the
  request reports each generated token's logprob; with `prompt_logprobs`, it scores its prompt
  from the second token on (`score_from=1`), in the same prefill.
- A scoring job (`continuations`) is one request per continuation, keyed (order, i), each
  context + continuation scoring the continuation's tokens (pipeline/text/scoring.py). Nothing is
  generated. A prompt's pairs are split the lm-eval-harness way (`Tokenizer.encode_pair`: the
  context's trailing spaces move into the continuation); a chat job's context is its rendered
  chat template as a generating job gets it, generation prompt and the whitespace after it
  included, and each continuation is the reply's tokens after it (`Tokenizer.encode_reply`): it
  is scored as the assistant's reply.
- A `prompt_logprobs` job with max_new_tokens 0 scores its prompt only: one request keyed
  (order, 0), or, when the prompt is longer than the context window, one per rolling window.

The prefix index holds one token list per job (`index_entry`): the tokens its requests' shared
prefix may hold and one more (a generating job's prompt, a scoring job's context, a prompt scored
alone but its last token), so that a job's requests stay in one group, with their shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from batchgen.jobs import InvalidRow, Job
from batchgen.pipeline.text.scoring import continuation_requests, prompt_requests
from batchgen.pipeline.text.tokenize import Tokenizer, TokenizerError
from batchgen.pipeline.text.turns import first_request
from batchgen.pipeline.engine.types import Completion, Request, RequestShape, SamplingParams, fed_length


@dataclass
class JobTokens:
    """A job's token ids: its prompt's, or a scoring job's context's (what the prefix index holds)
    and, for a scoring job, each (context, continuation) pair."""

    ids: list[int]
    pairs: list[tuple[list[int], list[int]]] | None = None


def tokenize_jobs(tokenizer: Tokenizer, jobs: Sequence[Job]) -> list[JobTokens | TokenizerError]:
    """Every job's tokens: prompts in one batch call, scoring jobs' pairs one by one (each pair is
    encoded whole and split, which a batch of prompts cannot do)."""
    encoded = tokenizer.encode_many([j.prompt for j in jobs], [j.messages for j in jobs])
    out: list[JobTokens | TokenizerError] = []
    for job, ids in zip(jobs, encoded):
        if isinstance(ids, TokenizerError) or not job.is_scoring:
            out.append(ids if isinstance(ids, TokenizerError) else JobTokens(ids))
            continue
        try:
            if job.prompt is not None:
                pairs = [tokenizer.encode_pair(job.prompt, c) for c in job.continuations]
            else:  # scored as the assistant's reply: after the generation prompt, whitespace and all
                rendered, pairs = tokenizer.render(job.messages), []
                for i, c in enumerate(job.continuations):
                    try:
                        pairs.append(tokenizer.encode_reply(rendered, c))
                    except TokenizerError as e:
                        raise TokenizerError(f"field 'continuations[{i}]': {e}") from None
        except TokenizerError as e:
            out.append(e)
            continue
        out.append(JobTokens(pairs[0][0], pairs))
    return out


def token_problem(job: Job, tokens: JobTokens, window: int | None) -> InvalidRow | None:
    """What the job's tokens cannot do: an empty prompt, a continuation of no tokens, more tokens
    than the context window holds (a prompt scored alone is scored in rolling windows instead)."""
    def bad(reason: str) -> InvalidRow:
        return InvalidRow(job.location, job.id, reason)

    if tokens.pairs is None:
        return length_problem(job, len(tokens.ids), window)
    for i, (ctx, cont) in enumerate(tokens.pairs):
        if not ctx:  # the first continuation token needs a token before it to be predicted from
            return bad("the prompt tokenizes to no tokens: a continuation is scored given a non-empty context")
        if not cont:
            return bad(f"field 'continuations[{i}]' tokenizes to no tokens after the prompt; give it some text")
        if window is not None and len(ctx) + len(cont) > window:
            return bad(f"field 'continuations[{i}]': prompt + continuation are {len(ctx) + len(cont)} tokens, "
                       f"more than the model's context window of {window}; shorten them")
    return None


def length_problem(job: Job, length: int, window: int | None) -> InvalidRow | None:
    """What a generating job's prompt of `length` tokens cannot do (token_problem's check of it;
    preflight asks it alone for prompts it holds as counts)."""
    def bad(reason: str) -> InvalidRow:
        return InvalidRow(job.location, job.id, reason)

    if not length:
        return bad("the prompt tokenizes to no tokens")
    if job.max_new_tokens == 0:  # scored in rolling windows when longer than the context window
        return bad("the prompt is one token: with max_new_tokens 0 there is nothing to score (the first "
                   "token has no logprob); generate some tokens or give a longer prompt") if length < 2 else None
    if window is not None and length + job.max_new_tokens > window:
        return bad(f"prompt of {length} tokens + max_new_tokens {job.max_new_tokens} exceeds the "
                   f"model's context window of {window}; shorten the prompt or lower max_new_tokens")
    return None


def sampling_params(job: Job, seed: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=job.max_new_tokens, temperature=job.temperature, top_p=job.top_p, top_k=job.top_k,
        seed=seed, n=job.n, logit_bias=job.logit_bias, repetition_penalty=job.repetition_penalty,
        presence_penalty=job.presence_penalty, frequency_penalty=job.frequency_penalty,
        min_tokens=job.min_tokens, stop_token_ids=job.stop_token_ids,
        logprobs=job.top_logprobs if job.logprobs else None)


def job_requests(order: int, job: Job, tokens: JobTokens, tokenizer: Tokenizer, window: int | None,
                 seed: int, adapter: int = 0) -> list[Request]:
    """The requests of a checked job (`token_problem` and the generation checks passed); `seed`
    is the job's (its own, or the one the run gives it); `adapter` the index of its adapter
    (pipeline/run/adapters.py; 0: the base model)."""
    requests = token_requests(order, job, tokens, window, seed)
    for r in requests:
        r.adapter = adapter
    if tokens.pairs is None and job.max_new_tokens:  # a generating job: how its samples stop
        request = requests[0]
        request.stop = tokenizer.stop_check(job.stop)
        # compiled once per distinct constraint (the generation checks just did)
        request.grammar = tokenizer.grammars.factory(job.constraint) if job.constraint is not None else None
        if job.then is not None:  # a conversation: each turn's request makes the next (pipeline/text/turns.py)
            requests[0] = first_request(order, job, request.prompt_ids, tokenizer, window, request.params, adapter,
                                        request.stop, request.grammar)
    return requests


def token_requests(order: int, job: Job, tokens: JobTokens, window: int | None, seed: int) -> list[Request]:
    """`job_requests` without a generating job's stop check and grammar: the token ids, parameters
    and sharing of each request, which is all the engine's plan reads."""
    if tokens.pairs is not None:
        return continuation_requests(order, tokens.pairs)
    if job.max_new_tokens == 0:
        return prompt_requests(order, tokens.ids, window)
    return [Request(order, tokens.ids, sampling_params(job, seed), score_from=_echo_from(job))]


def _echo_from(job: Job) -> int | None:
    """Where a generating job scores its prompt from: the second token, when it asks."""
    return 1 if job.prompt_logprobs else None


def index_entry(job: Job, tokens: JobTokens, window: int | None) -> tuple[list[int], list[RequestShape]]:
    """What the prefix index holds of a checked job, from the very requests the engine will get
    (so `batchgen plan` plans what `process` runs): its key, the tokens that all its requests'
    shared prefix may hold plus one (the index's tree holds each key but its last token, as the
    engine's tree holds each request's `shared_len` tokens), and each request's shape. A
    generating job's one request is not built (a million of them take seconds): its shape comes
    from the same rules (`types.fed_length`, `shared_length`), and the tests hold the two equal."""
    if whole_key(job):
        return tokens.ids, [_prompt_shape(job, len(tokens.ids))]
    requests = token_requests(0, job, tokens, window, seed=0)
    shared = {r.shared_len for r in requests}
    if len(shared) != 1:  # the request builders cap sharing (`Request.shareable`) so that this holds
        raise AssertionError(f"the requests of job {job.id!r} stop at different nodes of the tree: {shared}")
    return tokens.ids[: shared.pop() + 1], [r.shape for r in requests]


def _prompt_shape(job: Job, length: int) -> RequestShape:
    """A generating job's request's shape: its prompt of `length` tokens, all run; it shares all
    but the last (`shared_length`), so its key is its whole prompt."""
    return RequestShape(length, fed_length(length, job.max_new_tokens, _echo_from(job)), job.max_new_tokens, job.n)


def plain_entries(template: Job, prompts: list[list[int]], window: int | None
                  ) -> tuple[list[list[int]], list[list[RequestShape]]]:
    """`index_entry` of each plain row's job (`template` with that prompt), for a million rows."""
    if not whole_key(template):
        entries = [index_entry(template, JobTokens(ids), window) for ids in prompts]
        return [key for key, _ in entries], [shapes for _, shapes in entries]
    return prompts, [[_prompt_shape(template, len(ids))] for ids in prompts]


def plain_shapes(template: Job, lengths: np.ndarray) -> RequestShape:
    """`_prompt_shape` of each plain row's generating job (`whole_key(template)`), as arrays."""
    return RequestShape(lengths, fed_length(lengths, template.max_new_tokens, _echo_from(template)),
                        np.full(len(lengths), template.max_new_tokens, np.int64), np.full(len(lengths), template.n, np.int64))


def whole_key(job: Job) -> bool:
    """Whether a job's index key is all its tokens (a generating job's prompt): the runner makes
    the requests of other jobs from their text again (the spool keeps it), as preflight did."""
    return not job.is_scoring and job.max_new_tokens > 0


def completions_expected(requests: Sequence[Request]) -> int:
    """Completions that finish a job with these requests: each request's samples."""
    return sum(r.params.n if r.params.max_new_tokens else 1 for r in requests)


def order_of(key: Hashable) -> int:
    """The job (its input position) a completion belongs to: requests of one job are keyed
    (order, i), a generating job's request by its order."""
    return key[0] if isinstance(key, tuple) else key  # type: ignore[index,return-value]


class JobCompletions:
    """The engine's completions gathered by job: `add` gives a job's completions (in the order
    they came) once its last one is in (each sample, continuation or window:
    `completions_expected`), so that no job is ever handed on with part of its samples."""

    def __init__(self, expected: Mapping[int, int]) -> None:
        self.expected = expected  # completions that finish each job, by input position
        self.pending: dict[int, list[Completion]] = {}

    def add(self, completion: Completion) -> tuple[int, list[Completion]] | None:
        order = order_of(completion.key)
        got = self.pending.setdefault(order, [])
        got.append(completion)
        if len(got) < self.expected[order]:
            return None
        return order, self.pending.pop(order)


def finished_jobs(completions: Iterable[Completion],
                  expected: Mapping[int, int]) -> Iterator[tuple[int, list[Completion]]]:
    """(input position, completions) of each job as its last completion comes (`JobCompletions`)."""
    jobs = JobCompletions(expected)
    for c in completions:
        done = jobs.add(c)
        if done is not None:
            yield done
