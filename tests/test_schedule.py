import random

from hypothesis import given, settings, strategies as st

from pipeline.prefix_tree import PrefixTree
from pipeline.schedule import Batch, JobShape, Prefill, Release, plan


def build(prompts, new=4, n=None):
    tree, shapes = PrefixTree(), {}
    for i, p in enumerate(prompts):
        tree.insert(i, p[:-1])
        shapes[i] = JobShape(len(p), new, (n or {}).get(i, 1))
    return tree, shapes


def simulate(ops, prompts, shapes):
    """Replay ops like the engine; check liveness, return (prefill tokens, samples run per job)."""
    alive, depth, work, runs = set(), {}, 0, {}
    released = set()
    for op in ops:
        if isinstance(op, Prefill):
            assert op.node not in alive and op.node not in released
            if op.parent is not None:
                assert op.parent in alive and depth[op.parent] == op.start
            else:
                assert op.start == 0
            # the representative's prompt holds the node's tokens
            alive.add(op.node)
            depth[op.node] = op.end
            work += op.end - op.start
        elif isinstance(op, Release):
            assert op.node in alive
            alive.remove(op.node)
            released.add(op.node)
        else:
            assert isinstance(op, Batch) and op.rows
            for row in op.rows:
                if row.node is not None:
                    assert row.node in alive and depth[row.node] == row.cached
                assert row.cached <= len(prompts[row.key]) - 1
                work += len(prompts[row.key]) - row.cached
                runs.setdefault(row.key, []).extend(row.samples)
    assert not alive, "every prefix is released"
    for key, shape in shapes.items():
        assert sorted(runs[key]) == list(range(shape.n)), "each sample runs exactly once"
    return work


def test_nested_prefixes_each_prefilled_once_and_released():
    rng = random.Random(1)
    system = [rng.randrange(100) for _ in range(30)]
    shots = [[rng.randrange(100) for _ in range(20)] for _ in range(2)]
    prompts = [system + s + [rng.randrange(100) for _ in range(5)] for s in shots for _ in range(3)]
    prompts += [system + [7], system]  # a prompt equal to the shared prefix
    tree, shapes = build(prompts)
    ops = plan(tree, shapes, min_shared_tokens=8)
    prefills = [op for op in ops if isinstance(op, Prefill)]
    # system[:29] is shared by all; `system` itself (held back from system + [7]) by seven; each shot by three
    assert sorted(op.end - op.start for op in prefills) == [1, 20, 20, 29]
    work = simulate(ops, prompts, shapes)
    full = PrefixTree()
    for i, p in enumerate(prompts):
        full.insert(i, p)
    assert full.token_count() <= work <= full.token_count() + len(prompts)


def test_min_shared_tokens_skips_trivial_overlaps():
    prompts = [[1, 2, 3, 10 + i, 11, 12] for i in range(4)]
    tree, shapes = build(prompts)
    assert not [op for op in plan(tree, shapes, min_shared_tokens=4) if isinstance(op, Prefill)]
    assert [op.end for op in plan(tree, shapes, min_shared_tokens=3) if isinstance(op, Prefill)] == [3]


def test_heaviest_subtree_first():
    prompts = [[1] * 10 + [2] + [k] for k in range(2)] + [[3] * 10 + [4] + [k] for k in range(5)]
    tree, shapes = build(prompts)
    first = next(op for op in plan(tree, shapes, min_shared_tokens=4) if isinstance(op, Prefill))
    assert prompts[first.key][0] == 3


def test_budget_splits_large_groups_and_n_samples():
    prompts = [[9] * 20 + [k, k] for k in range(10)]
    tree, shapes = build(prompts, new=10, n={0: 7})
    ops = plan(tree, shapes, min_shared_tokens=4, max_batch_tokens=100)  # 32 tokens a row: 3 rows a batch
    batches = [op for op in ops if isinstance(op, Batch)]
    for b in batches:
        assert sum(len(r.samples) for r in b.rows) * 32 <= 100
    simulate(ops, prompts, shapes)
    assert len(batches) >= 6


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=10), min_size=1, max_size=14),
    st.integers(1, 4), st.integers(1, 3), st.integers(8, 200),
)
def test_any_job_set_runs_every_sample_once_within_the_bound(prompts, min_shared, n, budget):
    tree, shapes = build(prompts, new=3, n={0: n})
    ops = plan(tree, shapes, min_shared_tokens=min_shared, max_batch_tokens=budget)
    work = simulate(ops, prompts, shapes)
    full = PrefixTree()
    for i, p in enumerate(prompts):
        full.insert(i, p)
    if min_shared == 1 and n == 1 and budget >= 200:
        assert work <= full.token_count() + len(prompts)
    assert work <= sum(len(p) for p in prompts) * max(1, n)
