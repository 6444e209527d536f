"""Scheduling policy: a pure function from the prefix tree to an ordered list of work.

Depth-first, heaviest subtree first, so a prefix's cache lives only while its subtree runs
(memory is bounded by the tree's depth plus one batch), and rows that share a prefix are
adjacent and land in the same batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence, Union

from pipeline.prefix_tree import Node, PrefixTree


@dataclass(frozen=True)
class JobShape:
    prompt_len: int
    max_new_tokens: int
    n: int = 1


@dataclass(frozen=True)
class Prefill:
    """Compute prefix `node` = parent's cache + prompt_ids[start:end] of request `key` (batch 1)."""

    node: int
    parent: int | None
    key: Hashable
    start: int
    end: int


@dataclass(frozen=True)
class Row:
    """One request in a batch: it reuses `cached` tokens of prefix `node` and runs `samples`."""

    key: Hashable
    node: int | None
    cached: int
    samples: range


@dataclass(frozen=True)
class Batch:
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class Release:
    node: int


Op = Union[Prefill, Batch, Release]


def shared_nodes(tree: PrefixTree, min_shared_tokens: int) -> set[Node]:
    """Prefixes worth caching: shared by two or more sequences and at least min_shared_tokens long."""
    return {
        n for n in tree.nodes()
        if n is not tree.root and n.size >= 2 and n.depth >= max(1, min_shared_tokens)
    }


def top_groups(prompts: Mapping[Hashable, Sequence[int]], min_shared_tokens: int) -> dict[Hashable, Node | None]:
    """Each job's top shared prefix (a cached node with no cached ancestor), or None: the unit that
    must stay on one machine so that no prefix is prefilled twice."""
    tree = PrefixTree()
    for key, ids in prompts.items():
        tree.insert(key, list(ids[:-1]))  # the tree the engine builds
    shared = shared_nodes(tree, min_shared_tokens)
    out: dict[Hashable, Node | None] = {}
    for key in prompts:
        node, top = tree.node_of(key), None
        while node is not None:
            top = node if node in shared else top
            node = node.parent
        out[key] = top
    return out


def plan(
    tree: PrefixTree,
    jobs: Mapping[Hashable, JobShape],
    *,
    min_shared_tokens: int = 16,
    max_batch_tokens: int = 65536,
    prefix_in_rows: bool = True,
) -> list[Op]:
    """Order the work for `jobs`, whose sequences (prompt minus its last token) are in `tree`.

    `prefix_in_rows`: whether each batch row holds a copy of its cached prefix (the copy path)
    or only its own tokens (cascade attention reads the prefix once), for the token budget."""
    cached = shared_nodes(tree, min_shared_tokens)
    ops: list[Op] = []
    packer = _Packer(jobs, max_batch_tokens, ops, prefix_in_rows)
    ids: dict[Node, int] = {}
    # Iterative DFS: (node, id of the deepest cached ancestor, its depth)
    stack: list[tuple[Node, int | None, int]] = [(tree.root, None, 0)]
    while stack:
        node, anchor, anchor_depth = stack.pop()
        if node in cached:
            ids[node] = len(ids)
            ops.append(Prefill(ids[node], anchor, _representative(node), anchor_depth, node.depth))
            anchor, anchor_depth = ids[node], node.depth
        for key in node.keys:
            packer.add(key, anchor, anchor_depth)
        # heaviest first; pushed in reverse so the heaviest pops first
        for child in sorted(node.children.values(), key=lambda c: c.size):
            stack.append((child, anchor, anchor_depth))
    packer.flush()
    return _insert_releases(ops)


def _representative(node: Node) -> Hashable:
    """Any sequence passing through node: its prompt holds node's tokens."""
    while not node.keys:
        node = next(iter(node.children.values()))
    return node.keys[0]


class _Packer:
    """Packs rows into batches under a token budget counted with padding (rows x longest row)."""

    def __init__(self, jobs: Mapping[Hashable, JobShape], budget: int, ops: list[Op], prefix_in_rows: bool) -> None:
        self.jobs, self.budget, self.ops, self.prefix_in_rows = jobs, budget, ops, prefix_in_rows
        self.rows: list[Row] = []
        self.width = 0  # longest cached + suffix + new of the pending rows
        self.count = 0  # pending rows, samples counted

    def add(self, key: Hashable, node: int | None, cached: int) -> None:
        shape = self.jobs[key]
        width = shape.prompt_len + shape.max_new_tokens - (0 if self.prefix_in_rows else cached)
        # an n too large for one batch is split: each part re-runs only the job's suffix
        per_batch = max(1, self.budget // max(1, width))
        for first in range(0, shape.n, per_batch):
            samples = range(first, min(shape.n, first + per_batch))
            new_width = max(self.width, width)
            if self.rows and (self.count + len(samples)) * new_width > self.budget:
                self.flush()
                new_width = width
            self.rows.append(Row(key, node, cached, samples))
            self.width, self.count = new_width, self.count + len(samples)

    def flush(self) -> None:
        if self.rows:
            self.ops.append(Batch(tuple(self.rows)))
        self.rows, self.width, self.count = [], 0, 0


def _insert_releases(ops: list[Op]) -> list[Op]:
    """Free each prefix right after its last use: a child's prefill or a batch of its rows."""
    last_use: dict[int, int] = {}
    for i, op in enumerate(ops):
        if isinstance(op, Prefill):
            last_use[op.node] = i
            if op.parent is not None:
                last_use[op.parent] = i
        elif isinstance(op, Batch):
            for row in op.rows:
                if row.node is not None:
                    last_use[row.node] = i
    releases: dict[int, list[int]] = {}
    for node, i in last_use.items():
        releases.setdefault(i, []).append(node)
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.append(op)
        out.extend(Release(n) for n in sorted(releases.get(i, ())))
    return out


def prefill_cost(ops: list[Op], prompt_len: Mapping[Hashable, int]) -> int:
    """Tokens the engine will run through the model in prefill for these ops."""
    total = 0
    for op in ops:
        if isinstance(op, Prefill):
            total += op.end - op.start
        elif isinstance(op, Batch):
            total += sum(prompt_len[row.key] - row.cached for row in op.rows)
    return total
