import random

from hypothesis import given, settings, strategies as st

from batchgen.pipeline.engine.prefix_cache import PrefixCache
from batchgen.pipeline.engine.prefix_tree import PrefixTree
from batchgen.pipeline.engine.schedule import COPY_LIMIT, plan, tree_of


def build(prompts, new=4, n=None, **kw):
    tree, shapes = tree_of((i, p[:-1], len(p), new, (n or {}).get(i, 1)) for i, p in enumerate(prompts))
    return plan(tree, shapes, **kw)


def simulate(work, prompts):
    """Replay a plan as the engine does, with its reference counts: prefixes are computed from a
    live parent, rows read live prefixes, every prefix is freed once its last row finishes.
    Returns the prefill tokens."""
    cache = PrefixCache(work.prefixes, lambda p, parent: p.id)  # the engine's, holding no KV
    for row in work.rows:
        if row.prefix is not None:
            cache.lock(row.prefix, len(row.samples))
    alive, done, freed, tokens, runs = set(), set(), set(), 0, {}

    def ancestors(pid):
        up = []
        while work.prefixes[pid].parent is not None:
            pid = work.prefixes[pid].parent
            up.append(pid)
        return up

    def compute(pid):
        nonlocal tokens
        if pid in alive:
            return
        assert pid not in freed, "a freed prefix is needed again"
        p = work.prefixes[pid]
        if p.parent is not None:
            compute(p.parent)
            assert work.prefixes[p.parent].end == p.start
        else:
            assert p.start == 0
        assert prompts[p.key][: p.end] == list(work.nodes[pid].tokens_from_root()), "the representative holds it"
        if p.anchor is not None:  # it holds only its tail: prefilled over a whole prefix above it, already live
            a = work.prefixes[p.anchor]
            assert a.anchor is None and p.anchor in alive and p.base == a.end <= p.start
            assert p.anchor in ancestors(pid)
        else:
            assert p.base == 0
        alive.add(pid)
        done.add(pid)
        tokens += p.end - p.start

    for b in work.batches:
        for row in work.rows[b.start : b.end]:
            assert work.extent(row) <= b.capacity or b.end - b.start == 1
            assert len(row.samples) <= b.slots
            if row.prefix is not None:
                compute(row.prefix)
                assert row.cached == work.prefixes[row.prefix].end <= len(prompts[row.key]) - 1
                assert prompts[row.key][: row.cached] == prompts[work.prefixes[row.prefix].key][: row.cached]
            if row.anchor is not None:
                assert row.anchor in alive and row.anchored == work.prefixes[row.anchor].end
                assert row.cached - row.anchored <= COPY_LIMIT
                assert work.prefixes[row.anchor].anchor is None, "an anchor is whole"
            if row.prefix is not None:  # what the row copies, its prefix holds
                assert work.prefixes[row.prefix].base <= row.anchored
            tokens += len(prompts[row.key]) - row.cached
            runs.setdefault(row.key, []).extend(row.samples)
            if row.prefix is not None:  # the row finishes
                for pid in cache.unlock(row.prefix, len(row.samples)):
                    if pid in alive:
                        alive.remove(pid)
                        freed.add(pid)
    assert not alive, "every prefix is freed"
    assert done == set(work.prefixes), "every planned prefix is computed"
    for key, shape in work.shapes.items():
        assert sorted(runs[key]) == list(range(shape.n)), "each sample runs exactly once"
    assert tokens == work.prefill_tokens()
    return tokens


def full_tree_tokens(prompts):
    full = PrefixTree()
    for i, p in enumerate(prompts):
        full.insert(i, p)
    return full.token_count()


def test_nested_prefixes_each_prefilled_once_and_freed():
    rng = random.Random(1)
    system = [rng.randrange(100) for _ in range(30)]
    shots = [[rng.randrange(100) for _ in range(20)] for _ in range(2)]
    prompts = [system + s + [rng.randrange(100) for _ in range(5)] for s in shots for _ in range(3)]
    prompts += [system + [7], system]  # a prompt equal to the shared prefix
    work = build(prompts, min_shared_tokens=8)
    # system[:29] is shared by all; `system` itself (held back from system + [7]) by seven; each shot by three
    assert sorted(p.end - p.start for p in work.prefixes.values()) == [1, 20, 20, 29]
    work_tokens = simulate(work, prompts)
    assert full_tree_tokens(prompts) <= work_tokens <= full_tree_tokens(prompts) + len(prompts)


