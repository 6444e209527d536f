"""The one module that touches the transformers Cache API (it churns between releases).

Pinned to transformers >=5.24,<6: a `DynamicCache`'s `layers[i]` hold keys/values [B, H_kv, S, D]
and the model calls `layer.update(k, v)` once per forward. Every layer here is a preallocated
buffer sized for what it will hold: an append writes in place and reads are views, so nothing is
re-copied per step or per prefill chunk (a growing `cat` would re-copy, and on CPU re-fault, the
whole cache each time). A prefix (batch 1) copies its parent once and is never written after its
prefill, so all its children can start from it.
Every layer is full-length, also for sliding-window models: windows are applied by the engine's
masks in position space, which stays exact when rows carry padding.
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


def extend_from(prefix: PrefixKV | None, extra: int) -> DynamicCache:
    """A batch-1 cache that starts as `prefix` and has room for `extra` more tokens; the prefix is
    copied once, so appending (in chunks) never rewrites it nor re-copies what was appended."""
    cache = DynamicCache()  # no config on purpose: sliding layers would crop by index
    if prefix is None or not prefix.layers:
        cache.layer_class_to_replicate = lambda: BufferLayer(1, extra, 1)
        return cache
    for k, v in prefix.layers:
        n = k.shape[2]
        kbuf = k.new_empty(1, k.shape[1], n + extra, k.shape[3])
        vbuf = v.new_empty(1, v.shape[1], n + extra, v.shape[3])
        kbuf[:, :, :n], vbuf[:, :, :n] = k, v
        cache.layers.append(BufferLayer(1, n + extra, 1, n, kbuf, vbuf))
    return cache


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop whatever a failed forward appended past `length` (some layers may have run)."""
    for layer in cache.layers:
        if isinstance(layer, BufferLayer) and layer.is_initialized and layer.length > length:
            layer.length = length
            layer._views()


def snapshot(cache: DynamicCache) -> PrefixKV:
    return PrefixKV([(layer.keys, layer.values) for layer in cache.layers])


