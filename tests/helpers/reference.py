"""The reference path: plain uncached `model.generate`, one job at a time.

Slow on purpose (no sharing, no batching); tests and the bench compare the engine against it.
"""
from __future__ import annotations

import copy
from typing import Iterable

import torch
from transformers import GenerationConfig

from batchgen.pipeline.engine.types import Request


@torch.inference_mode()
def reference_generate(model, request: Request, eos_token_ids: Iterable[int]) -> list[int]:
    """Greedy continuation token ids of one request (EOS included, as the engine reports it)."""
    eos = list(eos_token_ids)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=request.params.max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )
    device = next(model.parameters()).device
    ids = torch.tensor([request.prompt_ids], device=device)  # (1, P)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, ids.shape[1] :].tolist()


def bf16_tie(model, prompt, want, got) -> bool:
    """At the first token where got and want part, are the two tokens tied at bfloat16 precision:
    their logits in the reference's own bfloat16 forward closer than that forward's own error
    there (its largest distance from the float32 forward of the same weights over the vocabulary),
    or within two units in the last place? Greedy runs that both round in bfloat16 part at such
    near-ties, the reference's kernels and batchgen's rounding differently (measured on tiny models:
    gaps of up to 6 units in the last place, at most 0.91 of that error)."""
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:  # one is a prefix of the other: an EOS chosen on one side only is a tie too
        i = min(len(got), len(want))
        if i >= len(want) or i >= len(got):
            return False
    ids = torch.tensor([prompt + want[:i]], device=next(model.parameters()).device)
    with torch.inference_mode():
        logits = model(ids).logits[0, -1].float()
        exact = copy.deepcopy(model).float()(ids).logits[0, -1]
    a, b = logits[want[i]].item(), logits[got[i]].item()
    ulp = 2.0 ** (torch.frexp(torch.tensor(max(abs(a), abs(b)))).exponent.item() - 8)  # bfloat16: 8-bit significand
    return abs(a - b) <= max(2 * ulp, (logits - exact).abs().max().item())
