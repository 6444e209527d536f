"""The one module that touches the transformers Cache API (it churns between releases).

Pinned to transformers >=5.24,<6: `DynamicCache.layers[i].keys/.values` are [B, H_kv, S, D];
a layer's `update` is a `torch.cat`, so a cache built over `expand`ed views of a batch-1 prefix
is a zero-copy fan-out whose first update materializes the rows and never writes the prefix.
Every layer is a plain full `DynamicLayer`, also for sliding-window models: windows are applied by
the engine's masks in position space, which stays exact when rows carry padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@dataclass
class PrefixKV:
    """A batch-1 snapshot of a prefix's keys and values, one (k, v) pair per layer: [1, H, S, D]."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[-2] if self.layers else 0

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


def new_cache() -> DynamicCache:
    # no config on purpose: sliding layers would crop by index, which padding makes wrong
    return DynamicCache()


def _cache_of(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = new_cache()
    for k, v in layers:
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache


def extend_from(prefix: PrefixKV | None) -> DynamicCache:
    """A batch-1 cache that starts as `prefix`; appending to it leaves `prefix` untouched."""
    return new_cache() if prefix is None or not prefix.layers else _cache_of(list(prefix.layers))


def snapshot(cache: DynamicCache) -> PrefixKV:
    return PrefixKV([(layer.keys, layer.values) for layer in cache.layers])


def fan_out(groups: list[tuple[PrefixKV | None, int]], width: int) -> DynamicCache:
    """One cache row per fanned-out request: `count` rows of each prefix, right-padded to `width`.

    A single group that needs no padding is an `expand`ed view: no copy until the next update.
    """
    template = next((p for p, _ in groups if p is not None and p.layers), None)
    if template is None:
        return new_cache()
    layers = []
    for i, (k0, v0) in enumerate(template.layers):
        keys, values = [], []
        for prefix, count in groups:
            k, v = _padded(prefix, i, k0, v0, width)
            keys.append(k.expand(count, -1, -1, -1))  # (count, H, width, D), a view
            values.append(v.expand(count, -1, -1, -1))
        if len(keys) == 1:
            layers.append((keys[0], values[0]))
        else:
            layers.append((torch.cat(keys, dim=0), torch.cat(values, dim=0)))
    return _cache_of(layers)


def _padded(prefix: PrefixKV | None, i: int, k0: torch.Tensor, v0: torch.Tensor, width: int):
    if prefix is None or not prefix.layers:
        k = k0.new_zeros(1, k0.shape[1], 0, k0.shape[3])
        v = v0.new_zeros(1, v0.shape[1], 0, v0.shape[3])
    else:
        k, v = prefix.layers[i]
    gap = width - k.shape[-2]
    if gap:
        # zeros, not garbage: masked keys still meet the values in a matmul, and NaN * 0 is NaN
        k = torch.cat([k, k.new_zeros(1, k.shape[1], gap, k.shape[3])], dim=-2)
        v = torch.cat([v, v.new_zeros(1, v.shape[1], gap, v.shape[3])], dim=-2)
    return k, v


def select_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep (and repeat) rows by index, in place: rows that finished stop costing work."""
    for layer in cache.layers:
        if layer.is_initialized and layer.keys is not None:
            layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
            layer.values = layer.values.index_select(0, index.to(layer.values.device))


def length(cache: DynamicCache) -> int:
    return cache.get_seq_length()