class BufferLayer(DynamicLayer):
    """Keys/values in a preallocated [rows, H, capacity, D] buffer; `keys`/`values` are views."""

    def __init__(self, slots: int, capacity: int, rows: int, length: int = 0,
                 kbuf: torch.Tensor | None = None, vbuf: torch.Tensor | None = None) -> None:
        super().__init__()
        self.slots, self.capacity = slots, capacity
        self.rows, self.length = rows, length
        self.kbuf, self.vbuf = kbuf, vbuf
        self.ragged: torch.Tensor | None = None  # (rows,) slot each row appends at, when rows differ
        if kbuf is not None:
            self.lazy_initialization(kbuf, vbuf)
            self._views()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        if self.kbuf is None:  # no prefix to copy in: the buffer takes the first update's shape
            _, heads, _, dim = key_states.shape
            self.kbuf = key_states.new_zeros(self.slots, heads, self.capacity, dim)
            self.vbuf = value_states.new_zeros(self.slots, heads, self.capacity, value_states.shape[3])
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self.kbuf[: self.rows, :, : self.length]
        self.values = self.vbuf[: self.rows, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.ragged is not None:  # one token per row, each at its own next slot
            rows = torch.arange(self.rows, device=self.kbuf.device)
            self.kbuf[rows, :, self.ragged] = key_states[:, :, 0]  # (B, H, D)
            self.vbuf[rows, :, self.ragged] = value_states[:, :, 0]
            return self.keys, self.values
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.kbuf.shape[2] or key_states.shape[0] != self.rows:
            raise RuntimeError(f"cache buffer overflow: {end} > {self.kbuf.shape[2]} or rows {key_states.shape[0]}")
        self.kbuf[: self.rows, :, self.length : end] = key_states
        self.vbuf[: self.rows, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def move_rows(self, sources: list[int]) -> None:
        """Row i becomes old row sources[i], in place; sources must satisfy sources[i] >= i
        when read front to back, or <= i back to front, which `keep_rows`/`fork_rows` ensure."""
        order = range(len(sources)) if all(s >= i for i, s in enumerate(sources)) else reversed(range(len(sources)))
        for i in order:
            s = sources[i]
            if s != i:
                self.kbuf[i, :, : self.length] = self.kbuf[s, :, : self.length]
                self.vbuf[i, :, : self.length] = self.vbuf[s, :, : self.length]
        self.rows = len(sources)
        self._views()


def fan_out(groups: list[tuple[PrefixKV | None, int]], width: int, capacity: int, rows: int,
            into: DynamicCache | None = None, start: int = 0) -> DynamicCache:
    """A batch cache of `rows` slots: the first ones hold `count` copies of each group's prefix,
    right-padded to `width`; room is left for `capacity` tokens per row. Buffers start zeroed, not
    as garbage: masked keys still meet the values in a matmul (NaN * 0 is NaN), and once rows of
    unequal length share a batch, a row's view reaches slots it has not written.

    With `into`, the slots are rows start.. of that batch's buffers (new rows joining a batch in
    flight): zeroed whole, since the batch's other rows may already be longer than these."""
    template = next((p for p, _ in groups if p is not None and p.layers), None)
    used = sum(count for _, count in groups)
    cache = DynamicCache()
    if into is None and template is None:  # nothing cached yet: the model's first update sizes the buffers
        cache.layer_class_to_replicate = lambda: BufferLayer(rows, capacity, used)
        return cache
    for i in range(len(into.layers if into is not None else template.layers)):
        if into is not None:
            kbuf = into.layers[i].kbuf[start : start + rows]  # views: writes land in the batch's buffers
            vbuf = into.layers[i].vbuf[start : start + rows]
            kbuf.zero_()
            vbuf.zero_()
        else:
            k0, v0 = template.layers[i]
            kbuf = k0.new_zeros(rows, k0.shape[1], capacity, k0.shape[3])  # (rows, H, capacity, D)
            vbuf = v0.new_zeros(rows, v0.shape[1], capacity, v0.shape[3])
        r = 0
        for prefix, count in groups:
            if prefix is not None and prefix.layers:
                k, v = prefix.layers[i]
                kbuf[r : r + count, :, : k.shape[2]] = k  # broadcast over the group's rows
                vbuf[r : r + count, :, : v.shape[2]] = v
            r += count
        cache.layers.append(BufferLayer(rows, capacity, used, width, kbuf, vbuf))
    return cache


def capacity(cache: DynamicCache) -> tuple[int, int]:
    """(row slots, tokens per row) of a batch cache's buffers; (0, 0) before its first forward."""
    layer = next((l for l in cache.layers if isinstance(l, BufferLayer) and l.kbuf is not None), None)
    return (layer.kbuf.shape[0], layer.kbuf.shape[2]) if layer is not None else (0, 0)


def resize_rows(cache: DynamicCache, rows: int, width: int) -> None:
    """The batch now has `rows` live rows, each viewed through `width` slots (new rows joined)."""
    for layer in cache.layers:
        if isinstance(layer, BufferLayer):
            layer.rows, layer.length = rows, width
            layer._views()


def append_at(cache: DynamicCache, slots: torch.Tensor, width: int) -> None:
    """The next forward appends row i's token at slots[i] and views `width` slots (rows of
    unequal length, once rows joined a batch in flight)."""
    for layer in cache.layers:
        if isinstance(layer, BufferLayer):
            layer.ragged = slots
            layer.length = width
            layer._views()


def keep_rows(cache: DynamicCache, keep: list[int]) -> None:
    """Drop finished rows (keep is ascending): they stop costing work."""
    for layer in cache.layers:
        if isinstance(layer, BufferLayer):
            layer.move_rows(keep)


def fork_rows(cache: DynamicCache, counts: list[int]) -> None:
    """Row i becomes counts[i] consecutive rows (n samples of one prompt share its cache)."""
    sources = [i for i, c in enumerate(counts) for _ in range(c)]
    for layer in cache.layers:
        if isinstance(layer, BufferLayer):
            if len(sources) > layer.slots:
                raise RuntimeError("fork beyond the buffer's rows")
            layer.move_rows(sources)
