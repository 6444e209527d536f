"""Prompt logprobs that cached prefixes keep for the rows below them.

A row that scores its prompt (prompt_logprobs, a scoring job) may read a cached prefix that holds
some of its scored tokens: their logits are the same for every row below the prefix, so they are
computed once, in the prefix's own prefill, and kept on it. A prefix keeps the logprob of each of
its tokens from the first any row below scores (and whether it was the argmax), and the
log-softmax at its last position, which scores the token after it: a child prefix's first token,
or a row's first own one. A row's prompt logprobs are then its prefixes' (root first) plus its own
from its suffix's logits. Only prefixes that some row below reads scores from compute any logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping

import torch

from batchgen.pipeline.engine.prefix_cache import PrefixCache
from batchgen.pipeline.engine.rows import token_scores
from batchgen.pipeline.engine.schedule import Plan, Prefix, Row
from batchgen.pipeline.engine.types import Request


@dataclass
class Kept:
    """One prefix's scores: of its tokens from `first` to its end, and its last distribution."""

    first: int
    logprobs: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    last: torch.Tensor | None = None  # (V,) log-softmax at the prefix's last position
    best: int = -1  # its argmax

    def next(self, token: int) -> tuple[float, bool]:
        """The token after the prefix: its logprob, and whether it was the argmax."""
        return float(self.last[token]), token == self.best


class PrefixScores:
    """Which prefixes of one plan keep scores, and how rows read them. The scores themselves are
    held with each prefix's KV in the run's `PrefixCache` (its `kept`), made and freed with it."""

    def __init__(self, plan: Plan, requests: Mapping[Hashable, Request], cache: PrefixCache) -> None:
        self.plan, self.requests, self.cache = plan, requests, cache
        self.need: dict[int, int] = {}  # prefix -> the first prompt token a row below reads from prefixes
        for row in plan.rows:
            first, pid = requests[row.key].score_from, row.prefix
            if first is None or first > row.cached:  # it scores only tokens it runs itself
                continue
            while pid is not None and self.need.get(pid, first + 1) > first:
                self.need[pid] = first
                pid = plan.prefixes[pid].parent

    def open(self, p: Prefix, parent: Kept | None) -> Kept | None:
        """Prefix `p` is about to be prefilled (its parent is, and keeps `parent`): what it will
        keep, if anything."""
        need = self.need.get(p.id, p.end + 1)
        if need > p.end:  # no row below reads a score from it
            return None
        kept = Kept(max(p.start, need))
        if kept.first == p.start and p.start:  # its first token is scored by its parent's last logits
            lp, greedy = parent.next(self._ids(p.id)[p.start])
            kept.logprobs.append(lp)
            kept.greedy.append(greedy)
        return kept

    def positions(self, pid: int, start: int, end: int) -> range:
        """Positions in [start, end) of prefix `pid` whose logits score a token for rows below."""
        kept = self._kept(pid)
        if kept is None:
            return range(0)
        lo = max(start, kept.first - 1)  # the logits before its first kept token score it
        return range(lo, max(lo, end))

    def keep(self, scored: list[tuple[int, int]], logits: torch.Tensor) -> None:
        """(prefix, position) for each row of `logits`: the logprob of the prefix's next token, or,
        at its last position, the whole distribution (the next token is each row's own)."""
        if not scored:
            return
        logprobs, chosen, greedy = token_scores(logits, [self._ids(pid)[q + 1] for pid, q in scored])
        for i, ((pid, q), lp, g) in enumerate(zip(scored, chosen, greedy)):
            kept = self._kept(pid)
            if q == self.plan.prefixes[pid].end - 1:
                kept.last = logprobs[i].clone()
                kept.best = int(kept.last.argmax())
            else:
                kept.logprobs.append(lp)
                kept.greedy.append(g)

    def read(self, row: Row, request: Request) -> tuple[list[float], list[bool]]:
        """What a row reads from its cached prefixes: the logprobs (and argmax flags) of its scored
        tokens before its own suffix, the first of those included."""
        first = request.score_from
        if first is None or row.prefix is None or first > row.cached:
            return [], []
        chain, pid = [], row.prefix
        while pid is not None:
            chain.append(pid)
            pid = self.plan.prefixes[pid].parent
        logprobs, greedy = [], []
        for pid in reversed(chain):  # root first: in prompt order
            p = self.plan.prefixes[pid]
            if p.end > first:
                kept = self._kept(pid)
                skip = max(p.start, first) - kept.first
                logprobs += kept.logprobs[skip:]
                greedy += kept.greedy[skip:]
        lp, g = self._kept(row.prefix).next(request.prompt_ids[row.cached])
        return logprobs + [lp], greedy + [g]

    def _kept(self, pid: int) -> Kept | None:
        return self.cache[pid].kept

    def _ids(self, pid: int) -> list[int]:
        return self.requests[self.plan.prefixes[pid].key].prompt_ids
