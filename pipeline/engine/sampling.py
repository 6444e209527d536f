"""Choosing the next token of each row: one `RowState` per sample, its logits processors, and one
batched `sample` call per step over the rows that have logits.

Each sample draws from its own generator seeded from (job seed, sample index), so its text
does not depend on which rows share its batch or in what order they run. Before choosing, the
rows' logits processors run, each one vectorized over the rows that use it, in the order
transformers' `generate` applies its processors:

    logit_bias           SequenceBiasLogitsProcessor (single-token sequences): bias added
    repetition_penalty   RepetitionPenaltyLogitsProcessor: tokens of the prompt and of the output
                         divided by the penalty (multiplied where negative)
    presence/frequency   OpenAI's: minus presence_penalty if the token is in the output, minus
                         frequency_penalty times its count there (after repetition, as vLLM does)
    min_tokens           MinNewTokensLengthLogitsProcessor: EOS (and stop_token_ids) at -inf until
                         min_tokens new tokens
    grammar              tokens the row's grammar does not allow at -inf (pipeline/engine/constrain.py)

Temperature, top-k and top-p come after (transformers' warpers). A row none of these touch costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from batchgen.pipeline.engine.constrain import allowed_tokens
from batchgen.pipeline.engine.types import Request, SamplingParams

if TYPE_CHECKING:
    from batchgen.pipeline.engine.constrain import Matcher

_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, sample) pairs over the 64-bit seed space
_MASK = (1 << 63) - 1


def row_seed(seed: int, sample_index: int) -> int:
    return (seed * 1_000_003 + (sample_index + 1) * _GOLDEN) & _MASK


def make_generator(seed: int, sample_index: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(row_seed(seed, sample_index))
    return gen


def warp(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper make of
    scores (1, V), in the order its `generate` applies them, op for op (a test compares them): a
    sampled run need not import transformers for three lines each."""
    scores = scores / temperature
    if top_k > 0:
        k = min(top_k, scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], NEG_INF)
    if top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        remove[..., -1:] = 0  # min_tokens_to_keep=1
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), NEG_INF)
    return scores


