"""The sorted, front-coded prompt index against the engine's radix tree: the same prompts, the same
shared prefixes and top groups, the same tree when built from it, and windows that keep the
prefill at the radix-tree bound."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import batchgen.pipeline.run.front_coding as front_coding
from batchgen.pipeline.run.prefix_index import IndexBuilder, PrefixIndex
from batchgen.pipeline.engine.prefix_tree import PrefixTree
from batchgen.pipeline.engine.schedule import plan, shared_nodes, tree_of, tree_of_sorted
from batchgen.pipeline.engine.types import RequestShape
from batchgen.pipeline.run.windows import assign_shards, units, windows

PROMPTS = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=30)
SETTINGS = settings(max_examples=150, deadline=None)


def index_of(prompts, ns=None, run_jobs=4):
    return PrefixIndex.of(prompts, weights=ns, vocab_size=300, run_jobs=run_jobs)  # small runs: the merge runs


def lcp(a, b):
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def dump(node):
    """A tree, children in dict order: what the scheduler's walk sees."""
    return (tuple(node.tokens), node.depth, tuple(node.keys), node.size,
            tuple(dump(c) for c in node.children.values()))


def sorted_jobs(index, prompts, positions=None):
    positions = np.arange(len(index)) if positions is None else positions
    jobs, held = index.subset(positions)
    return jobs.tolist(), held.tolist()


@SETTINGS
@given(PROMPTS)
def test_the_index_is_the_stable_sort_with_its_lcps_and_rebuilds_every_prompt(prompts):
    index = index_of(prompts)
    want = sorted(range(len(prompts)), key=lambda i: prompts[i])  # stable: equal prompts in input order
    assert index.order.tolist() == want
    assert index.lcp.tolist() == [0] + [lcp(prompts[a], prompts[b]) for a, b in zip(want, want[1:])]
    assert list(index.prompts(np.arange(len(prompts)))) == [(i, prompts[i]) for i in want]
    full, engines = PrefixTree(), PrefixTree()
    for i, p in enumerate(prompts):
        full.insert(i, p)
        engines.insert(i, p[:-1])
    assert int(index.tails.size) == full.token_count()  # memory: the radix-tree bound in tokens
    # the least prefill: the engine's tree once, and each row's last prompt token itself; what
    # the engine's plan prefills when every prefix two rows read is cached
    assert index.lower_bound() == engines.token_count() + len(prompts)
    tree, shapes = tree_of((i, p[:-1], len(p), 1, 1) for i, p in enumerate(prompts))
    assert index.lower_bound() == plan(tree, shapes, min_shared_tokens=0).prefill_tokens()


@SETTINGS
@given(PROMPTS, st.data())
def test_any_subset_gets_the_lcps_of_the_engines_sequences(prompts, data):
    index = index_of(prompts)
    keep = sorted(data.draw(st.sets(st.integers(0, len(prompts) - 1), min_size=1)))
    jobs, held = sorted_jobs(index, prompts, np.array(keep))
    assert held == [0] + [lcp(prompts[a][:-1], prompts[b][:-1]) for a, b in zip(jobs, jobs[1:])]
    assert [j for j, _ in index.prompts(np.array(keep))] == jobs


@SETTINGS
@given(PROMPTS, st.lists(st.integers(1, 3), min_size=30, max_size=30), st.integers(1, 5))
def test_the_tree_from_the_index_is_the_engines_tree_and_plan(prompts, ns, min_shared):
    ns = ns[: len(prompts)]
    index = index_of(prompts, ns)
    jobs, held = sorted_jobs(index, prompts)
    fast, shapes = tree_of_sorted((j, prompts[j], 2, ns[j], h) for j, h in zip(jobs, held))
    slow, _ = tree_of((j, prompts[j][:-1], len(prompts[j]), 2, ns[j]) for j in jobs)  # what Engine.run builds from requests in this order
    assert dump(fast.root) == dump(slow.root)
    a, b = plan(fast, shapes, min_shared_tokens=min_shared), plan(slow, shapes, min_shared_tokens=min_shared)
    assert (a.prefixes, a.rows, a.batches) == (b.prefixes, b.rows, b.batches)


def reference_top_groups(prompts, ns, min_shared):
    """Each job's top shared prefix in the engine's weighted tree: (frozenset of jobs, depth)."""
    tree, _ = tree_of((i, p[:-1], len(p), 1, ns[i]) for i, p in enumerate(prompts))
    shared = shared_nodes(tree, min_shared)
    groups = {}
    for i in range(len(prompts)):
        node, top = tree.node_of(i), None
        while node is not None:
            top = node if node in shared else top
            node = node.parent
        if top is not None:
            groups.setdefault(id(top), (set(), top.depth))[0].add(i)
    return sorted((sorted(g), d) for g, d in groups.values())


@SETTINGS
@given(PROMPTS, st.lists(st.integers(1, 3), min_size=30, max_size=30), st.integers(1, 5))
def test_units_are_the_radix_trees_top_groups(prompts, ns, min_shared):
    ns = ns[: len(prompts)]
    index = index_of(prompts, ns)
    jobs, held = index.subset(np.arange(len(prompts)))
    u = units(held, index.lengths[jobs], index.weights[jobs], min_shared)
    got = sorted((sorted(jobs[s:e].tolist()), int(d)) for s, e, d, g in zip(u.starts, u.ends, u.depth, u.grouped) if g)
    assert got == reference_top_groups(prompts, ns, min_shared)
    shard = assign_shards(index, 3, min_shared)
    for s, e in zip(u.starts, u.ends):
        assert len(set(shard[jobs[s:e]].tolist())) == 1  # a group never spans shards
    assert (assign_shards(index_of(prompts, ns, run_jobs=1000), 3, min_shared) == shard).all()


