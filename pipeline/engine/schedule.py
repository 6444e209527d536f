"""Scheduling policy: pure functions from the prefix tree to the work, in the order it runs.

- Which prefixes to cache: those read by two or more rows (a prompt with n samples counts n) and
  at least `min_shared_tokens` long. Each is prefilled once, from its cached parent.
- Rows in depth-first order, heaviest subtree first: rows that share a prefix run side by side,
  and a prefix lives only while its subtree runs (memory grows with the tree's depth, not width).
- Each row's attention anchor: the cached prefix it reads through shared-prefix attention, once
  per step for all its rows. A short nested prefix below the anchor (a few template tokens shared
  by some questions) is copied into the rows' own caches instead, so a batch reads a few prefixes
  per layer, not one per leaf of the tree. Without shared-prefix attention every row copies its
  whole cached prefix (the copy path).
- Batch shapes: row slots x tokens per slot under the token budget. A batch takes rows in order,
  as slots free (continuous batching), until a row outgrows its slots; that row starts the next.
  The engine and `batchgen plan` both read these shapes, so plan predicts the batches that run.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Hashable, Iterable, Mapping, Sequence

from batchgen.pipeline.engine.prefix_tree import Node, PrefixTree

COPY_LIMIT = 16  # nested prefixes up to this many tokens below the anchor are copied into rows
SLOT_ROUND = 16  # slot capacities are rounded up to this, so rows of similar length share a batch
MIN_SHARED_TOKENS = 16  # shorter shared prefixes are not cached separately
MAX_BATCH_TOKENS = 65536  # a batch's KV-cache budget: row slots x tokens per slot


@dataclass(frozen=True)
class JobShape:
    prompt_len: int
    max_new_tokens: int
    n: int = 1
    reserve: int = 0  # own tokens beyond these: a conversation's later turns (`Request.reserve`)


@dataclass(frozen=True)
class Prefix:
    """Cached prefix `id`: the keys and values of tokens [0, end) of request `key`'s prompt,
    computed as its parent's (tokens [0, start)) plus tokens [start, end). One no row or prefix
    reads as its anchor holds only tokens [base, end): it is prefilled over prefix `anchor`
    (tokens [0, base)), and rows copy its tokens from there (copying a long parent into each short
    nested prefix wrote 1.4 GB of fresh memory on two documents; BENCHMARKS.md)."""

    id: int
    parent: int | None
    key: Hashable
    start: int
    end: int
    anchor: int | None = None  # the prefix its prefill reads as its anchor; None: it holds [0, end)
    base: int = 0  # that anchor's length: the first token it holds


@dataclass(frozen=True)
class Row:
    """One request, or some of its samples, as the engine runs it."""

    key: Hashable
    samples: range
    prefix: int | None  # deepest cached prefix of the prompt minus its last token
    cached: int  # its length: prompt tokens this row never computes
    anchor: int | None = None  # the cached prefix it reads through shared-prefix attention
    anchored: int = 0  # its length; tokens [anchored, cached) are copied into the row's own cache


@dataclass(frozen=True)
class BatchShape:
    """rows[start:end] run in one batch of `slots` rows of up to `capacity` own tokens each."""

    start: int
    end: int
    slots: int
    capacity: int


@dataclass
class Plan:
    prefixes: dict[int, Prefix]  # parents before children
    nodes: dict[int, Node]  # prefix id -> its tree node (the tokens it caches)
    rows: list[Row]
    batches: list[BatchShape]
    shapes: Mapping[Hashable, JobShape]

    def extent(self, row: Row) -> int:
        """Own tokens a row holds at most: copied, suffix and generated."""
        shape = self.shapes[row.key]
        return shape.prompt_len - row.anchored + shape.max_new_tokens + shape.reserve

    def prefill_tokens(self) -> int:
        """Tokens the engine runs through the model in prefill: each prefix once, each row's suffix."""
        return (sum(p.end - p.start for p in self.prefixes.values())
                + sum(self.shapes[r.key].prompt_len - r.cached for r in self.rows))


def tree_of(jobs: Iterable[tuple]) -> tuple[PrefixTree, dict[Hashable, JobShape]]:
    """The tree the engine plans over, from (key, shareable ids, prompt length, max new tokens, n
    [, adapter [, reserve]]) per job: the ids a shared prefix may hold are the prompt minus its last token
    (whose logits start generation), or less for a request that runs less (`types.shared_length`);
    weighted by the job's samples; under its adapter's root (0, the default: the base model)."""
    tree, shapes = PrefixTree(), {}
    for key, shared, prompt_len, max_new, n, *rest in jobs:
        if not prompt_len:
            raise ValueError(f"request {key!r} has an empty prompt")
        tree.insert(key, shared, weight=n, adapter=rest[0] if rest else 0)
        shapes[key] = JobShape(prompt_len, max_new, n, rest[1] if len(rest) > 1 else 0)
    return tree, shapes


def tree_of_sorted(jobs: Iterable[tuple]) -> tuple[PrefixTree, dict[Hashable, JobShape]]:
    """`tree_of` for jobs in sorted order, each with the LCP of its sequence (prompt minus last
    token) with the one before it (`prefix_index`; 0 where the adapter changes) [and its
    adapter]: the same tree as `tree_of` in that order, built without comparing tokens."""
    tree, shapes = PrefixTree(), {}
    for key, ids, max_new, n, common, *adapter in jobs:
        if not ids:
            raise ValueError(f"request {key!r} has an empty prompt")
        tree.insert_next(key, ids[:-1], common, weight=n, adapter=adapter[0] if adapter else 0)
        shapes[key] = JobShape(len(ids), max_new, n)
    return tree, shapes


