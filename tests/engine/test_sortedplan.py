"""The window plan from the index's numbers (pipeline/engine/sortedplan.py) against the engine's scheduler
on the tree of the same prompts (`schedule.plan` over `tree_of_sorted`): the same cached
prefixes in the same order, the same rows, batches and prefill, on random job sets; and
`batchgen plan`'s summary from either."""
import numpy as np
from hypothesis import given, settings, strategies as st

from batchgen.pipeline.run.planning import summarize
from batchgen.pipeline.run.prefix_index import PrefixIndex
from batchgen.pipeline.engine.schedule import plan, tree_of, tree_of_sorted
from batchgen.pipeline.engine.sortedplan import plan_sorted
from batchgen.pipeline.engine.types import RequestShape
from batchgen.pipeline.run.windows import reused

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
    shapes = RequestShape([len(prompts[j]) for j in jobs], [len(prompts[j]) for j in jobs], [max_new[j] for j in jobs],
                          [ns[j] for j in jobs])
    got = plan_sorted([len(prompts[j]) for j in jobs], held.tolist(), [ns[j] for j in jobs], list(range(len(jobs) + 1)),
                      shapes, min_shared_tokens=min_shared, max_batch_tokens=budget, cascade=cascade,
                      max_slots=max_slots)
    assert got.prefixes == [(p.key, p.start, p.end) for p in want.prefixes.values()]
    keys = [r.key for r in want.rows]  # a row split over slots is one job here
    assert got.rows == [k for i, k in enumerate(keys) if not i or keys[i - 1] != k]
    assert got.batches == want.batches
    assert got.prefill_tokens == want.prefill_tokens()


def requests_of(prompts, data):
    """Each key's job: a generating one (its prompt), or several requests that share the key but
    its last token and run some tokens of their own beyond it (continuations, a prompt scored)."""
    out = []
    for key in prompts:
        if data.draw(st.booleans()):
            n, new = data.draw(st.sampled_from([1, 1, 2, 9])), data.draw(st.integers(1, 40))
            out.append([RequestShape(len(key), len(key), new, n)])
        else:
            runs = data.draw(st.lists(st.integers(len(key), len(key) + 6), min_size=1, max_size=4))
            out.append([RequestShape(fed + 1, fed, 0, 1) for fed in runs])
    return out


@SETTINGS
@given(PROMPTS, st.data(), st.integers(0, 5), st.sampled_from([16, 40, 65536]), st.booleans())
def test_jobs_of_several_requests_are_planned_as_the_engine_plans_their_requests(prompts, data, min_shared, budget,
                                                                                 cascade):
    requests = requests_of(prompts, data)
    index = PrefixIndex.of(prompts, vocab_size=300, run_jobs=7, requests=requests)
    jobs, held = index.subset(np.arange(len(index)))
    first, shapes = index.requests_of(jobs)
    # the engine's tree: each request in window order, holding its job's key but the last token
    flat = [(j, r) for j in jobs.tolist() for r in requests[j]]
    tree, jobshapes = tree_of((i, prompts[j][:-1], r.fed, r.max_new_tokens, r.n) for i, (j, r) in enumerate(flat))
    want = plan(tree, jobshapes, min_shared_tokens=min_shared, max_batch_tokens=budget, cascade=cascade)
    got = plan_sorted(index.lengths[jobs].tolist(), held.tolist(), index.weights[jobs].tolist(), first.tolist(),
                      RequestShape(*(c.tolist() for c in shapes)), min_shared_tokens=min_shared,
                      max_batch_tokens=budget, cascade=cascade)
    owner = np.repeat(np.arange(len(jobs)), np.diff(first)).tolist()
    assert got.prefixes == [(owner[p.key], p.start, p.end) for p in want.prefixes.values()]
    keys = [r.key for r in want.rows]
    assert got.rows == [k for i, k in enumerate(keys) if not i or keys[i - 1] != k]
    assert got.batches == want.batches
    assert got.prefill_tokens == want.prefill_tokens()
    # every row's cached tokens: what windows.reused says of its job, in one tree of all jobs
    depth = dict(zip(jobs.tolist(), reused(held, index.lengths[jobs], index.weights[jobs], min_shared).tolist()))
    assert all(r.cached == depth[flat[r.key][0]] for r in want.rows)
    kw = dict(min_shared_tokens=min_shared, max_batch_tokens=budget, window_jobs=3, window_tokens=40)
    assert summarize(index, **kw) == summarize(index, reference=True, **kw)


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


