"""Shared-prefix (cascade) attention: a group's prefix K/V is stored once and read once per step.

For a batch whose rows all continue one cached prefix, each layer's attention is split in two:
the queries of every row against the single prefix K/V (one matmul for the whole batch), and each
row against its own keys (the rest of its prefix, its suffix, its generated tokens). The two
partial softmaxes are merged exactly with their log-sum-exp, as in vLLM's cascade attention,
FlashInfer and Hydragen. It plugs into transformers through the attention-function registry, so
the model code stays Hugging Face's.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import AttentionInterface

NAME = "batchgen_cascade"
_state = threading.local()  # the prefix K/V of the forward in flight, one (k, v) per layer


def supports(model: torch.nn.Module) -> str | None:
    """None if the fast path can serve this model, else why not (the run falls back to copies)."""
    config = model.config
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        return "attention logit soft-capping"
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "") == "alibi":
        return "ALiBi position bias"
    if config._attn_implementation not in ("sdpa", "eager"):
        return f"attention implementation {config._attn_implementation!r}"
    if not any(hasattr(m, "layer_idx") for m in model.modules()):
        return "attention layers without a layer index"
    return None


def window_allows(config, max_position: int) -> bool:
    """A sliding window is fine while every query still sees the whole prefix."""
    window = getattr(config, "sliding_window", None)
    return window is None or max_position < window


@contextmanager
def active(model: torch.nn.Module, prefix_layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Route the model's attention through the cascade for one forward."""
    config = model.config
    previous = config._attn_implementation
    _state.prefix = prefix_layers
    _state.fallback = previous
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
        _state.prefix = None


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float):
    """Unnormalized attention of q over (k, v): (output, running max, sum of exp), all float32."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # (..., Q, K)
    if mask is not None:
        scores = scores + mask
    m = scores.amax(dim=-1, keepdim=True)  # (..., Q, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    return torch.matmul(p, v), m, p.sum(dim=-1, keepdim=True)


def cascade_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query (B, Hq, Q, D); key/value: each row's own part (B, Hkv, L, D); returns (B, Q, Hq, D)."""
    pk, pv = _state.prefix[module.layer_idx]  # (1, Hkv, P, D): the shared prefix, once
    b, hq, q_len, d = query.shape
    hkv = pk.shape[1]
    groups = hq // hkv
    scale = scaling if scaling is not None else d ** -0.5
    q = query.float()

    # prefix part: every query of every row against one copy of the prefix keys
    qp = q.view(b, hkv, groups, q_len, d).permute(1, 0, 2, 3, 4).reshape(1, hkv, b * groups * q_len, d)
    o1, m1, l1 = _partial(qp, pk.float(), pv.float(), None, scale)  # (1, Hkv, B*G*Q, D)
    o1 = o1.reshape(hkv, b, groups, q_len, -1).permute(1, 0, 2, 3, 4).reshape(b, hq, q_len, -1)
    m1 = m1.reshape(hkv, b, groups, q_len, 1).permute(1, 0, 2, 3, 4).reshape(b, hq, q_len, 1)
    l1 = l1.reshape(hkv, b, groups, q_len, 1).permute(1, 0, 2, 3, 4).reshape(b, hq, q_len, 1)

    # own part: each row against its own keys, under the engine's position-space mask
    qo = q.view(b, hkv, groups, q_len, d)
    mask = attention_mask[:, :, None] if attention_mask is not None else None  # (B, 1, 1, Q, L)
    o2, m2, l2 = _partial(qo, key.float()[:, :, None], value.float()[:, :, None], mask, scale)
    o2, m2, l2 = (t.reshape(b, hq, q_len, -1) for t in (o2, m2, l2))

    # merge the two softmaxes exactly
    m = torch.maximum(m1, m2)
    w1, w2 = l1 * torch.exp(m1 - m), l2 * torch.exp(m2 - m)
    out = (o1 * torch.exp(m1 - m) + o2 * torch.exp(m2 - m)) / (w1 + w2)  # (B, Hq, Q, D)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cascade_attention)
