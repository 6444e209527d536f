"""Groups of jobs that must run together, the windows a run feeds the engine, and shards.

A job's top shared prefix is the shallowest prefix the engine caches on its path: the node of its
tree (prompt minus last token) at depth `min_shared_tokens`, if two or more rows pass through it.
So the jobs of one top group are exactly a run of neighbours in sorted order whose LCPs (of the
engine's sequences) all reach `min_shared_tokens`, and its depth is the least of those LCPs. A
group is the unit that must stay on one machine and in one engine call, or its prefix is
prefilled twice.

Windows: `process` calls the engine once per window of consecutive positions, so that at most one
window's requests live as Python objects. A window ends where the next job shares less than
`min_shared_tokens` with it (a group boundary: nothing the engine caches spans it), as late as
the window's size allows. Only a group larger than a whole window is cut inside, where its jobs
share the fewest tokens; each extra window then prefills the prefix above the cut once more.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from batchgen.pipeline.run.prefix_index import PrefixIndex

WINDOW_JOBS = 65536  # requests the engine holds at once, at most ...
WINDOW_TOKENS = 16_000_000  # ... and prompt tokens (8 bytes a token in Python lists)
# A window's prefix tree is cyclic (nodes point at their parents): after a window this large it is
# collected at once, before the next is built (a full collection pass is costly with torch loaded)
COLLECT_JOBS = 4096


@dataclass
class Units:
    """Runs of positions (of a subset, in sorted order): each a top group or a job that shares
    nothing cached with another."""

    starts: np.ndarray
    ends: np.ndarray
    depth: np.ndarray  # tokens of the group's top shared prefix (0 for a job alone)
    grouped: np.ndarray  # bool: a top group (its prefix is cached)

    def __len__(self) -> int:
        return len(self.starts)


def units(held: np.ndarray, lengths: np.ndarray, weights: np.ndarray, min_shared: int) -> Units:
    """`held`: LCPs of the engine's sequences with their predecessor; `lengths`, `weights`: of the
    same positions' prompts and samples."""
    m = max(1, min_shared)
    n = len(held)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Units(empty, empty, empty, empty.astype(bool))
    boundary = held < m
    boundary[0] = True
    starts = np.flatnonzero(boundary)
    ends = np.append(starts[1:], n)
    size = ends - starts
    # the least LCP inside each run: over its positions after the first (the boundaries masked)
    inner = np.minimum.reduceat(np.where(boundary, np.iinfo(np.int64).max, held), starts)
    alone = lengths[starts] - 1  # a job alone: its own sequence is cached if it has n >= 2
    grouped = (size > 1) | ((weights[starts] >= 2) & (alone >= m))
    depth = np.where(size > 1, inner, np.where(grouped, alone, 0))
    return Units(starts, ends, depth, grouped)


def reused(held: np.ndarray, lengths: np.ndarray, weights: np.ndarray, min_shared: int) -> np.ndarray:
    """Per position (all jobs of the input, in sorted order): the tokens each of its requests reads
    from a shared prefix in one tree of every job (`schedule.plan`'s Row.cached on that tree): the
    deepest node on its path that two or more rows pass through, at least `min_shared` deep. A
    job of two rows or more is that node itself; else it is as deep as its longer LCP with a
    neighbour. A job's `cached_tokens` is this, whatever windows, shards or resumed runs ran it."""
    nxt = np.append(held[1:], 0)
    depth = np.where(weights >= 2, lengths - 1, np.maximum(held, nxt))
    return np.where(depth >= max(1, min_shared), depth, 0)


def windows(held: np.ndarray, lengths: np.ndarray, min_shared: int, max_jobs: int = WINDOW_JOBS,
            max_tokens: int = WINDOW_TOKENS) -> list[tuple[int, int]]:
    """Cut positions 0..n-1 into windows of at most `max_jobs` jobs and `max_tokens` prompt tokens
    (one job more than that runs alone), cutting group boundaries first, then the shallowest."""
    n = len(held)
    m = max(1, min_shared)
    cost = np.where(held >= m, held, 0)  # prompt tokens a cut before this position prefills again
    total = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=total[1:])
    out, a = [], 0
    while a < n:
        fits = int(np.searchsorted(total, total[a] + max_tokens, side="right")) - 1
        limit = min(n, a + max(1, max_jobs), max(a + 1, fits))
        if limit == n:
            out.append((a, n))
            break
        seg = cost[a + 1 : limit + 1]  # a cut before position c, for c in (a, limit]
        best = seg.min()
        c = a + len(seg) - int(np.argmax(seg[::-1] == best))  # the latest of the cheapest
        out.append((a, c))
        a = c
    return out


def assign_shards(index: PrefixIndex, shards: int, min_shared: int) -> np.ndarray:
    """Shard of each job: whole top groups, heaviest first, to the least-loaded shard (ties: the
    group's earliest job, then the lowest shard), so every shard computes the same assignment."""
    positions = np.arange(len(index))
    jobs, held = index.subset(positions)
    lengths = index.lengths[jobs].astype(np.int64)
    u = units(held, lengths, index.weights[jobs], min_shared)
    out = np.zeros(len(index), dtype=np.int64)
    if not len(u):
        return out
    size = u.ends - u.starts
    # prefill work: the shared prefix once, every job's own tokens
    cost = np.add.reduceat(lengths, u.starts) - (size - 1) * np.where(u.grouped, u.depth, 0)
    first = np.minimum.reduceat(jobs, u.starts)
    load = [(0, s) for s in range(shards)]
    unit_of = np.repeat(np.arange(len(u)), size)
    shard_of_unit = np.zeros(len(u), dtype=np.int64)
    for k in np.lexsort((first, -cost)).tolist():
        least, s = heapq.heappop(load)
        shard_of_unit[k] = s
        heapq.heappush(load, (least + int(cost[k]), s))
    out[jobs] = shard_of_unit[unit_of]
    return out
