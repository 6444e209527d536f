"""LoRA adapters applied in a forward, the S-LoRA/Punica segmented way: every projection runs its
base GEMM over all of a step's tokens, then each adapter present adds its low-rank update into its
own tokens' rows, `y[idx_a] += scaling_a * (x[idx_a] @ A_a.T) @ B_a.T`. Rows of any number of
adapters (and of the base model) thus share one forward, and a step of base tokens alone does
no extra work: its `Step.lora` is empty, so no code here runs. With several adapters present,
their updates run as one batched GEMM pair per projection (`Plan`), not a loop over adapters:
on a CPU each small op's dispatch costs more than its arithmetic.

The arithmetic is peft's (`peft.tuners.lora.Linear.forward`, not merged) but for the order of
roundings: the input cast to the adapter's dtype, `(scaling B)(A x)` in it (the scaling folded
into B at load: no multiply per forward), added to the base output in the wider of the two
dtypes, then cast back. Adapter weights are float32 for a half-precision model, as peft's loader
keeps them (`autocast_adapter_dtype`), so a bfloat16 model adds a float32 update to its bfloat16
output, as peft does (not an update rounded to bfloat16 first).

A model code groups the projections it runs as one GEMM: batchgen's decoder fuses q, k and v
(`DECODER_GROUPS`), so one adapter's q/k/v matrices become one A (their rows stacked: they read the
same input) and one block-diagonal B whose blocks land in q's, k's and v's column slices of the
fused output (a projection the adapter leaves alone: no rows of A, zero rows of B). transformers' model code
runs each projection apart (`SINGLE_GROUPS`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from batchgen.pipeline.model.adapter_files import TARGETS, AdapterError, AdapterInfo, base_shape, inspect_adapter

DECODER_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate": ("gate_proj",),
                  "up": ("up_proj",), "down": ("down_proj",)}
SINGLE_GROUPS = {p: (p,) for p in TARGETS}
_PREFIX = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"
_PART = {p: "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for p in TARGETS}

# per forward: (adapter index >= 1, the indices of its tokens: a slice where they are consecutive)
Lora = list[tuple[int, "torch.Tensor | slice"]]


@dataclass
class Stack:
    """Every adapter's update of one group of projections in one layer (fused output of width
    `sum(out)`), stacked by adapter index (0, the base model, and any adapter that leaves the
    group alone: zeros), padded with zeros to the largest rank: zeros add exact zeros."""

    # stored transposed, as the GEMMs read them (a transposed view made batched GEMMs slower)
    a: torch.Tensor  # (N + 1, in, R): per adapter, the group's A matrices side by side (R: rank x projections)
    b: torch.Tensor  # (N + 1, R, out): their B matrices times the adapter's scaling on the diagonal, zero elsewhere
    users: list[int]  # the adapters that update this group


@dataclass
class Plan:
    """How one forward's adapter tokens (`Step.lora`) go through every projection, computed once
    for all layers. One adapter present: its tokens' rows (a view where they are consecutive), as
    peft's own forward computes them. Several: one batched GEMM pair for all of them, each adapter's
    tokens padded to the most any adapter has (padding repeats one of its tokens, and is dropped)."""

    lora: Lora
    ids: torch.Tensor | None = None  # (k,) the adapters present; None where they are all of them, in order
    gather: torch.Tensor | None = None  # (k n,) token index of each padded position
    real: torch.Tensor | None = None  # (m,) the padded positions that are real tokens; None: all are
    tokens: torch.Tensor | None = None  # (m,) their token indices


class Adapters:
    """The adapters a model code was given (`set_adapters`), loaded: `stacks[layer][group]`, or None
    where no adapter updates that group of that layer."""

    def __init__(self, infos: list[AdapterInfo], config: Any, groups: dict[str, tuple[str, ...]],
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = base_shape(config)
        self.count, self.device = len(infos), device
        # peft keeps a half-precision model's adapters in float32; a float32 or float64 one's in its own dtype
        self.dtype = torch.promote_types(dtype, torch.float32)
        loaded = []
        for info in infos:
            checked = inspect_adapter(info.path, config)  # the files as they are now, against this model
            if checked.digest != info.digest:
                raise AdapterError(f"adapter {info.path}: its files changed since they were checked")
            loaded.append((checked.rank, checked.scaling, _read(checked.path)))
        self.stacks: list[dict[str, Stack | None]] = [
            {g: self._stack(loaded, layer, projs, shape.shapes) for g, projs in groups.items()}
            for layer in range(shape.layers)]

    def _stack(self, loaded: list[tuple[int, float, dict[str, torch.Tensor]]], layer: int, projs: tuple[str, ...],
               shapes: dict[str, tuple[int, int]]) -> Stack | None:
        names = [(_PREFIX.format(layer, _PART[p], p, "A"), _PREFIX.format(layer, _PART[p], p, "B")) for p in projs]
        users = [i for i, (*_, tensors) in enumerate(loaded, 1) if any(a in tensors for a, _ in names)]
        if not users:
            return None
        fan_in, out = shapes[projs[0]][0], sum(shapes[p][1] for p in projs)
        # the widest adapter's A: its rank times the projections of the group it updates
        width = max(loaded[i - 1][0] * sum(a in loaded[i - 1][2] for a, _ in names) for i in users)
        a_all = torch.zeros(len(loaded) + 1, fan_in, width, dtype=self.dtype)
        b_all = torch.zeros(len(loaded) + 1, width, out, dtype=self.dtype)
        for i in users:
            r, scaling, tensors = loaded[i - 1]
            row, col = 0, 0  # the projection's columns in the fused output; its rows in the stacked A
            for p, (a_name, b_name) in zip(projs, names):
                if a_name in tensors:
                    a_all[i, :, col : col + r] = tensors[a_name].T
                    # the scaling folded into B: one multiply per weight at load, none per forward
                    b_all[i, col : col + r, row : row + shapes[p][1]] = tensors[b_name].T.to(self.dtype) * scaling
                    col += r
                row += shapes[p][1]
        return Stack(a_all.to(self.device), b_all.to(self.device), users)

    def plan(self, lora: Lora) -> Plan:
        """The forward's `Plan` for these adapter tokens (non-empty)."""
        if len(lora) == 1:
            return Plan(lora)
        dev = self.device
        runs = [torch.arange(i.start, i.stop, device=dev) if isinstance(i, slice) else i for _, i in lora]
        n = max(len(r) for r in runs)
        gather = torch.cat([torch.cat([r, r[-1:].expand(n - len(r))]) for r in runs])
        ids = [a for a, _ in lora]
        real = None
        if any(len(r) < n for r in runs):
            real = torch.cat([torch.arange(j * n, j * n + len(r), device=dev) for j, r in enumerate(runs)])
        return Plan(lora, ids=None if ids == list(range(1, self.count + 1)) else torch.tensor(ids, device=dev),
                    gather=gather, real=real, tokens=torch.cat(runs))

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, plan: Plan) -> None:
        """The adapters' updates of `group` in `layer`, into `y` (T, out) in place, from its input x (T, in)."""
        stack = self.stacks[layer][group]
        if stack is None:
            return
        if plan.gather is None:  # one adapter
            (a, idx), = plan.lora
            if a not in stack.users:
                return
            xs = x[idx] if isinstance(idx, slice) else x.index_select(0, idx)  # (n, in)
            u = xs.to(self.dtype) @ stack.a[a]  # (n, R)
            if isinstance(idx, slice) and y.dtype == u.dtype:  # the update's GEMM adds into y's rows itself
                y[idx].addmm_(u, stack.b[a])
                return
            delta = u @ stack.b[a]  # (n, out)
        else:
            a_w, b_w = (stack.a[1:], stack.b[1:]) if plan.ids is None else \
                (stack.a.index_select(0, plan.ids), stack.b.index_select(0, plan.ids))  # (k, in, R), (k, R, out)
            xs = x.index_select(0, plan.gather).view(a_w.shape[0], -1, x.shape[1]).to(self.dtype)  # (k, n, in)
            delta = torch.bmm(torch.bmm(xs, a_w), b_w)  # (k, n, out)
            delta = delta.view(-1, y.shape[1])
            if plan.real is not None:
                delta = delta.index_select(0, plan.real)  # (m, out)
            idx = plan.tokens
        if y.dtype == delta.dtype:
            y.index_add_(0, idx, delta)  # distinct indices: one addition per element, as y + delta
        else:  # the sum in the adapter's wider dtype, then cast: peft's `result + delta`, `.to(...)`
            delta += y[idx] if isinstance(idx, slice) else y.index_select(0, idx)
            if isinstance(idx, slice):
                y[idx] = delta.to(y.dtype)
            else:
                y.index_copy_(0, idx, delta.to(y.dtype))


def check(adapters: Adapters | None, lora: Lora) -> Lora:
    """A step's adapter tokens, whose indices must be ones the model was given (`set_adapters`)."""
    count = adapters.count if adapters is not None else 0
    if lora and lora[-1][0] > count:
        raise AdapterError(f"a token runs adapter {lora[-1][0]}, but the model was given {count} adapters")
    return lora


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
