"""Key/value storage the engine owns: cached prefixes, and the row slots of a batch.

There is no transformers Cache here: the model runs with use_cache=False and batchgen's attention
function (batchgen.pipeline.model.attention) writes each layer's new keys and values into these buffers itself,
as vLLM's attention layers write into their KV cache. Buffers are preallocated: a write lands in
place and a read is a view, so nothing is re-copied per step, and rows that finish free a slot
without moving anyone's cache.

Per layer, keys and values are [rows, H_kv, tokens, D]. Buffers start zeroed: a masked key still
meets its value in a matmul (NaN * 0 is NaN), and a slot's unused tail is read, masked, by the
batched decode attention. What a finished row leaves in a slot is finite and masked likewise.
On a CPU the zeros cost nothing up front (`zeroed`).
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch


def zeroed(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Zero-filled tensors of these shapes. On a CPU they are views into one private anonymous
    memory map, whose pages read as zeros and take memory only once written: `torch.zeros`
    writes a large batch's every zero before its first token, and holds all of them, though short
    rows write a fraction of their slot (BENCHMARKS.md). The map is unmapped when
    the last view goes. Elsewhere (CUDA; Windows), `torch.zeros`."""
    if device.type != "cpu" or not hasattr(mmap, "MAP_PRIVATE"):
        return [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
    size = dtype.itemsize
    spans = [-(-math.prod(s) * size // mmap.PAGESIZE) * mmap.PAGESIZE for s in shapes]  # each view starts on a page
    try:
        memory = mmap.mmap(-1, max(mmap.PAGESIZE, sum(spans)), flags=mmap.MAP_PRIVATE)
    except (OSError, ValueError):  # no map that large: plain zeros, and their own error
        return [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
    flat = torch.frombuffer(memory, dtype=torch.uint8)
    out, at = [], 0
    for s, span in zip(shapes, spans):
        out.append(flat[at : at + math.prod(s) * size].view(dtype).view(s))
        at += span
    return out


def pointers(buffers: list[torch.Tensor]) -> torch.Tensor | None:
    """Per layer, a buffer's data pointer (int64, for the compiled kernels, `batchgen.pipeline.model.native`), or
    None if a buffer is not a contiguous CPU tensor (the kernels read [rows, H, tokens, D] as such)."""
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in buffers):
        return None
    return torch.tensor([t.data_ptr() for t in buffers], dtype=torch.long)


@dataclass(frozen=True)
class LayerShape:
    heads: int  # key/value heads
    k_dim: int
    v_dim: int


class PrefixKV:
    """A cached prefix of `length` tokens, holding tokens [base, length): per layer keys
    [1, H, length - base, Dk] and values (base > 0: the tokens below `base` are another prefix's,
    read as this one's anchor). Its parent's tokens are copied in once (`copy_from`), then the
    rest prefilled in place; read-only afterwards."""

    def __init__(self, shapes: list[LayerShape], length: int, dtype: torch.dtype, device: torch.device,
                 base: int = 0) -> None:
        if not 0 <= base <= length:
            raise ValueError(f"a prefix of {length} tokens cannot hold them from {base}")
        self.length, self.base = length, base
        both = zeroed([(1, s.heads, length - base, d) for s in shapes for d in (s.k_dim, s.v_dim)], dtype, device)
        self.k, self.v = both[0::2], both[1::2]

    def copy_from(self, other: "PrefixKV", start: int, end: int) -> None:
        """Tokens [start, end) from another prefix of the same sequence that holds them."""
        if start < max(self.base, other.base) or end > min(self.length, other.length):
            raise ValueError(f"tokens [{start}, {end}) are not held by both prefixes")
        a, b = start - self.base, start - other.base
        for mine, theirs in zip(self.k + self.v, other.k + other.v):
            mine[:, :, a : a + end - start] = theirs[:, :, b : b + end - start]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class RowKV:
    """The row slots of one batch: each holds up to `capacity` of its row's own tokens (the ones
    not read from a shared prefix). `lens[s]`: tokens slot s holds. The one owner of a batch's
    slots and lengths: the engine asks it for free slots and tells it what each forward wrote."""

    def __init__(self, shapes: list[LayerShape], slots: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slots, self.capacity = slots, capacity
        both = zeroed([(slots, s.heads, capacity, d) for s in shapes for d in (s.k_dim, s.v_dim)], dtype, device)
        self.k, self.v = both[0::2], both[1::2]
        self.lens = [0] * slots
        self.used = [False] * slots

    def take(self, count: int) -> list[int] | None:
        """`count` free slots, lowest first (decode attention spans slots 0..highest in use), or None."""
        free = [s for s in range(self.slots) if not self.used[s]][:count]
        if len(free) < count:
            return None
        for s in free:
            self.used[s], self.lens[s] = True, 0
        return free

    def free(self, slot: int) -> None:
        self.used[slot], self.lens[slot] = False, 0

    def in_use(self) -> int:
        return sum(self.used)

    def advance(self, slot: int, n: int = 1) -> None:
        """A forward wrote `n` more of the slot's tokens: they count from now on."""
        self.lens[slot] += n

    def cut(self, slot: int, n: int) -> None:
        """The slot keeps only its first `n` tokens (a conversation's next turn parts from it
        there): the rest are masked from now on and overwritten as it goes on."""
        if not 0 <= n <= self.lens[slot]:
            raise ValueError(f"cannot cut a slot of {self.lens[slot]} tokens to {n}")
        self.lens[slot] = n

    def copy_in(self, slot: int, prefix: PrefixKV, start: int, end: int) -> None:
        """Tokens [start, end) of a cached prefix (it holds them: start >= prefix.base) become the
        slot's first own tokens."""
        if start < prefix.base:
            raise ValueError(f"tokens from {start} of a prefix that holds them from {prefix.base}")
        n, at = end - start, start - prefix.base
        for mine, theirs in zip(self.k + self.v, prefix.k + prefix.v):
            mine[slot, :, :n] = theirs[0, :, at : at + n]
        self.lens[slot] = n

    def fork(self, src: int, dst: list[int]) -> None:
        """Slots `dst` start as copies of slot `src` (n samples of one prompt share its prefill)."""
        n = self.lens[src]
        index = torch.tensor(dst, device=self.k[0].device)
        for t in self.k + self.v:
            t[index, :, :n] = t[src, :, :n]
        for s in dst:
            self.lens[s] = n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
