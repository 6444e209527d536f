"""The run's one owner of cached prefixes, on a simulated allocator (no model, no torch): what a
prefix holds is made once, from its parent's, after every prefix above it, and freed only when its
last reader (at it or below) finishes; a run frees everything."""
import random

import pytest

from batchgen.pipeline.engine.prefix_cache import PrefixCache
from batchgen.pipeline.engine.schedule import Prefix, plan, tree_of

# 0 (tokens 0-20) <- 1 (20-30) <- 2 (30-34); 3 (0-12) is a second root
PREFIXES = {0: Prefix(0, None, "a", 0, 20), 1: Prefix(1, 0, "a", 20, 30), 2: Prefix(2, 1, "a", 30, 34),
            3: Prefix(3, None, "b", 0, 12)}


class Simulated:
    """An allocator that records what it makes: (prefix, the parent's holding)."""

    def __init__(self):
        self.made = []

    def __call__(self, p, parent):
        self.made.append((p.id, parent))
        return f"kv{p.id}"


def test_nested_prefixes_are_made_parents_first_and_freed_after_their_last_reader():
    make = Simulated()
    cache = PrefixCache(PREFIXES, make)
    cache.lock(2, 2)  # two samples read the deepest prefix
    cache.lock(0)  # a row reads only the root
    assert [cache.refs(p) for p in range(4)] == [3, 2, 2, 0]
    levels = cache.missing({2})
    assert levels == [[0], [1], [2]]
    for level in levels:
        for pid in level:
            cache.make(pid)
    assert make.made == [(0, None), (1, "kv0"), (2, "kv1")] and len(cache) == 3
    assert cache.missing({2, 0}) == []  # made once
    assert cache.unlock(2) == []  # one sample left below
    assert cache[2] == "kv2"
    assert cache.unlock(2) == [2, 1]  # deepest first; the root still has its own reader
    assert not cache.holds(2) and not cache.holds(1) and cache[0] == "kv0"
    with pytest.raises(KeyError):
        cache[1]
    assert cache.unlock(0) == [0]
    assert len(cache) == 0


def test_unlocking_more_than_locked_raises_and_changes_nothing():
    cache = PrefixCache(PREFIXES, Simulated())
    cache.lock(1)
    cache.lock(0)
    with pytest.raises(RuntimeError, match="prefix 1 unlocked more often than locked"):
        cache.unlock(1, 2)
    assert cache.refs(1) == 1 and cache.refs(0) == 2
    with pytest.raises(RuntimeError, match="prefix 3 unlocked"):
        cache.unlock(3)
    assert cache.unlock(1) == [1] and cache.unlock(0) == [0]
    with pytest.raises(RuntimeError, match="unlocked more often"):
        cache.unlock(0)


def test_a_prefix_no_row_holds_is_never_made_and_none_is_made_twice():
    cache = PrefixCache(PREFIXES, Simulated())
    with pytest.raises(RuntimeError, match="no row holds it"):
        cache.make(3)
    cache.lock(3)
    cache.make(3)
    with pytest.raises(RuntimeError, match="made twice"):
        cache.make(3)
    cache.unlock(3)
    with pytest.raises(RuntimeError, match="no row holds it"):  # freed: gone for good
        cache.make(3)


@pytest.mark.parametrize("seed", range(5))
def test_a_plan_replayed_frees_every_prefix_and_none_before_its_last_reader(seed):
    rng = random.Random(seed)
    heads = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    prompts = [rng.choice(heads) + rng.choice(heads)[: rng.randrange(0, 10)] + [rng.randrange(50) for _ in range(3)]
               for _ in range(40)]
    n = {i: rng.choice([1, 1, 3]) for i in range(len(prompts))}
    tree, shapes = tree_of((i, p[:-1], len(p), 4, n[i]) for i, p in enumerate(prompts))
    work = plan(tree, shapes, min_shared_tokens=4, max_batch_tokens=200)
    assert work.prefixes, "the prompts share prefixes"
    make = Simulated()
    cache = PrefixCache(work.prefixes, make)
    for row in work.rows:
        if row.prefix is not None:
            cache.lock(row.prefix, len(row.samples))
    freed = set()
    for row in work.rows:  # each row runs and finishes in plan order, sample by sample
        if row.prefix is None:
            continue
        for level in cache.missing({row.prefix}):
            for pid in level:
                assert pid not in freed, "a freed prefix is needed again"
                cache.make(pid)
        pid = row.prefix
        while pid is not None:  # it reads its prefix and every one above it
            assert cache[pid] == f"kv{pid}"
            pid = work.prefixes[pid].parent
        for _ in row.samples:
            freed.update(cache.unlock(row.prefix))
    assert len(cache) == 0 and freed == set(work.prefixes), "everything is freed at the end of the run"
    assert sorted(pid for pid, _ in make.made) == sorted(work.prefixes), "each prefix is made once"
    for pid, parent in make.made:
        p = work.prefixes[pid]
        assert parent == (f"kv{p.parent}" if p.parent is not None else None)


def test_a_prefix_prefill_takes_along_the_prefixes_of_the_rows_queued_next_within_its_budget():
    cache = PrefixCache(PREFIXES, Simulated())
    for pid in PREFIXES:
        cache.lock(pid)
    # nothing missing now: no prefill runs, so none is taken along
    cache.make(3)
    assert cache.with_upcoming({3}, [0, 1], budget=1000) == {3}
    # prefix 1 misses itself and its parent (30 tokens): the next rows' 2 (4 more) comes along, in order;
    # the row without a prefix (None) and one already chosen are skipped
    assert cache.with_upcoming({1}, [None, 1, 2, 3], budget=34) == {1, 2, 3}
    # no further than the budget: 2's 4 tokens would make 34 > 33, and the scan stops there
    assert cache.with_upcoming({1}, [2, 3], budget=33) == {1}
    assert cache.with_upcoming({1}, iter([2]), budget=0) == {1}  # what the rows admitted need always stays
    for level in cache.missing(cache.with_upcoming({1}, [2], budget=34)):
        for pid in level:
            cache.make(pid)
    assert all(cache.holds(p) for p in PREFIXES)
