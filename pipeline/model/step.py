"""One forward's layout: the tokens it feeds, where each one's keys and values go, and what each
attends to. The engine builds it on the host; batchgen's attention function reads it in every layer.

A forward is one flat list of tokens, no padding (vLLM v1's layout):
- first, one token per decoding row, in slot order: its keys/values go to the row's slot;
- then segments: runs of tokens continuing one sequence, a row's suffix (or a chunk of it) or a
  prefix being prefilled into its own buffer.
Every token attends to its own sequence's keys (causally, by own index) and, if its row has one,
to its anchor: a cached prefix read once for all the tokens that continue it. Positions are the
anchor's length plus the own index, so they continue exactly from the shared prefix.

Everything here is computed once per forward and shared by all layers: index tensors, masks,
and how the attention calls are batched (decode slots in runs of similar length; fresh suffixes
of similar length side by side in one padded causal call).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.pipeline.model import native
from batchgen.pipeline.model.kv import PrefixKV, RowKV, pointers
from batchgen.pipeline.model.lora import Lora, token_groups

DECODE_RUN = 16  # decoding slots per own-part call: each call reads only as far as its longest row
PAD_WASTE = 1.5  # a padded call of fresh suffixes may do this much more work than their own


@dataclass
class Segment:
    """Tokens [t0, t1) of the forward continuing one sequence, stored at row `index` of the
    per-layer buffers `k`/`v` ([rows, H, capacity, D]) after the `offset` own tokens already there."""

    t0: int
    t1: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    index: int
    offset: int
    base: int  # position of own token 0: the anchor's length
    anchor: PrefixKV | None = None
    adapter: int = 0  # the LoRA adapter its tokens run through (`Forward.set_adapters`); 0: the base model

    def __post_init__(self) -> None:
        _whole(self.anchor)


@dataclass
class Decode:
    """A decoding row: one token at its slot's next own index."""

    slot: int
    base: int
    anchor: PrefixKV | None = None
    adapter: int = 0

    def __post_init__(self) -> None:
        _whole(self.anchor)


def _whole(anchor: PrefixKV | None) -> None:
    """An anchor is read from its token 0: a prefix holding only its tail is never one (`schedule.Prefix`)."""
    if anchor is not None and anchor.base:
        raise ValueError(f"a prefix holding tokens from {anchor.base} on cannot be read as an anchor")


@dataclass
class Group:
    """The tokens of this forward that read one anchor: their indices and positions."""

    prefix: PrefixKV
    index: torch.Tensor | slice  # (n,), or a slice when they are consecutive (views, no gathers)
    positions: torch.Tensor  # (n,)


@dataclass
class Batch:
    """Fresh suffixes (own keys = this forward's keys) of similar length, right-padded side by side
    for one causal call: with the queries at the start of their keys, causality alone keeps every
    real query off the padding."""

    gather: torch.Tensor  # (n, L) token index of each padded position (padding repeats a real one)
    real: torch.Tensor  # (m,) flat padded positions that are real tokens
    tokens: torch.Tensor  # (m,) their token indices


@dataclass
class Native:
    """The forward's layout for the compiled kernels (`batchgen.pipeline.model.native`), int64 on the CPU; per layer
    (first dim) the data pointers of the buffers each one reads; pointer 0: no anchor.
    Decode tokens: their slots, own keys after this step's write, and anchors. Segments: their
    tokens [t0, t1), own buffer (row `own_index` of capacity `own_cap`), own index of their first
    token (`offset`) and anchors."""

    slot: torch.Tensor
    own_len: torch.Tensor
    anc_k: torch.Tensor
    anc_v: torch.Tensor
    anc_len: torch.Tensor
    t0: torch.Tensor
    t1: torch.Tensor
    own_k: torch.Tensor
    own_v: torch.Tensor
    own_cap: torch.Tensor
    own_index: torch.Tensor
    offset: torch.Tensor
    seg_anc_k: torch.Tensor
    seg_anc_v: torch.Tensor
    seg_anc_len: torch.Tensor


