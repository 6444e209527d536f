"""The window plan from the index's numbers (pipeline/sortedplan.py) against the engine's scheduler
on the tree of the same prompts (`schedule.plan` over `tree_of_sorted`): the same cached
prefixes in the same order, the same rows, batches and prefill, on random job sets; and
`batchgen plan`'s summary from either."""
import numpy as np
from hypothesis import given, settings, strategies as st

from pipeline.planning import summarize
from pipeline.prefix_index import PrefixIndex
from pipeline.schedule import plan, tree_of_sorted
from pipeline.sortedplan import plan_sorted

PROMPTS = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=40)
SETTINGS = settings(max_examples=300, deadline=None)


def jobs_of(prompts, data):
    k = len(prompts)
    ns = data.draw(st.lists(st.sampled_from([1, 1, 1, 2, 3, 9]), min_size=k, max_size=k))
    max_new = data.draw(st.lists(st.integers(1, 40), min_size=k, max_size=k))
    return ns, max_new


@SETTINGS
@given(PROMPTS, st.data(), st.integers(0, 5), st.sampled_from([16, 40, 100, 65536]), st.booleans(),
       st.sampled_from([2, 256]))
def test_the_plan_from_numbers_is_the_schedulers_plan(prompts, data, min_shared, budget, cascade, max_slots):
    ns, max_new = jobs_of(prompts, data)
    index = PrefixIndex.of(prompts, ns, max_new, vocab_size=300, run_jobs=7)
    jobs, held = index.subset(np.arange(len(index)))
    jobs = jobs.tolist()
    tree, shapes = tree_of_sorted((i, prompts[j], max_new[j], ns[j], h if i else 0)
                                  for i, (j, h) in enumerate(zip(jobs, held.tolist())))
    want = plan(tree, shapes, min_shared_tokens=min_shared, max_batch_tokens=budget, cascade=cascade,
                max_slots=max_slots)
    got = plan_sorted([len(prompts[j]) for j in jobs], held.tolist(), [ns[j] for j in jobs], [max_new[j] for j in jobs],
                      min_shared_tokens=min_shared, max_batch_tokens=budget, cascade=cascade, max_slots=max_slots)
    assert got.prefixes == [(p.key, p.start, p.end) for p in want.prefixes.values()]
    keys = [r.key for r in want.rows]  # a row split over slots is one job here
    assert got.rows == [k for i, k in enumerate(keys) if not i or keys[i - 1] != k]
    assert got.batches == want.batches
    assert got.prefill_tokens == want.prefill_tokens()


@settings(max_examples=100, deadline=None)
@given(PROMPTS, st.data(), st.integers(0, 5), st.integers(1, 9), st.integers(4, 80))
def test_plans_summary_from_numbers_is_the_reference_one(prompts, data, min_shared, window_jobs, window_tokens):
    ns, max_new = jobs_of(prompts, data)
    index = PrefixIndex.of(prompts, ns, max_new, vocab_size=300, run_jobs=5)
    kw = dict(min_shared_tokens=min_shared, max_batch_tokens=120, window_jobs=window_jobs, window_tokens=window_tokens)
    assert summarize(index, **kw) == summarize(index, reference=True, **kw)


@settings(max_examples=200, deadline=None)
@given(PROMPTS, st.data())
def test_a_prompts_head_comes_back_from_the_tails(prompts, data):
    index = PrefixIndex.of(prompts, vocab_size=300, run_jobs=6)
    position = data.draw(st.integers(0, len(prompts) - 1))
    n = data.draw(st.integers(0, 16))
    assert index.head(position, n) == prompts[int(index.order[position])][:n]