def test_short_nested_prefixes_are_copied_into_rows_long_ones_are_anchors():
    head = list(range(100, 140))
    short = [head + [1, 2, 3] + [50 + i] for i in range(3)]  # 3 template tokens shared below the head
    long = [head + list(range(200, 200 + COPY_LIMIT + 5)) + [60 + i] for i in range(3)]
    prompts = short + long + [head + [9]]
    work = build(prompts, min_shared_tokens=8)
    by_key = {r.key: r for r in work.rows}
    for k in range(3):
        row = by_key[k]
        assert row.cached == len(head) + 3 and row.anchored == len(head)  # reads the head, copies 3 tokens
    for k in range(3, 6):
        row = by_key[k]
        assert row.anchored == row.cached == len(head) + COPY_LIMIT + 5  # its own prefix is its anchor
    copy = build(prompts, min_shared_tokens=8, cascade=False)
    assert all(r.anchor is None and r.anchored == 0 for r in copy.rows)
    assert copy.prefill_tokens() == work.prefill_tokens()  # the same work, held differently


def test_a_nested_prefix_no_row_anchors_at_holds_only_its_tail():
    """head (40) > mid (head + 10, rows below read head and copy 10) > deep (mid + 20: its own anchor,
    too far below head). mid holds tokens [40, 50) only; deep holds all 70, from head and mid."""
    head, mid, deep = list(range(100, 140)), list(range(200, 210)), list(range(300, 320))
    prompts = ([head + [1 + i] for i in range(2)] + [head + mid + [5 + i] for i in range(2)]
               + [head + mid + deep + [9 + i] for i in range(3)])
    work = build(prompts, min_shared_tokens=8)
    by_end = {p.end: p for p in work.prefixes.values()}
    assert sorted(by_end) == [40, 50, 70]
    assert (by_end[40].anchor, by_end[40].base) == (None, 0)
    assert (by_end[50].anchor, by_end[50].base) == (by_end[40].id, 40)
    assert (by_end[70].anchor, by_end[70].base) == (None, 0) and by_end[70].parent == by_end[50].id
    simulate(work, prompts)
    assert all(p.anchor is None for p in build(prompts, min_shared_tokens=8, cascade=False).prefixes.values())


def test_min_shared_tokens_skips_trivial_overlaps():
    prompts = [[1, 2, 3, 10 + i, 11, 12] for i in range(4)]
    assert not build(prompts, min_shared_tokens=4).prefixes
    assert [p.end for p in build(prompts, min_shared_tokens=3).prefixes.values()] == [3]


def test_n_samples_of_one_prompt_share_its_prefix():
    prompt = list(range(10, 40))
    work = build([prompt, [5, 6, 7]], n={0: 4}, min_shared_tokens=8)
    assert [(p.start, p.end) for p in work.prefixes.values()] == [(0, len(prompt) - 1)]
    assert work.prefill_tokens() == len(prompt) + 3  # the prompt once; its last token once for all samples


def test_heaviest_subtree_first():
    prompts = [[1] * 10 + [2] + [k] for k in range(2)] + [[3] * 10 + [4] + [k] for k in range(5)]
    work = build(prompts, min_shared_tokens=4)
    assert prompts[work.rows[0].key][0] == 3


def test_batches_fit_the_budget_and_split_n_samples():
    prompts = [[9] * 20 + [k, k] for k in range(10)]
    work = build(prompts, new=10, n={0: 7}, min_shared_tokens=4, max_batch_tokens=100)
    for b in work.batches:
        assert b.slots * b.capacity <= 100
    assert max(len(r.samples) for r in work.rows) < 7  # job 0's samples run in parts
    simulate(work, prompts)


def test_a_row_wider_than_the_budget_still_runs_alone():
    prompts = [list(range(10, 90)), list(range(200, 205))]
    work = build(prompts, new=4, max_batch_tokens=20)
    assert [(b.slots, b.capacity >= 84) for b in work.batches] == [(1, True)]  # one slot, the rows in turn
    simulate(work, prompts)


def test_a_batch_takes_rows_until_one_outgrows_its_slots():
    short = [[7] * 20 + [i] for i in range(12)]
    longer = [[7] * 20 + [20 + i] * 60 for i in range(2)]
    work = build(short + longer, new=4, min_shared_tokens=4, max_batch_tokens=4 * 16)
    # 4 slots of 16; the short rows (heaviest first) fill them three times over, then the longer
    # rows need wider slots: a batch of their own
    assert [(b.end - b.start, b.slots, b.capacity) for b in work.batches] == [(12, 4, 16), (2, 1, 64)]
    simulate(work, short + longer)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=10), min_size=1, max_size=14),
    st.integers(1, 4), st.integers(1, 3), st.integers(8, 200), st.booleans(),
)
def test_any_job_set_runs_every_sample_once_within_the_bound(prompts, min_shared, n, budget, cascade):
    work = build(prompts, new=3, n={0: n}, min_shared_tokens=min_shared, max_batch_tokens=budget, cascade=cascade)
    tokens = simulate(work, prompts)
    if min_shared == 1 and budget >= 200:
        assert tokens <= full_tree_tokens(prompts) + len(prompts)
    assert tokens <= sum(len(p) for p in prompts) * max(1, n)
