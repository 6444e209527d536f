"""Attention masks built from each row's token positions, not from tensor indices.

Rows in a batch carry padding (after a short prefix, before a short suffix), so index-based
causal and sliding-window masks would be wrong; here a key is visible to a query iff it is a
real token, its position is not after the query's, and (sliding layers) within the window.
"""
from __future__ import annotations

import torch

PAD = -1  # position of a padding slot


def layer_kinds(config) -> dict[str, int | None]:
    """Mask kinds the model asks for, each with its window (None: full causal)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return {t: (window if t == "sliding_attention" else None) for t in set(types)}
    return {"single": window}


def build(
    q_pos: torch.Tensor,  # (B, Q) positions of the new tokens, PAD for padding
    kv_pos: torch.Tensor,  # (B, K) positions of every key slot including the new ones, PAD for padding
    kinds: dict[str, int | None],
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive float masks (B, 1, Q, K): 0 where attended, the dtype's min elsewhere."""
    q = q_pos[:, :, None]  # (B, Q, 1)
    k = kv_pos[:, None, :]  # (B, 1, K)
    real_k = k != PAD
    base = real_k & (k <= q)
    # padding queries see every real key: their output is unused, but must stay finite
    pad_q = q == PAD
    out = {}
    for name, window in kinds.items():
        allow = base if window is None else base & (q - k < window)
        allow = torch.where(pad_q, real_k, allow)
        m = torch.zeros(allow.shape, dtype=dtype, device=allow.device)
        m.masked_fill_(~allow, torch.finfo(dtype).min)
        out[name] = m[:, None]  # (B, 1, Q, K)
    return out["single"] if "single" in out else out
