"""One batch in flight: its rows, their key positions and cache rows, kept in step.

The engine runs the model; this keeps the bookkeeping that must move together whenever rows
fork (n samples), finish (compaction) or join (rows planned next take freed slots): the decoding
rows, the prefix each reads, every key slot's position, and where each row appends next.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from pipeline import kvcache, masks
from pipeline.schedule import Row
from pipeline.types import Request


@dataclass
class DecodeRow:
    """One sample being decoded."""

    request: Request
    sample_index: int
    cached: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)


@dataclass
class BatchState:
    rows: tuple[Row, ...]  # the planned rows (requests), before their samples fork
    reqs: list[Request]
    row_nodes: list[int | None]  # each live row's cached prefix (runs of equal nodes are adjacent)
    cascade: bool = False
    cache: object = None
    kv_pos: torch.Tensor | None = None  # (B, L) position of every key slot a row holds, PAD for padding
    next_pos: torch.Tensor | None = None  # (B,)
    live: list[DecodeRow] = field(default_factory=list)
    heads: list[int] | None = None  # each row's next free slot, once rows that joined made them differ

    def keep(self, keep: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Finished rows leave the batch (in place): they stop costing work."""
        kvcache.keep_rows(self.cache, keep)
        index = torch.tensor(keep, device=self.kv_pos.device)
        self.kv_pos, self.next_pos = self.kv_pos[index], self.next_pos[index]
        self.live = [self.live[i] for i in keep]
        self.row_nodes = [self.row_nodes[i] for i in keep]
        if self.heads is not None:
            self.heads = [self.heads[i] for i in keep]
        return tokens[index]

    def absorb(self, new: "BatchState") -> None:
        """Rows prefilled into this batch's free slots join it; from now on each row appends at its
        own next slot (rows differ in length; masks work from positions, so that is exact)."""
        width = max(self.kv_pos.shape[1], new.kv_pos.shape[1])
        heads = (self.heads or [self.kv_pos.shape[1]] * len(self.live)) + [new.kv_pos.shape[1]] * len(new.live)
        self.kv_pos = torch.cat([pad_to(self.kv_pos, width), pad_to(new.kv_pos, width)])  # (B + N, W)
        self.next_pos = torch.cat([self.next_pos, new.next_pos])
        self.live += new.live
        self.row_nodes = self.row_nodes + new.row_nodes
        self.heads = heads
        kvcache.resize_rows(self.cache, len(self.live), width)

    def advance(self) -> torch.Tensor:
        """Key positions for one more token per row (each at its next position); returns q_pos (B, 1)."""
        q_pos = self.next_pos[:, None]  # (B, 1)
        if self.heads is None:  # every row appends at the common end
            self.kv_pos = torch.cat([self.kv_pos, q_pos], dim=1)  # (B, L + 1)
        else:
            width = max(self.heads) + 1
            device = self.kv_pos.device
            slots = torch.tensor(self.heads, device=device)  # (B,)
            self.kv_pos = pad_to(self.kv_pos, width)  # (B, W)
            self.kv_pos[torch.arange(len(self.heads), device=device), slots] = self.next_pos
            kvcache.append_at(self.cache, slots, width)
            self.heads = [h + 1 for h in self.heads]
        self.next_pos = self.next_pos + 1
        return q_pos


def extent(rows: Sequence[Row], reqs: Sequence[Request], cascade: bool) -> tuple[int, int, int]:
    """A batch layout's (prefix width, longest suffix, most new tokens); no prefix in rows with cascade."""
    width = 0 if cascade else max(r.cached for r in rows)
    s_max = max(len(q.prompt_ids) - r.cached for q, r in zip(reqs, rows))
    return width, s_max, max(q.params.max_new_tokens for q in reqs)


def pad_to(kv_pos: torch.Tensor, width: int) -> torch.Tensor:
    """(B, L) key positions widened to (B, width) with padding slots."""
    return torch.nn.functional.pad(kv_pos, (0, width - kv_pos.shape[1]), value=masks.PAD)


def split(rows: tuple[Row, ...]) -> tuple[tuple[Row, ...], tuple[Row, ...]] | None:
    """Halves of a batch that ran out of memory: its rows, else one request's samples; None for one sample."""
    if len(rows) > 1:
        mid = len(rows) // 2
        return rows[:mid], rows[mid:]
    row = rows[0]
    if len(row.samples) > 1:
        mid = row.samples.start + len(row.samples) // 2
        return ((Row(row.key, row.node, row.cached, range(row.samples.start, mid)),),
                (Row(row.key, row.node, row.cached, range(mid, row.samples.stop)),))
    return None


def unfinished(rows: Sequence[Row], finished: set[tuple]) -> tuple[Row, ...]:
    """The rows' samples whose (key, sample index) is not in `finished`, as rows of consecutive samples."""
    out: list[Row] = []
    for row in rows:
        left = [s for s in row.samples if (row.key, s) not in finished]
        start = 0
        for i in range(1, len(left) + 1):
            if i == len(left) or left[i] != left[i - 1] + 1:
                out.append(Row(row.key, row.node, row.cached, range(left[start], left[i - 1] + 1)))
                start = i
    return tuple(out)
