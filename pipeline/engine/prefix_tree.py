"""A radix tree over token ids: every shared prefix, at every level, is one node.

Pure Python, no torch. The scheduling policy walks it; the prefixes it picks to cache live in a
run's `PrefixCache` (prefix_cache.py), which counts their readers.

A sequence's key is its LoRA adapter plus its token ids: the keys and values of a prefix depend on
the adapter, so sequences of different adapters share nothing. Adapter a > 0 has its own root, a
child of the tree's root with no tokens (depth 0, never cached), under the key -a (token ids are
never negative); the base model's sequences hang from the root itself, as without adapters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterator, Sequence


@dataclass(eq=False)
class Node:
    tokens: list[int]  # edge label: the tokens from the parent's end to this node's end
    depth: int  # tokens from the root to this node's end
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)  # first token of the child's edge -> child
    keys: list[Hashable] = field(default_factory=list)  # sequences that end exactly here
    size: int = 0  # rows ending in this subtree (a sequence inserted with weight n counts n)

    @property
    def start(self) -> int:
        return self.depth - len(self.tokens)

    def tokens_from_root(self) -> list[int]:
        parts, node = [], self
        while node is not None:
            parts.append(node.tokens)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def walk(self) -> Iterator["Node"]:
        """Pre-order, iteratively: prompts can nest thousands of nodes deep."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.children.values())))


class PrefixTree:
    """Insert token sequences; shared prefixes become internal nodes (edges are split on divergence)."""

    def __init__(self) -> None:
        self.root = Node(tokens=[], depth=0)
        self._end: dict[Hashable, Node] = {}
        self._last = self.root  # where the last sequence ended (insert_next starts from there)

    def __len__(self) -> int:
        return self.root.size

    def _root_of(self, adapter: int) -> Node:
        """Where the sequences of `adapter` start: the root (the base model), or the adapter's own."""
        if not adapter:
            return self.root
        top = self.root.children.get(-adapter)
        if top is None:
            top = self.root.children[-adapter] = Node(tokens=[], depth=0, parent=self.root)
        return top

    def insert(self, key: Hashable, seq: Sequence[int], weight: int = 1, adapter: int = 0) -> Node:
        """Add a sequence; `weight`: the rows it stands for (n samples of one prompt share its
        tokens); `adapter`: its adapter's index (0: the base model)."""
        if key in self._end:
            raise KeyError(f"sequence {key!r} is already in the tree")
        node, i = self._root_of(adapter), 0
        if node is not self.root:
            self.root.size += weight
        node.size += weight
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                leaf = Node(tokens=list(seq[i:]), depth=len(seq), parent=node, size=weight)
                node.children[seq[i]] = leaf
                node = leaf
                break
            common = _common_length(child.tokens, seq, i)
            if common < len(child.tokens):
                child = self._split(child, common)
            child.size += weight
            node, i = child, i + common
        node.keys.append(key)
        self._end[key] = self._last = node
        return node

    def insert_next(self, key: Hashable, seq: Sequence[int], common: int, weight: int = 1, adapter: int = 0) -> Node:
        """Add a sequence that shares exactly `common` tokens with the one inserted just before it
        and no more with any earlier one (sequences in sorted order, with their longest-common-
        prefix array): no token is compared, and the tree is the one `insert` builds from the same
        sequences in the same order, node for node and child for child."""
        if key in self._end:
            raise KeyError(f"sequence {key!r} is already in the tree")
        node = self._last if common > 0 else self._root_of(adapter)
        while node.depth > 0 and node.start >= common:  # up to the edge that holds token `common`
            node = node.parent
        if node.depth > common:
            node = self._split(node, common - node.start)
        up = node
        while up is not None:
            up.size += weight
            up = up.parent
        if len(seq) > common:
            leaf = Node(tokens=list(seq[common:]), depth=len(seq), parent=node, size=weight)
            node.children[seq[common]] = leaf
            node = leaf
        node.keys.append(key)
        self._end[key] = self._last = node
        return node

    def _split(self, child: Node, at: int) -> Node:
        """Cut child's edge after `at` tokens; the new middle node takes child's place."""
        parent = child.parent
        assert parent is not None
        mid = Node(tokens=child.tokens[:at], depth=child.start + at, parent=parent, size=child.size)
        parent.children[mid.tokens[0]] = mid
        child.tokens = child.tokens[at:]
        child.parent = mid
        mid.children[child.tokens[0]] = child
        return mid

    def node_of(self, key: Hashable) -> Node:
        return self._end[key]

    def nodes(self) -> Iterator[Node]:
        return self.root.walk()

    def token_count(self) -> int:
        """Distinct token prefixes: the least prefill work any prefix cache can do."""
        return sum(len(n.tokens) for n in self.nodes())


def _common_length(edge: list[int], seq: Sequence[int], offset: int) -> int:
    n = min(len(edge), len(seq) - offset)
    if edge[:n] == seq[offset : offset + n]:  # one C-level comparison for a whole shared edge
        return n
    k = 0
    while k < n and edge[k] == seq[offset + k]:
        k += 1
    return k