def cached_prefixes(tree, min_shared):
    return sorted(tuple(n.tokens_from_root()) for n in shared_nodes(tree, min_shared))


@SETTINGS
@given(PROMPTS, st.lists(st.integers(1, 3), min_size=30, max_size=30), st.integers(1, 5),
       st.integers(1, 8), st.integers(4, 60))
def test_windows_keep_groups_whole_and_the_prefill_at_the_bound(prompts, ns, min_shared, max_jobs, max_tokens):
    ns = ns[: len(prompts)]
    index = index_of(prompts, ns)
    jobs, held = index.subset(np.arange(len(prompts)))
    lengths = index.lengths[jobs]
    whole, shapes = tree_of((i, p[:-1], len(p), 2, ns[i]) for i, p in enumerate(prompts))
    bound = plan(whole, shapes, min_shared_tokens=min_shared).prefill_tokens()
    # windows as large as the job set: one engine call's work, prefix for prefix
    [(a, b)] = windows(held, lengths, min_shared, max_jobs=10**6, max_tokens=10**9)
    assert (a, b) == (0, len(prompts))
    # small windows: every one fits (or holds one job), cuts inside a group only where it cannot fit
    cuts = windows(held, lengths, min_shared, max_jobs=max_jobs, max_tokens=max_tokens)
    assert [a for a, _ in cuts] == [0] + [b for _, b in cuts[:-1]] and cuts[-1][1] == len(prompts)
    u = units(held, lengths, index.weights[jobs], min_shared)
    unit_of = np.repeat(np.arange(len(u)), u.ends - u.starts)
    prefill, seen = 0, []
    for a, b in cuts:
        assert b - a == 1 or (b - a <= max_jobs and lengths[a:b].sum() <= max_tokens)
        if a > 0 and unit_of[a - 1] == unit_of[a]:  # a group cut: it could not fit any window
            k = unit_of[a]
            assert u.ends[k] - u.starts[k] > max_jobs or lengths[u.starts[k]:u.ends[k]].sum() > max_tokens
        tree, shp = tree_of_sorted((j, prompts[j], 2, ns[j], h if i else 0)
                                   for i, (j, h) in enumerate(zip(jobs[a:b].tolist(), held[a:b].tolist())))
        prefill += plan(tree, shp, min_shared_tokens=min_shared).prefill_tokens()
        seen += cached_prefixes(tree, min_shared)
    if all(unit_of[a - 1] != unit_of[a] for a, _ in cuts[1:]):
        # whole groups: the same cached prefixes as one tree of everything, and the same prefill
        assert prefill == bound and sorted(seen) == cached_prefixes(whole, min_shared)
    else:
        assert prefill >= bound


def test_token_ids_outside_the_key_width_are_refused_whole():
    b = IndexBuilder(vocab_size=1000)  # 2-byte keys
    with pytest.raises(ValueError, match="outside"):
        b.add([[1, 2], [70000]], [[RequestShape(2, 2, 1, 1)], [RequestShape(1, 1, 1, 1)]])
    b.add([[3, 2, 1]], [[RequestShape(3, 3, 1, 1)]])
    index = b.build()
    assert len(index) == 1 and list(index.prompts(np.arange(1))) == [(0, [3, 2, 1])]


LONG_PROMPTS = st.tuples(st.lists(st.integers(0, 70000), min_size=200, max_size=300), st.lists(
    st.tuples(st.integers(0, 300), st.lists(st.integers(0, 3), max_size=20)), min_size=12, max_size=40))


@settings(max_examples=80, deadline=None)
@given(LONG_PROMPTS, st.sampled_from([300, 1 << 20]), st.integers(1, 9), st.integers(1, 7), st.data())
def test_long_shared_keys_sort_and_front_code_as_a_plain_sort(case, vocab, run_jobs, block, data):
    """Keys sharing long heads (the LCPs are compared a few words at a time, past many rounds),
    2- and 4-byte ids, merged in blocks: the order and the LCPs a plain sort and compare give,
    per adapter."""
    head, rows = case
    if vocab == 300:
        head = [t % 300 for t in head]
    prompts = [head[:cut] + tail or [1] for cut, tail in rows]
    adapters = data.draw(st.lists(st.integers(0, 2), min_size=len(prompts), max_size=len(prompts)))
    for given_adapters in (None, adapters):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(front_coding, "_MERGE_BLOCK", block)
            b = IndexBuilder(vocab, run_jobs)
            for i, p in enumerate(prompts):  # a job at a time: runs of `run_jobs` sealed, then merged
                b.add([p], [[RequestShape(len(p), len(p), 1, 1)]], [given_adapters[i]] if given_adapters else None)
            index = b.build()
        kind = given_adapters or [0] * len(prompts)
        want = sorted(range(len(prompts)), key=lambda i: (kind[i], prompts[i]))
        assert index.order.tolist() == want
        assert index.lcp.tolist() == [0] + [lcp(prompts[a], prompts[b]) if kind[a] == kind[b] else 0
                                             for a, b in zip(want, want[1:])]
        assert list(index.prompts(np.arange(len(prompts)))) == [(i, prompts[i]) for i in want]
