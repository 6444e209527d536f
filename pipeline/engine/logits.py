"""Per-row logits processors of the batched sampling step, each one vectorized over the rows that
use it, in the order transformers' `generate` applies its processors:

    logit_bias           SequenceBiasLogitsProcessor (single-token sequences): bias added
    repetition_penalty   RepetitionPenaltyLogitsProcessor: tokens of the prompt and of the output
                         divided by the penalty (multiplied where negative)
    presence/frequency   OpenAI's: minus presence_penalty if the token is in the output, minus
                         frequency_penalty times its count there (after repetition, as vLLM does)
    min_tokens           MinNewTokensLengthLogitsProcessor: EOS (and stop_token_ids) at -inf until
                         min_tokens new tokens
    grammar              tokens the row's grammar does not allow at -inf (pipeline/text/grammar.py)

Temperature, top-k and top-p come after (sampling.py). A row none of these touch costs nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from pipeline.engine.sampling import RowState

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
    from pipeline.text.grammar import allowed_tokens

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
