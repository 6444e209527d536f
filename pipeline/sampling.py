"""Choosing the next token of each row, with a per-row generator.

Each sample draws from its own generator seeded from (job seed, sample index), so its text
does not depend on which rows share its batch or in what order they run.
"""
from __future__ import annotations

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


def sample(
    logits: torch.Tensor,  # (B, V)
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:  # (B,) token ids
    tokens = logits.argmax(dim=-1)  # (B,) greedy for every row; sampled rows overwrite below
    for r, p in enumerate(params):
        if p.greedy:
            continue
        row = _warpers(p.temperature, p.top_k, p.top_p)(None, logits[r : r + 1].float())  # (1, V)
        probs = torch.softmax(row, dim=-1)
        tokens[r] = torch.multinomial(probs, 1, generator=generators[r])[0, 0]
    return tokens
