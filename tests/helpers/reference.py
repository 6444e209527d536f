"""The reference path: plain uncached `model.generate`, one job at a time.

Slow on purpose (no sharing, no batching); tests and the bench compare the engine against it.
"""
from __future__ import annotations

from typing import Iterable

import torch
from transformers import GenerationConfig

from pipeline.engine.types import Request


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