def shared_nodes(tree: PrefixTree, min_shared_tokens: int) -> set[Node]:
    """Prefixes worth caching: read by two or more rows and at least min_shared_tokens long."""
    return {
        n for n in tree.nodes()
        if n is not tree.root and n.size >= 2 and n.depth >= max(1, min_shared_tokens)
    }


def plan(
    tree: PrefixTree,
    jobs: Mapping[Hashable, JobShape],
    *,
    min_shared_tokens: int = MIN_SHARED_TOKENS,
    max_batch_tokens: int = MAX_BATCH_TOKENS,
    cascade: bool = True,
    max_slots: int = 256,
) -> Plan:
    """The work for `jobs`, whose sequences (prompt minus its last token) are in `tree`, inserted
    with weight n. `cascade`: rows read their anchor through shared-prefix attention; else each
    row holds a copy of its whole cached prefix."""
    cached = shared_nodes(tree, min_shared_tokens)
    prefixes: dict[int, Prefix] = {}
    nodes: dict[int, Node] = {}
    ids: dict[Node, int] = {}
    rows: list[Row] = []
    # Iterative DFS: (node, deepest cached ancestor-or-self)
    stack: list[tuple[Node, Node | None]] = [(tree.root, None)]
    while stack:
        node, above = stack.pop()
        if node in cached:
            ids[node] = len(ids)
            parent = ids[above] if above is not None else None
            prefixes[ids[node]] = Prefix(ids[node], parent, _representative(node), above.depth if above else 0,
                                         node.depth)
            nodes[ids[node]] = node
            above = node
        for key in node.keys:
            anchor = _anchor(above, cached) if cascade else None
            rows.append(Row(key, range(jobs[key].n), ids[above] if above else None, above.depth if above else 0,
                            ids[anchor] if anchor else None, anchor.depth if anchor else 0))
        # heaviest first; pushed in reverse so the heaviest pops first
        for child in sorted(node.children.values(), key=lambda c: c.size):
            stack.append((child, above))
    if cascade:
        _tails(prefixes, nodes, ids, cached)
    out = Plan(prefixes, nodes, rows, [], jobs)
    out.rows, out.batches = batch_shapes(rows, out.extent, max_batch_tokens, max_slots)
    return out


def _tails(prefixes: dict[int, Prefix], nodes: dict[int, Node], ids: dict[Node, int], cached: set[Node]) -> None:
    """A prefix no row or prefix reads as its anchor (`_anchor` of each cached prefix; a row's
    anchor is its deepest prefix's) holds only its tokens below its own anchor. Those come from its
    parent, which holds them too: the parent's anchor is at or above the child's (it is as near)."""
    anchor_of = {pid: _anchor(node, cached) for pid, node in nodes.items()}
    anchors = set(anchor_of.values())
    for pid, node in nodes.items():
        if node not in anchors:
            anchor = anchor_of[pid]
            prefixes[pid] = replace(prefixes[pid], anchor=ids[anchor], base=anchor.depth)


def _anchor(node: Node | None, cached: set[Node]) -> Node | None:
    """The shallowest cached ancestor-or-self of `node` that is at most COPY_LIMIT tokens above it."""
    if node is None:
        return None
    anchor, up = node, node.parent
    while up is not None:
        if up in cached:
            if node.depth - up.depth > COPY_LIMIT:
                break
            anchor = up
        up = up.parent
    return anchor


def _representative(node: Node) -> Hashable:
    """Any sequence passing through node: its prompt holds node's tokens."""
    while not node.keys:
        node = next(iter(node.children.values()))
    return node.keys[0]


def batch_shapes(rows: Sequence[Row], extent, budget: int, max_slots: int = 256) -> tuple[list[Row], list[BatchShape]]:
    """Cut the row order into batches. A batch's slot capacity covers the rows that will fill it
    about twice over; its slot count is what the budget allows (one at least). It then takes
    every following row that fits, as slots free, and ends at the first row that does not. A
    request with more samples than the batch has slots runs in parts, each re-running only its
    suffix. Returns the rows (parts split) and the batches."""
    todo, out, shapes = deque(rows), [], []
    while todo:
        capacity = _round(extent(todo[0]))
        while True:
            slots = max(1, min(max_slots, budget // capacity))
            ahead, seen = [], 0
            for r in todo:
                if seen >= 2 * slots:
                    break
                ahead.append(r)
                seen += len(r.samples)
            wider = _round(max(extent(r) for r in ahead))
            if wider <= capacity:
                break
            capacity = wider
        start, samples = len(out), 0
        while todo and extent(todo[0]) <= capacity:
            row = todo.popleft()
            if len(row.samples) > slots:
                cut = row.samples.start + slots
                todo.appendleft(replace(row, samples=range(cut, row.samples.stop)))
                row = replace(row, samples=range(row.samples.start, cut))
            out.append(row)
            samples += len(row.samples)
        shapes.append(BatchShape(start, len(out), min(slots, samples), capacity))
    return out, shapes


def _round(n: int) -> int:
    return -(-n // SLOT_ROUND) * SLOT_ROUND
