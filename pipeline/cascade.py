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
_QUERY_ROWS = 512  # query rows per prefix matmul: bounds the score matrix to 512 x P floats
_state = threading.local()  # the forward in flight: runs of rows and the prefix K/V each continues


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


Segment = tuple[int, int, "list[tuple[torch.Tensor, torch.Tensor]] | None"]


def segments(row_nodes: list[int | None], prefixes) -> list[Segment]:
    """Runs of consecutive rows that continue one prefix: (first row, end row, its K/V layers)."""
    out: list[Segment] = []
    start = 0
    for i in range(1, len(row_nodes) + 1):
        if i == len(row_nodes) or row_nodes[i] != row_nodes[start]:
            node = row_nodes[start]
            out.append((start, i, prefixes[node].layers if node is not None else None))
            start = i
    return out


@contextmanager
def active(model: torch.nn.Module, segs: list[Segment]) -> Iterator[None]:
    """Route the model's attention through the cascade for one forward."""
    config = model.config
    previous = config._attn_implementation
    _state.segments = segs
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
        _state.segments = None


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float):
    """Unnormalized attention of q over (k, v): (output, running max, sum of exp), all float32."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # (..., Q, K)
    if mask is not None:
        scores = scores + mask
    m = scores.amax(dim=-1, keepdim=True)  # (..., Q, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    return torch.matmul(p, v), m, p.sum(dim=-1, keepdim=True)


def _prefix_part(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, scale: float):
    """q (b, Hq, Q, D) of rows that share one prefix (1, Hkv, P, D): one matmul for all of them."""
    b, hq, q_len, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qp = q.view(b, hkv, g, q_len, d).permute(1, 0, 2, 3, 4).reshape(1, hkv, b * g * q_len, d)
    o, m, l = _partial(qp, pk.float(), pv.float(), None, scale)  # (1, Hkv, b*G*Q, .)

    def back(t):
        return t.reshape(hkv, b, g, q_len, -1).permute(1, 0, 2, 3, 4).reshape(b, hq, q_len, -1)

    return back(o), back(m), back(l)


def cascade_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query (B, Hq, Q, D); key/value: each row's own tokens (B, Hkv, L, D); returns (B, Q, Hq, D)."""
    b, hq, q_len, d = query.shape
    hkv = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    q = query.float()

    # prefix part: each run of rows against one copy of its prefix (rows without one: nothing)
    o1 = q.new_zeros(b, hq, q_len, value.shape[-1])
    m1 = q.new_full((b, hq, q_len, 1), float("-inf"))
    l1 = q.new_zeros(b, hq, q_len, 1)
    # in row chunks: a long suffix prefill over a long prefix would otherwise hold (rows x Q x P) scores
    step = max(1, _QUERY_ROWS // (hq // hkv * q_len))
    for start, end, layers in _state.segments:
        if layers is not None:
            pk, pv = layers[module.layer_idx]
            for s in range(start, end, step):
                e = min(end, s + step)
                o1[s:e], m1[s:e], l1[s:e] = _prefix_part(q[s:e], pk, pv, scale)

    # own part: each row against its own keys, under the engine's position-space mask
    qo = q.view(b, hkv, hq // hkv, q_len, d)
    mask = attention_mask[:, :, None] if attention_mask is not None else None  # (B, 1, 1, Q, L)
    o2, m2, l2 = _partial(qo, key.float()[:, :, None], value.float()[:, :, None], mask, scale)
    o2, m2, l2 = (t.reshape(b, hq, q_len, -1) for t in (o2, m2, l2))

    # merge the two softmaxes exactly (a row without a prefix part gets weight 0 there)
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)  # (B, Hq, Q, D)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cascade_attention)
