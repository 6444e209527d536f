"""The engine's plan of one window, from the sorted index's numbers alone (what `batchgen plan`
reports without building a tree; its speed is in BENCHMARKS.md).

`schedule.plan` over `schedule.tree_of_sorted` is the reference: the engine runs that plan. It
builds a Python node per token run and a Row per job, and the tree holds every prompt's tokens;
`plan` needs none of the tokens, only the tree's shape: each node's depth, parent, children in
order and the jobs that end there. In sorted order with the LCPs that shape is a stack walk (the
last sequence's path is the tree's rightmost path: a new sequence climbs it to its LCP, splits
the edge there if it must, and hangs its own leaf last). Here the tree is kept as lists of ints,
and the plan is `schedule.plan`'s walk on them, step for step: the same cached prefixes, rows in
the same order with the same anchors, the same batches and prefill (tests/engine/test_sortedplan.py
compares the two on random job sets). A job of several requests (continuations, rolling windows)
has them all end at its node, in order, each a row, as the engine's tree has them. Jobs of a LoRA
adapter hang from that adapter's own root (a node of depth 0 below the root, never cached), as in
the engine's tree (`PrefixTree`); in sorted order they come after the base model's, by adapter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from batchgen.pipeline.engine.schedule import COPY_LIMIT, MAX_BATCH_TOKENS, MIN_SHARED_TOKENS, SLOT_ROUND, BatchShape
from batchgen.pipeline.engine.types import RequestShape


@dataclass
class WindowPlan:
    """`schedule.Plan`'s numbers. Jobs are the window's positions 0..k-1, their requests 0..r-1
    (job j's are first[j]..first[j + 1] - 1)."""

    prefixes: list[tuple[int, int, int]]  # (a job whose key holds it, start, end), parents first
    rows: list[int]  # requests in the order they run (a request's samples split over slots count once)
    batches: list[BatchShape]
    prefill_tokens: int


def plan_sorted(lengths: Sequence[int], held: Sequence[int], weights: Sequence[int], first: Sequence[int],
                shapes: RequestShape, *, min_shared_tokens: int = MIN_SHARED_TOKENS,
                max_batch_tokens: int = MAX_BATCH_TOKENS,
                cascade: bool = True, max_slots: int = 256, adapters: Sequence[int] | None = None) -> WindowPlan:
    """The plan of jobs in sorted order: their key lengths, the LCP of each one's sequence (key
    minus its last token) with the one before (`held`; the first is ignored; 0 where the adapter
    changes), the rows at each one's node (`weights`: its requests' samples), and its requests
    (`first`: where each job's start in `shapes`, lists of each request's numbers), and each one's
    adapter (None: all the base model's); options as `schedule.plan`'s."""
    if len(lengths) and min(lengths) == 0:
        raise ValueError(f"request {list(lengths).index(0)!r} has an empty prompt")
    depth, parent, children, keys, own = _tree(lengths, held, weights, adapters)
    depths = np.asarray(depth, dtype=np.int64)
    size = _sizes(depths, np.asarray(parent, dtype=np.int64), np.asarray(own, dtype=np.int64))
    cached = (size >= 2) & (depths >= max(1, min_shared_tokens))
    cached[0] = False  # the root
    cached, size = cached.tolist(), size.tolist()
    prefixes: list[tuple[int, int, int]] = []
    anchored_of = [0] * len(depth)  # per cached node: the depth of the anchor its rows read
    row_jobs: list[int] = []  # requests, as they end at nodes (a job's in order)
    row_cached: list[int] = []
    row_anchored: list[int] = []
    many = first[-1] > len(lengths)  # some job is several requests
    # (node, deepest cached ancestor-or-self above it), as schedule.plan walks; a node ~v stands
    # for v's children of one row each (a job of one sample alone below), which come last
    stack = [(0, -1)]
    pop, push, by_size = stack.pop, stack.extend, size.__getitem__
    while stack:
        v, above = pop()
        if v < 0:
            ending = [keys[c][0] for c in reversed(children[~v]) if size[c] == 1 and depth[c]]  # ties: last first
        else:
            if cached[v]:
                prefixes.append((_first_job(v, children, keys), depth[above] if above >= 0 else 0, depth[v]))
                above = v
                anchored_of[v] = _anchor_depth(v, parent, cached, depth) if cascade else 0
            ending = keys[v]
            below = children[v]
            if len(below) == 1:
                push([(below[0], above)])
            elif below:  # heaviest first: pushed lightest first (stable: equal sizes in child order)
                heavy = [c for c in below if size[c] > 1 or not depth[c]]  # (an adapter's root is no leaf)
                if len(heavy) < len(below):
                    push([(~v, above)])
                push([(c, above) for c in sorted(heavy, key=by_size)])
        if ending:
            if many:
                ending = [r for j in ending for r in range(first[j], first[j + 1])]
            row_jobs += ending
            row_cached += [depth[above] if above >= 0 else 0] * len(ending)
            row_anchored += [anchored_of[above] if above >= 0 else 0] * len(ending)
    fed, max_new = shapes.fed, shapes.max_new_tokens
    extent = [fed[r] - a + max_new[r] for r, a in zip(row_jobs, row_anchored)]
    samples = [shapes.n[r] for r in row_jobs]
    batches, parts = _batches(extent, samples, max_batch_tokens, max_slots)
    prefill = sum(end - start for _, start, end in prefixes)
    prefill += sum(p * (fed[r] - c) for p, r, c in zip(parts, row_jobs, row_cached))
    return WindowPlan(prefixes, row_jobs, batches, prefill)


def _tree(lengths: Sequence[int], held: Sequence[int], weights: Sequence[int], adapters: Sequence[int] | None = None):
    """`PrefixTree.insert_next` for each job in turn, on lists (node 0 is the root, and each
    adapter's root a child of it of depth 0): each node's depth, parent, children in order, jobs
    ending there and their samples."""
    depth, parent, children, keys, own = [0], [-1], [[]], [[]], [0]
    path = [0]  # root .. the node where the last sequence ended: each the last child of the one before
    climb, step = path.pop, path.append
    new_depth, new_parent, new_children, new_keys, new_own = (depth.append, parent.append, children.append,
                                                              keys.append, own.append)
    top, last = 1, 0  # the path's first node a job may climb back to (an adapter's root: 2); its adapter
    for job, (length, common, weight) in enumerate(zip(lengths, held, weights)):
        if not job:
            common = 0
        if adapters is not None and adapters[job] != last:  # the next adapter's root, below the root
            last, common = adapters[job], 0
            children[0].append(len(depth))
            del path[1:]
            step(len(depth))
            new_depth(0)
            new_parent(0)
            new_children([])
            new_keys([])
            new_own(0)
            top = 2
        while len(path) > top and depth[path[-2]] >= common:  # up to the edge that holds token `common`
            climb()
        node = path[-1]
        if depth[node] > common:  # split its edge: the middle node takes its place, last of its parent
            mid, up = len(depth), parent[node]
            new_depth(common)
            new_parent(up)
            new_children([node])
            new_keys([])
            new_own(0)
            children[up][-1] = mid
            parent[node] = mid
            path[-1] = node = mid
        if length - 1 > common:
            step(len(depth))
            children[node].append(len(depth))
            new_depth(length - 1)
            new_parent(node)
            new_children([])
            new_keys([job])
            new_own(weight)
        else:
            keys[node].append(job)
            own[node] += weight
    return depth, parent, children, keys, own


def _sizes(depth: np.ndarray, parent: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Rows at or below each node (a job counts its samples): level by level, deepest first (a
    node is deeper than its parent, so one level's nodes never hold each other)."""
    size = own.copy()
    order = np.argsort(-depth, kind="stable")
    cuts = np.flatnonzero(np.diff(depth[order])) + 1
    for level in np.split(order, cuts):
        if depth[level[0]] > 0:
            np.add.at(size, parent[level], size[level])
    return size


def _first_job(v: int, children: list[list[int]], keys: list[list[int]]) -> int:
    while not keys[v]:  # schedule._representative: any job below holds the prefix
        v = children[v][0]
    return keys[v][0]


def _anchor_depth(v: int, parent: list[int], cached: list[bool], depth: list[int]) -> int:
    """schedule._anchor: the shallowest cached ancestor-or-self at most COPY_LIMIT tokens above."""
    anchor, up = v, parent[v]
    while up >= 0:
        if cached[up]:
            if depth[v] - depth[up] > COPY_LIMIT:
                break
            anchor = up
        up = parent[up]
    return depth[anchor]


def _batches(extent: list[int], samples: list[int], budget: int, max_slots: int) -> tuple[list[BatchShape], list[int]]:
    """schedule.batch_shapes on numbers: the batches, and the parts each row runs in (a row with
    more samples than its batch has slots runs in parts, all in that batch, each re-running its
    suffix). Returns shapes whose start/end count parts, as batch_shapes' rows do."""
    shapes: list[BatchShape] = []
    parts = [1] * len(extent)
    i, done = 0, 0
    while i < len(extent):
        capacity = _round(extent[i])
        while True:
            slots = max(1, min(max_slots, budget // capacity))
            seen, j, widest = 0, i, 0
            while j < len(extent) and seen < 2 * slots:
                widest = max(widest, extent[j])
                seen += samples[j]
                j += 1
            if _round(widest) <= capacity:
                break
            capacity = _round(widest)
        start, taken = done, 0
        while i < len(extent) and extent[i] <= capacity:
            parts[i] = -(-samples[i] // slots)
            done += parts[i]
            taken += samples[i]
            i += 1
        shapes.append(BatchShape(start, done, min(slots, taken), capacity))
    return shapes, parts


def _round(n: int) -> int:
    return -(-n // SLOT_ROUND) * SLOT_ROUND
