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
    """Reference attention of q over (k, v) in float32: (normalized output, log-sum-exp)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling  # (..., Q, K)
    if mask is not None:
        scores = scores + mask
    m = scores.amax(dim=-1, keepdim=True)  # (..., Q, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    l = p.sum(dim=-1, keepdim=True)
    return torch.matmul(p, v.float()) / l, m + l.log()


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """PyTorch's fused attention kernels, which also return the log-sum-exp: q (1, H, Q, D), k/v (1, H, P, D).

    Fused, they never hold the (Q x P) scores and read the prefix K/V once per block of queries:
    on this 2-core CPU the prefix part takes a third of the matmul version's time.
    """
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    elif q.dtype in (torch.float16, torch.bfloat16):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)[:2]
    return o, lse[..., : q.shape[2], None].float()  # the CUDA kernel pads the LSE's query dim to 32


_FUSED_OK: dict[tuple[str, torch.dtype, int], bool] = {}


def _fused_ok(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Check the fused kernel once per device type, dtype and head size against the reference;
    else use matmuls. The fused ops are private ATen ops whose signatures may move between torch
    releases, and GPU kernels have head-size and architecture limits: a kernel that is missing or
    disagrees costs speed, never correctness."""
    key = (device.type, dtype, head_dim)
    if key not in _FUSED_OK:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, n, head_dim, generator=g).to(device, dtype) for n in (37, 301, 301))
        try:
            o, lse = _fused(q, k, v, head_dim ** -0.5)
            ro, rlse = _partial(q, k, v, None, head_dim ** -0.5)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            _FUSED_OK[key] = bool(torch.allclose(o.float(), ro, atol=tol) and torch.allclose(lse, rlse, atol=tol))
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            _FUSED_OK[key] = False
    return _FUSED_OK[key]


def _prefix_part(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, scale: float):
    """q (b, Hq, Q, D) of rows that share one prefix (1, Hkv, P, D): (output, log-sum-exp) in float32.

    The fused kernel takes all rows in one call; the matmul reference goes in row chunks, since a
    long suffix over a long prefix would otherwise hold rows x Q x P scores."""
    b, hq, q_len, d = q.shape
    key = (q.device.type, q.dtype, d)
    if _fused_ok(q.device, q.dtype, d):
        try:
            return _grouped(q, pk, pv, scale, _fused)
        except torch.OutOfMemoryError:
            raise  # the engine splits the batch
        except RuntimeError:  # a shape the kernel refuses: the reference from now on
            _FUSED_OK[key] = False
    step = max(1, _QUERY_ROWS // (hq // pk.shape[1] * q_len))
    parts = [_grouped(q[s : s + step], pk, pv, scale, _reference) for s in range(0, b, step)]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def _reference(q, k, v, scale):
    return _partial(q, k, v, None, scale)


def _grouped(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, scale: float, attend):
    """All rows' queries, grouped per KV head, against the one prefix copy: (1, Hkv, b*G*Q, D)."""
    b, hq, q_len, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qp = q.view(b, hkv, g, q_len, d).permute(1, 0, 2, 3, 4).reshape(1, hkv, b * g * q_len, d)
    o, lse = attend(qp, pk, pv, scale)  # (1, Hkv, b*G*Q, .)

    def back(t):
        return t.reshape(hkv, b, g, q_len, -1).permute(1, 0, 2, 3, 4).reshape(b, hq, q_len, -1)

    return back(o.float()), back(lse)


def cascade_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query (B, Hq, Q, D); key/value: each row's own tokens (B, Hkv, L, D); returns (B, Q, Hq, D)."""
    b, hq, q_len, d = query.shape
    hkv = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5

    # prefix part: each run of rows against one copy of its prefix (rows without one: weight 0)
    o1 = query.new_zeros(b, hq, q_len, value.shape[-1], dtype=torch.float32)
    lse1 = query.new_full((b, hq, q_len, 1), float("-inf"), dtype=torch.float32)
    for start, end, layers in _state.segments:
        if layers is not None:
            pk, pv = layers[module.layer_idx]
            o1[start:end], lse1[start:end] = _prefix_part(query[start:end], pk, pv, scale)

    # own part: each row against its own keys, under the engine's position-space mask
    qo = query.view(b, hkv, hq // hkv, q_len, d)
    mask = attention_mask[:, :, None] if attention_mask is not None else None  # (B, 1, 1, Q, L)
    o2, lse2 = _partial(qo, key[:, :, None], value[:, :, None], mask, scale)
    o2, lse2 = o2.reshape(b, hq, q_len, -1), lse2.reshape(b, hq, q_len, 1)

    # merge the two normalized softmaxes exactly by their log-sum-exps
    w1 = torch.sigmoid(lse1 - lse2)  # = e^lse1 / (e^lse1 + e^lse2), 0 for rows without a prefix
    out = o2 + (o1 - o2) * w1  # (B, Hq, Q, D)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cascade_attention)