def _native(decode: list[Decode], own: list[int], segments: list[Segment], layers: int) -> Native | None:
    buffers: dict[int, torch.Tensor | None] = {}

    def ptrs(tensors: list[torch.Tensor]) -> torch.Tensor | None:  # once per buffer per step
        if id(tensors) not in buffers:
            buffers[id(tensors)] = pointers(tensors)
        return buffers[id(tensors)]

    none, empty = torch.zeros(layers, dtype=torch.long), torch.zeros(layers, 0, dtype=torch.long)

    def anchors(prefixes: list[PrefixKV | None]) -> list[torch.Tensor] | None:
        k = [ptrs(p.k) if p is not None else none for p in prefixes]
        v = [ptrs(p.v) if p is not None else none for p in prefixes]
        if any(x is None for x in k + v):
            return None
        lens = torch.tensor([p.length if p is not None else 0 for p in prefixes], dtype=torch.long)
        return [torch.stack(k, 1) if k else empty, torch.stack(v, 1) if v else empty, lens]

    dec = anchors([d.anchor for d in decode])
    seg = anchors([s.anchor for s in segments])
    own_k, own_v = [ptrs(s.k) for s in segments], [ptrs(s.v) for s in segments]
    if dec is None or seg is None or any(x is None for x in own_k + own_v):
        return None
    lt = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return Native(
        slot=lt([d.slot for d in decode]), own_len=lt(own) + 1, anc_k=dec[0], anc_v=dec[1], anc_len=dec[2],
        t0=lt([s.t0 for s in segments]), t1=lt([s.t1 for s in segments]),
        own_k=torch.stack(own_k, 1) if own_k else empty, own_v=torch.stack(own_v, 1) if own_v else empty,
        own_cap=lt([s.k[0].shape[2] for s in segments]), own_index=lt([s.index for s in segments]),
        offset=lt([s.offset for s in segments]), seg_anc_k=seg[0], seg_anc_v=seg[1], seg_anc_len=seg[2])


