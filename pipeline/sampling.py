"""Choosing the next token of each row: one `RowState` per sample, and one batched `sample` call
per step over the rows that have logits.

Each sample draws from its own generator seeded from (job seed, sample index), so its text
does not depend on which rows share its batch or in what order they run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from pipeline.types import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, sample) pairs over the 64-bit seed space
_MASK = (1 << 63) - 1


def row_seed(seed: int, sample_index: int) -> int:
    return (seed * 1_000_003 + (sample_index + 1) * _GOLDEN) & _MASK


def make_generator(seed: int, sample_index: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(row_seed(seed, sample_index))
    return gen


@lru_cache(maxsize=256)
def _warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs


@dataclass
class RowState:
    """What choosing one sample's tokens needs: its parameters, its generator, what it generated."""

    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)

    def accept(self, token: int) -> None:
        self.tokens.append(token)


def row_state(params: SamplingParams, seed: int, sample_index: int, device: torch.device) -> RowState:
    return RowState(params, None if params.greedy else make_generator(seed, sample_index, device))


def sample(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """The next token of each row: logits (B, V) -> token ids (B,)."""
    tokens = logits.argmax(dim=-1)  # (B,) greedy for every row; sampled rows overwrite below
    for r, row in enumerate(rows):
        p = row.params
        if p.greedy:
            continue
        warped = _warpers(p.temperature, p.top_k, p.top_p)(None, logits[r : r + 1].float())  # (1, V)
        probs = torch.softmax(warped, dim=-1)
        tokens[r] = torch.multinomial(probs, 1, generator=row.generator)[0, 0]
    return tokens
