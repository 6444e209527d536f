"""The shared prefixes of a pass, prefilled once each: one tree level per round (a child copies
what it holds of its parent's keys and values), every prefix of a level packed into forwards of
up to `step_tokens` tokens, and the prompt positions rows below score kept as they pass.

A mixin of `loop.Pass` (which owns the state it reads: the plan, the run's `PrefixCache`, the
prompt scores, the step size that halves on out-of-memory): the prefill is one concern of the
pass, kept apart from the loop over slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.pipeline.engine.prefix_scores import Kept
from batchgen.pipeline.engine.pressure import release_memory
from batchgen.pipeline.engine.schedule import Prefix
from batchgen.pipeline.model.kv import PrefixKV
from batchgen.pipeline.model.step import Segment, build

SCORED_ROWS = 512  # scored prompt positions per forward: their logits (rows x vocabulary) are held together


@dataclass
class Cached:
    """What a cached prefix holds while rows read it (the run's `PrefixCache` makes and frees it)."""

    kv: PrefixKV
    kept: Kept | None  # the prompt scores it keeps for rows below, if any row reads them


class PrefixFill:
    """`Pass`'s prefill of its cached prefixes."""

    def _prefill_prefixes(self, needed: set[int]) -> None:
        """Compute the cached prefixes these rows read, and any above them not yet computed: one
        tree level per round (a child copies what it holds of its parent's keys), all of a level
        packed in one forward per step_tokens tokens."""
        for level in self.prefixes.missing(needed):
            for pid in level:
                self.prefixes.make(pid)
            self._prefill_level(level)
            self.stats.prefix_nodes += len(level)

    def _new_prefix(self, p: Prefix, parent: Cached | None) -> Cached:
        """What prefix `p` holds (the cache's factory): its keys and values, from its parent's first
        tokens, and the prompt scores it keeps for rows below."""
        kv = PrefixKV(self.layers, p.end, self.dtype, self.device, p.base)
        if parent is not None and p.start > p.base:  # its parent's tokens it holds
            low = p.base
            if parent.kv.base > low:  # the parent holds only its tail: the rest is its anchor's, from 0
                kv.copy_from(self.prefixes[self.plan.prefixes[p.parent].anchor].kv, low, parent.kv.base)
                low = parent.kv.base
            kv.copy_from(parent.kv, low, p.start)
        return Cached(kv, self.scores.open(p, parent.kept if parent else None))

    def _prefill_level(self, level: list[int]) -> None:
        """Prefill these prefixes, chunks of several packed in each forward of up to step_tokens
        tokens; the logits of positions rows below score with, up to SCORED_ROWS per forward."""
        at = {pid: self.plan.prefixes[pid].start for pid in level}  # next position of each prefix
        while at:
            chunks, budget, room = [], self.step_tokens, SCORED_ROWS
            for pid in list(at)[: self.step_tokens]:
                if budget <= 0:
                    break
                p, kv = self.plan.prefixes[pid], self.prefixes[pid].kv
                n = min(p.end - at[pid], budget)
                scored = self.scores.positions(pid, at[pid], at[pid] + n)
                if len(scored) > room:  # their logits would not fit: this forward scores only what does
                    n = scored.start - at[pid] + room
                    scored = range(scored.start, scored.start + room)
                if n <= 0:
                    break
                owner = self.requests[p.key]  # a request below it: its tokens, and its adapter (the tree's key)
                ids = owner.prompt_ids[at[pid] : at[pid] + n]
                anchor = self.prefixes[p.anchor].kv if p.anchor is not None else None  # (p.base: its length)
                chunks.append((pid, Segment(0, 0, kv.k, kv.v, 0, at[pid] - p.base, p.base, anchor, owner.adapter), ids,
                               scored))
                budget, room = budget - n, room - len(scored)
            step = build([], [], [(seg, ids) for _, seg, ids, _ in chunks], None, self.device)
            keep = [seg.t0 + q - seg.base - seg.offset for _, seg, _, scored in chunks for q in scored]
            try:
                logits = self.engine.forward(step, keep)
            except torch.OutOfMemoryError:
                if step.tokens <= 16:
                    raise
                self.stats.oom_splits += 1
                release_memory(self.device)
                self.step_tokens = max(16, min(self.step_tokens, step.tokens) // 2)
                continue
            self.stats.prefill_tokens += step.tokens
            self.scores.keep([(pid, q) for pid, _, _, scored in chunks for q in scored], logits)
            for pid, seg, ids, _ in chunks:
                at[pid] += len(ids)
                if at[pid] == self.plan.prefixes[pid].end:
                    del at[pid]