@dataclass
class Step:
    input_ids: torch.Tensor  # (1, T)
    positions: torch.Tensor  # (1, T)
    kv: RowKV | None
    n_dec: int
    dec_slots: torch.Tensor | None  # (n_dec,) slot of each decode token, ascending
    contiguous: bool  # decode slots are exactly 0..n_dec-1
    hi: int  # decode attention spans slots [0, hi)
    dec_runs: list[tuple[int, int, int]]  # (first slot, end slot, own keys to read) per own-part call
    dec_lens: torch.Tensor | None  # (hi,) own keys per slot after this step's write (1 for idle slots), on the device
    store_tokens: torch.Tensor | slice  # tokens whose keys/values go to row slots ...
    store_slots: torch.Tensor  # ... their slots
    store_at: torch.Tensor  # ... and own indices
    segments: list[Segment]  # every segment, in token order
    continuing: list[Segment]  # those that continue stored keys (prefixes, later chunks): one call each
    batches: list[Batch]  # the fresh suffixes
    groups: list[Group]
    native: Native | None = None  # for the compiled kernels, on a CPU
    # per LoRA adapter present (index > 0), its tokens' indices (`batchgen.pipeline.model.lora`); empty when
    # every token runs the base model, and then the forward does no adapter work at all
    lora: Lora = field(default_factory=list)
    kernel_layers: list[int] = field(default_factory=lambda: [0, 0])  # layers through the compiled kernels, PyTorch's
    _masks: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """New keys/values (H, T, D) of this layer into their buffers."""
        if self.store_slots.numel() and not (  # copies in C where it runs, else indexed assignment
                self.native is not None and native.store_rows(k, v, self.kv.k[layer], self.kv.v[layer],
                                                              self.store_tokens, self.store_slots, self.store_at)):
            self.kv.k[layer][self.store_slots, :, self.store_at] = k[:, self.store_tokens].transpose(0, 1)
            self.kv.v[layer][self.store_slots, :, self.store_at] = v[:, self.store_tokens].transpose(0, 1)
        for s in self.continuing:
            if self.kv is None or s.k is not self.kv.k:  # a prefix being prefilled: its own buffer
                s.k[layer][s.index, :, s.offset : s.offset + s.t1 - s.t0] = k[:, s.t0 : s.t1]
                s.v[layer][s.index, :, s.offset : s.offset + s.t1 - s.t0] = v[:, s.t0 : s.t1]

    def own_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Decode rows' own keys: (hi, 1, 1, L) additive, from the lengths on the device; an idle
        slot sees its key 0 (finite, unused)."""
        key = ("own", window, dtype)
        if key not in self._masks:
            lens = self.dec_lens[:, None]  # (hi, 1)
            j = torch.arange(max(span for _, _, span in self.dec_runs), device=lens.device)[None]  # (1, L)
            allow = j < lens
            if window is not None:
                allow &= (lens - 1 - j) < window
            mask = torch.zeros(allow.shape, dtype=dtype, device=lens.device).masked_fill_(~allow, float("-inf"))
            self._masks[key] = mask[:, None, None]
        return self._masks[key]

    def segment_mask(self, i: int, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """Continuing segment i's queries over its own keys (the first `offset` already stored):
        causal by own index."""
        s = self.continuing[i]
        n = s.t1 - s.t0
        if s.offset == 0 and (window is None or window >= n):
            return None
        key = ("seg", i, window, dtype)
        if key not in self._masks:
            q = torch.arange(s.offset, s.offset + n)[:, None]  # own index of each query
            j = torch.arange(s.offset + n)[None]
            allow = j <= q
            if window is not None:
                allow &= (q - j) < window
            self._masks[key] = _additive(allow, dtype, self.input_ids.device)[None, None]
        return self._masks[key]

    def batch_mask(self, i: int, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """Padded fresh suffixes: None (plain causal) unless a sliding window cuts into them."""
        length = self.batches[i].gather.shape[1]
        if window is None or window >= length:
            return None
        key = ("batch", i, window, dtype)
        if key not in self._masks:
            q = torch.arange(length)[:, None]
            j = torch.arange(length)[None]
            self._masks[key] = _additive((j <= q) & (q - j < window), dtype, self.input_ids.device)[None, None]
        return self._masks[key]

    def group_mask(self, i: int, window: int | None, dtype: torch.dtype, fold: int):
        """Group i's queries (folded `fold` query heads per key head) over its anchor: (mask, blind),
        None when the window, if any, still covers the whole anchor for every query; `blind` (n,)
        marks queries whose window has left the whole anchor behind (the fused kernel gives those
        a log-sum-exp of 0, not -inf)."""
        g = self.groups[i]
        if window is None or int(g.positions.max()) < window:
            return None
        key = ("group", i, window, dtype, fold)
        if key not in self._masks:
            allow = (g.positions.cpu()[:, None] - torch.arange(g.prefix.length)[None]) < window  # (n, P)
            mask = _additive(allow.repeat(fold, 1), dtype, self.input_ids.device)[None, None]
            self._masks[key] = (mask, (~allow.any(dim=1)).to(self.input_ids.device))
        return self._masks[key]


def _additive(allow: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    m = torch.zeros(allow.shape, dtype=dtype)
    m.masked_fill_(~allow, float("-inf"))
    return m.to(device)


def build(decode: list[Decode], decode_ids: list[int], segments: list[tuple[Segment, list[int]]],
          kv: RowKV | None, device: torch.device) -> Step:
    """The step for these decoding rows (their last sampled tokens) and segments (with their token ids)."""
    ids: list[int] = list(decode_ids)
    pos: list[int] = []
    members: dict[int, tuple[PrefixKV, list[int]]] = {}
    store_tokens, store_slots, store_at = [], [], []

    def join(anchor: PrefixKV | None, tokens) -> None:
        if anchor is not None:
            members.setdefault(id(anchor), (anchor, []))[1].extend(tokens)

    for t, d in enumerate(decode):
        n = kv.lens[d.slot]
        pos.append(d.base + n)
        store_tokens.append(t), store_slots.append(d.slot), store_at.append(n)
        join(d.anchor, [t])
    every, continuing, fresh = [], [], []
    for seg, tokens in segments:
        seg.t0 = len(ids)
        seg.t1 = seg.t0 + len(tokens)
        ids += tokens
        pos += range(seg.base + seg.offset, seg.base + seg.offset + len(tokens))
        join(seg.anchor, range(seg.t0, seg.t1))
        if kv is not None and seg.k is kv.k:  # a row's suffix: its keys go to its slot
            store_tokens += range(seg.t0, seg.t1)
            store_slots += [seg.index] * len(tokens)
            store_at += range(seg.offset, seg.offset + len(tokens))
        (fresh if seg.offset == 0 and kv is not None and seg.k is kv.k else continuing).append(seg)
        every.append(seg)
    positions = torch.tensor(pos, dtype=torch.long)
    slots = [d.slot for d in decode]
    hi = max(slots) + 1 if slots else 0
    dec_lens = [1] * hi
    for s, n in zip(slots, store_at):
        dec_lens[s] = n + 1
    groups = []
    for prefix, index in members.values():
        index_t = torch.tensor(index, dtype=torch.long)
        run = index == list(range(index[0], index[0] + len(index)))
        groups.append(Group(prefix, slice(index[0], index[0] + len(index)) if run else index_t.to(device),
                            positions[index_t]))
    everything = store_tokens == list(range(len(ids)))
    lora = []
    if any(d.adapter for d in decode) or any(s.adapter for s in every):
        lora = token_groups([(d.adapter, [t]) for t, d in enumerate(decode)]
                            + [(s.adapter, range(s.t0, s.t1)) for s in every], device)
    return Step(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        positions=positions[None].to(device),
        kv=kv,
        n_dec=len(decode),
        dec_slots=torch.tensor(slots, dtype=torch.long, device=device) if decode else None,
        contiguous=slots == list(range(len(slots))),
        hi=hi,
        dec_runs=[(a, min(a + DECODE_RUN, hi), max(dec_lens[a : a + DECODE_RUN])) for a in range(0, hi, DECODE_RUN)],
        dec_lens=torch.tensor(dec_lens, dtype=torch.long, device=device) if decode else None,
        store_tokens=slice(None) if everything else torch.tensor(store_tokens, dtype=torch.long, device=device),
        store_slots=torch.tensor(store_slots, dtype=torch.long, device=device),
        store_at=torch.tensor(store_at, dtype=torch.long, device=device),
        segments=every,
        continuing=continuing,
        batches=_batches(fresh, device),
        groups=groups,
        native=_native(decode, store_at[: len(decode)], every, len(kv.k if kv is not None else every[0].k))
        if device.type == "cpu" else None,
        lora=lora,
    )


def _batches(fresh: list[Segment], device: torch.device) -> list[Batch]:
    """Fresh suffixes, longest first, cut into padded calls that waste at most PAD_WASTE x their
    attention work (which grows with the square of the length)."""
    out: list[Batch] = []
    todo = sorted(fresh, key=lambda s: s.t0 - s.t1)
    while todo:
        longest = todo[0].t1 - todo[0].t0
        take, work = 0, 0
        while take < len(todo):
            n = todo[take].t1 - todo[take].t0
            if take and (take + 1) * longest**2 > PAD_WASTE * (work + n * n):
                break
            take, work = take + 1, work + n * n
        part, todo = todo[:take], todo[take:]
        gather = torch.tensor([[s.t0 + min(p, s.t1 - s.t0 - 1) for p in range(longest)] for s in part],
                              dtype=torch.long)
        real = torch.tensor([i * longest + p for i, s in enumerate(part) for p in range(s.t1 - s.t0)], dtype=torch.long)
        out.append(Batch(gather.to(device), real.to(device), gather.flatten()[real].to(device)))
    return out


class StaticDecode:
    """Decode steps on static shapes, for a CUDA graph or torch.compile(mode="reduce-overhead") to
    capture: every slot of a bucket (1, 2, 4, ... slots) feeds a token (idle ones a dummy that
    writes into their own free slot), own keys are read to the full capacity under a mask made
    on the device from the slots' lengths, and token ids, positions and write indices live in
    preallocated device buffers that each step refills in place. Group membership (which slots
    read which prefix) changes only when rows join or leave."""

    def __init__(self, kv: RowKV, device: torch.device) -> None:
        self.kv = kv
        n = kv.slots
        # token ids, positions and write indices (= lengths before the step) are rows of one buffer:
        # one host-to-device copy per step, not three (on a GPU each waits for the copy)
        self.staged = torch.zeros(3, n, dtype=torch.long, device=device)
        self.ids, self.positions, self.at = self.staged[0:1], self.staged[1:2], self.staged[2]
        self.lens = torch.ones(n, dtype=torch.long, device=device)  # own keys after the step's write
        self.slots = torch.arange(n, device=device)
        self.buckets = sorted({min(1 << i, n) for i in range(n.bit_length() + 1)})
        self._groups: dict[tuple[int, ...], torch.Tensor] = {}  # last step's group members on the device

    def bucket(self, hi: int) -> int:
        return next(b for b in self.buckets if b >= hi)

    def build(self, decode: list[Decode], decode_ids: list[int]) -> Step:
        size = self.bucket(max(d.slot for d in decode) + 1)
        ids, pos, at = [0] * size, [0] * size, [0] * size
        members: dict[int, tuple[PrefixKV, list[int]]] = {}
        for d, token in zip(decode, decode_ids):
            n = self.kv.lens[d.slot]
            ids[d.slot], pos[d.slot], at[d.slot] = token, d.base + n, n
            if d.anchor is not None:
                members.setdefault(id(d.anchor), (d.anchor, []))[1].append(d.slot)
        device = self.ids.device
        self.staged[:, :size].copy_(torch.tensor([ids, pos, at]))
        torch.add(self.at[:size], 1, out=self.lens[:size])
        # which slots read which prefix changes only as rows join or leave: their index tensors on the
        # device are kept from the step before, not uploaded again
        kept, self._groups = self._groups, {}
        for _, index in members.values():
            key = tuple(index)
            self._groups[key] = kept[key] if key in kept else torch.tensor(index, device=device)
        groups = [Group(p, self._groups[tuple(index)], torch.tensor(index).apply_(lambda s: pos[s]))
                  for p, index in members.values()]
        return Step(
            input_ids=self.ids[:, :size], positions=self.positions[:, :size], kv=self.kv, n_dec=size,
            dec_slots=self.slots[:size], contiguous=True, hi=size, dec_runs=[(0, size, self.kv.capacity)],
            dec_lens=self.lens[:size], store_tokens=slice(None), store_slots=self.slots[:size],
            store_at=self.at[:size], segments=[], continuing=[], batches=[], groups=groups,
            # a slot's token index is the slot; idle slots run the base model
            lora=token_groups(sorted((d.adapter, [d.slot]) for d in decode if d.adapter), device)
            if any(d.adapter for d in decode) else [])
