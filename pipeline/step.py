"""One forward's layout: the tokens it feeds, where each one's keys and values go, and what each
attends to. The engine builds it on the host; batchgen's attention function reads it in every layer.

A forward is one flat list of tokens, no padding (vLLM v1's layout):
- first, one token per decoding row, in slot order: its keys/values go to the row's slot;
- then segments: runs of tokens continuing one sequence, a row's suffix (or a chunk of it) or a
  prefix being prefilled into its own buffer.
Every token attends to its own sequence's keys (causally, by own index) and, if its row has one,
to its anchor: a cached prefix read once for all the tokens that continue it. Positions are the
anchor's length plus the own index, so they continue exactly from the shared prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.kv import PrefixKV, RowKV


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


@dataclass
class Decode:
    """A decoding row: one token at its slot's next own index."""

    slot: int
    base: int
    anchor: PrefixKV | None = None


@dataclass
class Group:
    """The tokens of this forward that read one anchor: their indices and positions."""

    prefix: PrefixKV
    index: torch.Tensor | slice  # (n,), or a slice when they are consecutive (views, no gathers)
    positions: torch.Tensor  # (n,)


@dataclass
class Step:
    input_ids: torch.Tensor  # (1, T)
    positions: torch.Tensor  # (1, T)
    kv: RowKV | None
    n_dec: int
    dec_slots: torch.Tensor | None  # (n_dec,) slot of each decode token, ascending
    dec_write: torch.Tensor | None  # (n_dec,) own index each one's keys/values go to
    dec_lens: list[int]  # own keys each decoding slot holds after this step's write
    contiguous: bool  # decode slots are exactly 0..n_dec-1
    hi: int  # decode attention spans slots [0, hi)
    segments: list[Segment]
    groups: list[Group]
    _masks: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def span(self) -> int:
        """Own keys the decode attention reads per slot: the longest decoding row's."""
        return max(self.dec_lens)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """New keys/values (H, T, D) of this layer into their buffers."""
        if self.n_dec:
            kd = k[:, : self.n_dec].transpose(0, 1)  # (n_dec, H, D)
            vd = v[:, : self.n_dec].transpose(0, 1)
            self.kv.k[layer][self.dec_slots, :, self.dec_write] = kd
            self.kv.v[layer][self.dec_slots, :, self.dec_write] = vd
        for s in self.segments:
            s.k[layer][s.index, :, s.offset : s.offset + s.t1 - s.t0] = k[:, s.t0 : s.t1]
            s.v[layer][s.index, :, s.offset : s.offset + s.t1 - s.t0] = v[:, s.t0 : s.t1]

    def own_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Decode rows' own keys: (hi, 1, 1, L) additive; a slot not decoding sees its key 0 (finite, unused)."""
        key = ("own", window, dtype)
        if key not in self._masks:
            lens = torch.ones(self.hi, dtype=torch.long)
            lens[self.dec_slots.cpu()] = torch.tensor(self.dec_lens)
            j = torch.arange(int(lens.max()))[None]  # (1, L)
            allow = j < lens[:, None]
            if window is not None:
                allow &= (lens[:, None] - 1 - j) < window
            self._masks[key] = _additive(allow, dtype, self.input_ids.device)[:, None, None]
        return self._masks[key]

    def segment_mask(self, i: int, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """Segment i's queries over its own keys: None when plain causal attention is exact."""
        s = self.segments[i]
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

    def join(anchor: PrefixKV | None, tokens) -> None:
        if anchor is not None:
            members.setdefault(id(anchor), (anchor, []))[1].extend(tokens)

    dec_lens = []
    for t, d in enumerate(decode):
        n = kv.lens[d.slot]
        pos.append(d.base + n)
        dec_lens.append(n + 1)
        join(d.anchor, [t])
    segs = []
    for seg, tokens in segments:
        seg.t0 = len(ids)
        seg.t1 = seg.t0 + len(tokens)
        ids += tokens
        pos += range(seg.base + seg.offset, seg.base + seg.offset + len(tokens))
        join(seg.anchor, range(seg.t0, seg.t1))
        segs.append(seg)
    positions = torch.tensor(pos, dtype=torch.long)
    slots = [d.slot for d in decode]
    groups = []
    for prefix, index in members.values():
        index_t = torch.tensor(index, dtype=torch.long)
        run = index == list(range(index[0], index[0] + len(index)))
        groups.append(Group(prefix, slice(index[0], index[0] + len(index)) if run else index_t.to(device),
                            positions[index_t]))
    return Step(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        positions=positions[None].to(device),
        kv=kv,
        n_dec=len(decode),
        dec_slots=torch.tensor(slots, dtype=torch.long, device=device) if decode else None,
        dec_write=torch.tensor([n - 1 for n in dec_lens], dtype=torch.long, device=device) if decode else None,
        dec_lens=dec_lens,
        contiguous=slots == list(range(len(slots))),
        hi=max(slots) + 1 if slots else 0,
        segments=segs,
        groups=groups,
    )
