"""The one owner of a run's cached prefixes: what each holds (its keys and values, and the prompt
scores it keeps for the rows below), from its first prefill to its free.

A prefix's reference count is the number of unfinished rows that will read it or a prefix below
it (SGLang's inc_lock_ref/dec_lock_ref on its radix cache, vLLM's ref_cnt in one block pool): a run
locks every row's prefix, and so every prefix above it, before it starts; a prefix is made when
its first reader is admitted, from its parent's (a child copies the tokens of its parent it
holds); and it is freed when its count falls to zero, never before its last reader finishes.
Memory grows with the tree's depth, not its width: the plan runs a subtree's rows side by side,
and a prefill takes along only the prefixes of the rows next in line for the batch's slots.

What a prefix holds is made by the factory the cache is given, so its bookkeeping runs without
a model (tests/engine/test_prefix_cache.py gives it a simulated one, as SGLang's
`RadixCache.create_simulated()`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Mapping, TypeVar

from batchgen.pipeline.engine.schedule import Prefix

Held = TypeVar("Held")


@dataclass
class _Entry(Generic[Held]):
    refs: int = 0  # unfinished rows at or below this prefix
    held: Held | None = None  # what the factory made, once it is prefilled


class PrefixCache(Generic[Held]):
    """The prefixes of one plan (parents before children), their counts and what they hold: one map."""

    def __init__(self, prefixes: Mapping[int, Prefix], make: Callable[[Prefix, Held | None], Held]) -> None:
        self.prefixes = prefixes
        self._make = make  # (prefix, what its parent holds, or None at a root) -> what it holds
        self._entries: dict[int, _Entry[Held]] = {}  # locked prefixes only: an entry goes at count 0

    def lock(self, pid: int, count: int = 1) -> None:
        """`count` more unfinished rows read prefix `pid` (and so every prefix above it)."""
        for p in self._chain(pid):
            self._entries.setdefault(p, _Entry()).refs += count

    def unlock(self, pid: int, count: int = 1) -> list[int]:
        """`count` rows reading `pid` finished; frees the prefixes whose count falls to zero and
        returns them, deepest first."""
        chain = self._chain(pid)
        for p in chain:  # checked first: a refused unlock changes nothing
            if p not in self._entries or self._entries[p].refs < count:
                raise RuntimeError(f"prefix {p} unlocked more often than locked")
        freed = []
        for p in chain:
            entry = self._entries[p]
            entry.refs -= count
            if entry.refs == 0:
                del self._entries[p]  # what it held goes with it
                freed.append(p)
        return freed

    def missing(self, needed: Iterable[int]) -> list[list[int]]:
        """The prefixes these rows read, and any above them, that hold nothing yet: one tree level
        per list, parents' levels first (a level is made once the one above is prefilled)."""
        todo = self._unheld(needed)
        levels = []
        while todo:
            level = sorted(p for p in todo if self.prefixes[p].parent not in todo)
            levels.append(level)
            todo -= set(level)
        return levels

    def with_upcoming(self, needed: Iterable[int], upcoming: Iterable[int | None], budget: int) -> set[int]:
        """`needed`, and then the prefixes of the rows queued next (`upcoming`, in order; None: a row
        without one) while the tokens still to prefill for all of them stay within `budget`; only
        where `needed` misses some already. A forward that prefills prefixes anyway takes the ones
        the next rows will read too, instead of each admission of a few rows running its own small
        forward, whose weight matmuls see few rows (BENCHMARKS.md, "prefix prefills in fewer forwards")."""
        chosen = set(needed)
        todo = self._unheld(chosen)
        if not todo:
            return chosen
        tokens = self._tokens(todo)
        for pid in upcoming:
            if pid is None or pid in chosen:
                continue
            more = self._unheld([pid]) - todo
            cost = self._tokens(more)
            if tokens + cost > budget:
                break
            chosen.add(pid)
            todo |= more
            tokens += cost
        return chosen

    def _unheld(self, needed: Iterable[int]) -> set[int]:
        """These prefixes and the ones above them that hold nothing yet."""
        todo: set[int] = set()
        for pid in needed:
            while pid is not None and not self.holds(pid) and pid not in todo:
                todo.add(pid)
                pid = self.prefixes[pid].parent
        return todo

    def _tokens(self, pids: Iterable[int]) -> int:
        """Tokens a prefill of these prefixes computes: each one's own, [start, end)."""
        return sum(self.prefixes[p].end - self.prefixes[p].start for p in pids)

    def make(self, pid: int) -> Held:
        """Prefix `pid` is about to be prefilled: what it holds, made from its parent's."""
        entry = self._entries.get(pid)
        if entry is None:
            raise RuntimeError(f"prefix {pid} is made while no row holds it")
        if entry.held is not None:
            raise RuntimeError(f"prefix {pid} is made twice")
        parent = self.prefixes[pid].parent
        entry.held = self._make(self.prefixes[pid], self[parent] if parent is not None else None)
        return entry.held

    def holds(self, pid: int) -> bool:
        entry = self._entries.get(pid)
        return entry is not None and entry.held is not None

    def __getitem__(self, pid: int) -> Held:
        entry = self._entries.get(pid)
        if entry is None or entry.held is None:
            raise KeyError(f"prefix {pid} holds nothing (not made yet, or freed)")
        return entry.held

    def refs(self, pid: int) -> int:
        entry = self._entries.get(pid)
        return entry.refs if entry is not None else 0

    def __len__(self) -> int:
        """Prefixes holding something now."""
        return sum(e.held is not None for e in self._entries.values())

    def _chain(self, pid: int) -> list[int]:
        """`pid` and the prefixes above it, deepest first."""
        chain = []
        while pid is not None:
            chain.append(pid)
            pid = self.prefixes[pid].parent
        return chain