@dataclass
class RowState:
    """What choosing one sample's tokens needs: its parameters, its generator, what it generated,
    and what its processors keep (the prompt for the repetition penalty, its grammar matcher)."""

    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    prompt: Sequence[int] = ()
    ends: frozenset[int] = frozenset()  # tokens that end it: EOS and its stop_token_ids
    matcher: Matcher | None = None
    error: str | None = None  # why it cannot go on (its grammar reached a dead end, or ended before min_tokens)
    _seen: torch.Tensor | None = None  # (V,) bool: prompt and output tokens (repetition penalty)
    _counts: torch.Tensor | None = None  # (V,) output token counts (presence/frequency penalties)

    def accept(self, token: int) -> None:
        self.tokens.append(token)
        if self._seen is not None and token < self._seen.shape[0]:
            self._seen[token] = True
        if self._counts is not None and token < self._counts.shape[0]:
            self._counts[token] += 1
        if self.matcher is not None and token not in self.ends:
            self.matcher.accept(token)
            if len(self.tokens) < self.params.min_tokens and self.matcher.done:
                # min_tokens holds back EOS, but a complete text that allows nothing more ends here
                self.error = (f"its constraint's text is complete after {len(self.tokens)} tokens, before "
                              f"min_tokens ({self.params.min_tokens}): it allows no more; lower min_tokens")

    @property
    def finished(self) -> bool:
        """Its grammar is complete and allows nothing more."""
        return self.matcher is not None and self.matcher.done

    def seen(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._seen is None:  # built on first use, when the vocabulary size is known
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = [t for t in (*self.prompt, *self.tokens) if t < vocab]  # as transformers: ids past it are dropped
            self._seen[torch.tensor(ids, dtype=torch.long, device=device)] = True
        return self._seen

    def counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._counts is None:
            ids = torch.tensor([t for t in self.tokens if t < vocab], dtype=torch.long, device=device)
            self._counts = torch.bincount(ids, minlength=vocab).float()
        return self._counts


def row_state(params: SamplingParams, seed: int, sample_index: int, device: torch.device,
              request: Request | None = None, eos: Iterable[int] = ()) -> RowState:
    """A sample's state; with its request, what its processors need (prompt, EOS, a fresh matcher)."""
    state = RowState(params, None if params.greedy else make_generator(seed, sample_index, device))
    if request is not None:
        state.prompt = request.prompt_ids
        state.ends = frozenset(eos) | frozenset(params.stop_token_ids)
        state.matcher = request.grammar() if request.grammar is not None else None
    return state


# -- logits processors ------------------------------------------------------------------

NEG_INF = float("-inf")


def process(logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
    """Apply every row's processors to its logits (B, V), in place; returns them."""
    _bias(logits, rows)
    _penalties(logits, rows)
    _min_tokens(logits, rows)
    _grammar(logits, rows)
    return logits


def _pairs(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.tensor(pairs, dtype=torch.long, device=logits.device).reshape(-1, 2)
    return idx[:, 0], idx[:, 1]


def _bias(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
    pairs, values = [], []
    for i, r in enumerate(rows):
        for token, bias in r.params.logit_bias:
            if token < logits.shape[1]:  # preflight refuses ids past the vocabulary
                pairs.append((i, token))
                values.append(bias)
    if pairs:
        at = _pairs(logits, pairs)
        logits.index_put_(at, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def _penalties(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
    which = [i for i, r in enumerate(rows) if r.params.penalized]
    if not which:
        return
    vocab, device = logits.shape[1], logits.device
    sub = logits[which]  # (R, V)
    params = [rows[i].params for i in which]
    rep = [k for k, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        seen = torch.stack([rows[which[k]].seen(vocab, device) for k in rep])  # (R', V) prompt + output
        penalty = torch.tensor([params[k].repetition_penalty for k in rep], dtype=sub.dtype, device=device)[:, None]
        part = sub[rep]
        sub[rep] = torch.where(seen, torch.where(part < 0, part * penalty, part / penalty), part)
    freq = [k for k, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if freq:
        counts = torch.stack([rows[which[k]].counts(vocab, device) for k in freq])  # (R', V) output only
        f = torch.tensor([params[k].frequency_penalty for k in freq], dtype=sub.dtype, device=device)[:, None]
        p = torch.tensor([params[k].presence_penalty for k in freq], dtype=sub.dtype, device=device)[:, None]
        sub[freq] = sub[freq] - f * counts - p * (counts > 0).to(sub.dtype)
    logits[which] = sub


def _min_tokens(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
    pairs = [(i, t) for i, r in enumerate(rows) if len(r.tokens) < r.params.min_tokens
             for t in r.ends if t < logits.shape[1]]
    if pairs:
        logits.index_put_(_pairs(logits, pairs), torch.tensor(NEG_INF, dtype=logits.dtype, device=logits.device))


def _grammar(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
    which = [i for i, r in enumerate(rows) if r.matcher is not None]
    if not which:
        return
    allowed = allowed_tokens([rows[i].matcher for i in which], logits.shape[1]).to(logits.device)  # (R, V)
    # a complete text may end: with EOS, which is whatever ends this model's rows (the grammar
    # knows only its tokenizer's EOS), and with the row's stop tokens
    ends = [(k, t) for k, i in enumerate(which) if rows[i].matcher.accepting for t in rows[i].ends
            if t < logits.shape[1]]
    if ends:
        allowed[_pairs(logits, ends)] = True
    # a matcher in its error state (no token can continue the text) allows nothing: the row fails
    broken = [k for k, i in enumerate(which) if rows[i].matcher.error is not None]
    if broken:
        allowed[broken] = False
    if len(which) == len(rows):  # every row constrained: in place, no copies of the rows
        logits.masked_fill_(~allowed, NEG_INF)
    else:
        logits[which] = logits[which].masked_fill(~allowed, NEG_INF)


# -- choosing -------------------------------------------------------------------------------

def _processed(row: RowState) -> bool:
    p = row.params
    return bool(row.matcher is not None or p.logit_bias or p.penalized or len(row.tokens) < p.min_tokens)


def sample(logits: torch.Tensor, rows: list[RowState], greedy: torch.Tensor | None = None) -> torch.Tensor:
    """The next token of each row: logits (B, V) -> token ids (B,). A row that no token can continue
    (its grammar, bias and min_tokens exclude them all) gets its `error` set (and token 0, which
    it never takes). The caller's logits are left as they are (logprobs are reported from them).
    `greedy`: the logits' argmax per row if the caller has it (B,), taken over as the result."""
    dead: list[int] = []
    if any(_processed(r) for r in rows):
        logits = process(logits.clone(), rows)
        dead = (~torch.isfinite(logits).any(dim=-1)).nonzero().flatten().tolist()
        greedy = None  # of the logits before processing
    tokens = logits.argmax(dim=-1) if greedy is None else greedy  # (B,) greedy for every row; sampled rows overwrite below
    for r, row in enumerate(rows):
        p = row.params
        if p.greedy or r in dead:
            continue
        warped = warp(logits[r : r + 1].float(), p.temperature, p.top_k, p.top_p)  # (1, V)
        probs = torch.softmax(warped, dim=-1)
        tokens[r] = torch.multinomial(probs, 1, generator=row.generator)[0, 0]
    for r in dead:
        tokens[r] = 0
        row = rows[r]
        if row.matcher is None:
            row.error = f"after {len(row.tokens)} tokens no token is left: logit_bias and min_tokens exclude them all"
        else:
            detail = f" (llguidance: {row.matcher.error})" if row.matcher.error else ""
            row.error = (f"its constraint reached a dead end after {len(row.tokens)} tokens: no token of this "
                         f"vocabulary can continue it{detail}")
    return tokens
