"""LoRA adapters applied in a forward, the S-LoRA/Punica segmented way: every projection runs its
base GEMM over all of a step's tokens, then each adapter present adds its low-rank update into its
own tokens' rows, `y[idx_a] += scaling_a * (x[idx_a] @ A_a.T) @ B_a.T`. Rows of any number of
adapters (and of the base model) thus share one forward, and a step of base tokens alone does
no extra work: its `Step.lora` is empty, so no code here runs.

The arithmetic is peft's (`peft.tuners.lora.Linear.forward`, not merged): the input cast to the
adapter's dtype, `B(A x) * scaling` in it, added to the base output in the wider of the two
dtypes, cast back. Adapter weights are float32 for a half-precision model, as peft's loader keeps
them (`autocast_adapter_dtype`), so a bfloat16 model adds a float32 update to its bfloat16 output.

A model code groups the projections it runs as one GEMM: batchgen's decoder fuses q, k and v
(`DECODER_GROUPS`), so one adapter's q/k/v matrices become one A (their rows stacked: they read the
same input) and one block-diagonal B whose blocks land in q's, k's and v's column slices of the
fused output (a projection the adapter leaves alone gets zero rows). transformers' model code
runs each projection apart (`SINGLE_GROUPS`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pipeline.model.adapter_files import TARGETS, AdapterError, AdapterInfo, base_shape, inspect_adapter

DECODER_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate": ("gate_proj",),
                  "up": ("up_proj",), "down": ("down_proj",)}
SINGLE_GROUPS = {p: (p,) for p in TARGETS}
_PREFIX = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"
_PART = {p: "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for p in TARGETS}

# per forward: (adapter index >= 1, the indices of its tokens: a slice where they are consecutive)
Lora = list[tuple[int, "torch.Tensor | slice"]]


@dataclass
class Update:
    """One adapter's update of one group of projections (fused output of width `sum(out)`)."""

    a: torch.Tensor  # (R, in): the group's A matrices stacked, R = rank x projections it updates
    b: torch.Tensor  # (out, R): their B matrices on the diagonal, zero elsewhere
    scaling: float


class Adapters:
    """The adapters a model code was given (`set_adapters`), loaded: `updates[layer][group][a]` is
    adapter a's `Update` of that group, or None where it leaves the group alone (adapter 0, the
    base model, leaves every group alone)."""

    def __init__(self, infos: list[AdapterInfo], config: Any, groups: dict[str, tuple[str, ...]],
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = base_shape(config)
        self.count = len(infos)
        # peft keeps a half-precision model's adapters in float32; a float32 or float64 one's in its own dtype
        self.dtype = torch.promote_types(dtype, torch.float32)
        self.updates: list[dict[str, list[Update | None]]] = [
            {g: [None] for g in groups} for _ in range(shape.layers)]
        for info in infos:
            checked = inspect_adapter(info.path, config)  # the files as they are now, against this model
            if checked.digest != info.digest:
                raise AdapterError(f"adapter {info.path}: its files changed since they were checked")
            tensors = _read(checked.path)
            for layer, by_group in enumerate(self.updates):
                for g, projs in groups.items():
                    by_group[g].append(self._update(tensors, layer, projs, shape.shapes, checked, device))

    def _update(self, tensors: dict[str, torch.Tensor], layer: int, projs: tuple[str, ...],
                shapes: dict[str, tuple[int, int]], info: AdapterInfo, device: torch.device) -> Update | None:
        names = [(_PREFIX.format(layer, _PART[p], p, "A"), _PREFIX.format(layer, _PART[p], p, "B")) for p in projs]
        if not any(a in tensors for a, _ in names):
            return None
        a_parts, b_blocks, row = [], [], 0
        for p, (a_name, b_name) in zip(projs, names):
            if a_name in tensors:
                a_parts.append(tensors[a_name])
                b_blocks.append((row, tensors[b_name]))
            row += shapes[p][1]  # the projection's columns in the group's fused output
        r = info.rank
        b = torch.zeros(row, r * len(a_parts), dtype=self.dtype)
        for j, (start, block) in enumerate(b_blocks):  # block j: rows of its projection, columns of its A
            b[start : start + block.shape[0], j * r : (j + 1) * r] = block
        a = torch.cat(a_parts).to(self.dtype)
        return Update(a.to(device).contiguous(), b.to(device).contiguous(), info.scaling)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, lora: Lora) -> None:
        """Each adapter's update of `group` in `layer`, into `y` (T, out) in place, from its input x (T, in)."""
        updates = self.updates[layer][group]
        for a, idx in lora:
            u = updates[a]
            if u is None:
                continue
            xs = x[idx] if isinstance(idx, slice) else x.index_select(0, idx)  # (n, in)
            delta = F.linear(F.linear(xs.to(u.a.dtype), u.a), u.b) * u.scaling  # (n, out)
            if y.dtype == delta.dtype:
                if isinstance(idx, slice):
                    y[idx] += delta
                else:
                    y.index_add_(0, idx, delta)  # distinct indices: one addition per element, as y + delta
            else:  # the sum in the adapter's wider dtype, then cast: peft's `result + delta`, `.to(...)`
                delta += y[idx] if isinstance(idx, slice) else y.index_select(0, idx)
                if isinstance(idx, slice):
                    y[idx] = delta.to(y.dtype)
                else:
                    y.index_copy_(0, idx, delta.to(y.dtype))


def check(adapters: Adapters | None, lora: Lora) -> None:
    """A step's adapter indices are ones the model was given (`set_adapters`)."""
    count = adapters.count if adapters is not None else 0
    if lora and lora[-1][0] > count:
        raise AdapterError(f"a token runs adapter {lora[-1][0]}, but the model was given {count} adapters")


def _read(path: str) -> dict[str, torch.Tensor]:
    """The adapter's LoRA matrices (on the CPU; `inspect_adapter` has checked every name and shape)."""
    with safe_open(f"{path}/adapter_model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def token_groups(adapters: list[tuple[int, range | list[int]]], device: torch.device) -> Lora:
    """`Step.lora` from each token run's adapter index (decode tokens one by one, a segment's
    tokens as a range), in token order: per adapter > 0, its token indices."""
    runs: dict[int, list[int]] = {}
    for a, tokens in adapters:
        if a:
            runs.setdefault(a, []).extend(tokens)
    out: Lora = []
    for a in sorted(runs):
        idx = runs[a]  # ascending and distinct: tokens come in order
        run = idx[-1] - idx[0] + 1 == len(idx)
        out.append((a, slice(idx[0], idx[-1] + 1) if run else torch.tensor(idx, dtype=torch.long, device=device)))
    return out