@SETTINGS
@given(PROMPTS, st.data(), st.integers(0, 5), st.sampled_from([16, 40, 100, 65536]), st.booleans(),
       st.sampled_from([2, 256]))
def test_with_adapters_the_plan_from_numbers_is_the_schedulers_plan(prompts, data, min_shared, budget, cascade,
                                                                    max_slots):
    """Jobs of adapters 0-3 over the same prompts: sorted by adapter, they share nothing across
    adapters (LCP 0 there), and the plan from numbers is the engine's on its tree of adapter roots."""
    ns, max_new = jobs_of(prompts, data)
    adapters = data.draw(st.lists(st.integers(0, 3), min_size=len(prompts), max_size=len(prompts)))
    index = PrefixIndex.of(prompts, ns, max_new, vocab_size=300, run_jobs=7, adapters=adapters)
    jobs, held = index.subset(np.arange(len(index)))
    jobs = jobs.tolist()
    assert [adapters[j] for j in jobs] == sorted(adapters)
    for i in range(1, len(jobs)):  # what two neighbours share: nothing across adapters
        a, b = prompts[jobs[i - 1]][:-1], prompts[jobs[i]][:-1]
        common = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        assert held[i] == (common if adapters[jobs[i - 1]] == adapters[jobs[i]] else 0)
    tree, shapes = tree_of_sorted((i, prompts[j], max_new[j], ns[j], h if i else 0, adapters[j])
                                  for i, (j, h) in enumerate(zip(jobs, held.tolist())))
    # the same tree as inserting with token comparisons, each sequence under its adapter's root
    compared, _ = tree_of((i, prompts[j][:-1], len(prompts[j]), max_new[j], ns[j], adapters[j])
                          for i, j in enumerate(jobs))
    assert [(n.depth, len(n.tokens), n.size, n.keys) for n in tree.nodes()] == \
        [(n.depth, len(n.tokens), n.size, n.keys) for n in compared.nodes()]
    want = plan(tree, shapes, min_shared_tokens=min_shared, max_batch_tokens=budget, cascade=cascade,
                max_slots=max_slots)
    for p in want.prefixes.values():  # a cached prefix is read by rows of its own adapter only
        readers = {adapters[jobs[r.key]] for r in want.rows if r.prefix == p.id}
        assert readers <= {adapters[jobs[p.key]]}
    shapes = RequestShape([len(prompts[j]) for j in jobs], [len(prompts[j]) for j in jobs], [max_new[j] for j in jobs],
                          [ns[j] for j in jobs])
    got = plan_sorted([len(prompts[j]) for j in jobs], held.tolist(), [ns[j] for j in jobs], list(range(len(jobs) + 1)),
                      shapes, min_shared_tokens=min_shared, max_batch_tokens=budget, cascade=cascade,
                      max_slots=max_slots, adapters=[adapters[j] for j in jobs])
    assert got.prefixes == [(p.key, p.start, p.end) for p in want.prefixes.values()]
    keys = [r.key for r in want.rows]
    assert got.rows == [k for i, k in enumerate(keys) if not i or keys[i - 1] != k]
    assert got.batches == want.batches
    assert got.prefill_tokens == want.prefill_tokens()
    kw = dict(min_shared_tokens=min_shared, max_batch_tokens=budget, window_jobs=3, window_tokens=40)
    report = summarize(index, **kw)
    assert report == summarize(index, reference=True, **kw)
    if not any(adapters):  # only the base model: the report has no adapters (and the index none)
        assert "adapters" not in report and index.adapters is None
        return
    assert sum(a["jobs"] for a in report["adapters"]) == len(prompts)
    assert {a["adapter"] for a in report["adapters"]} == {str(a) if a else None for a in adapters}
    assert sum(a["groups"] for a in report["adapters"]) == report["groups"]
