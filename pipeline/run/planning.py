"""`batchgen plan`: the prefix tree's shape and the prefill it saves, from the tokenizer alone.

It checks and tokenizes exactly as `process` does (`preflight.check_inputs`, so its invalid count
is what `process` would refuse), cuts the same windows, and plans each window as the engine's
own scheduler (`schedule.plan`) plans the tree the engine builds from that window's requests:
the prefixes, the prefill and the batches it reports are the ones `process` runs, summed over
windows. Each window is planned from the sorted index's numbers (`sortedplan.plan_sorted`: the
same plan without a Python tree or a token list); `summarize(reference=True)` builds the trees
and runs `schedule.plan` itself, and the tests hold the two equal.

The index holds what the engine's requests are made of (`expand.index_entry` builds each job's
requests with the function `process` uses): every continuation, rolling window and sample, and
the tokens each may share, so prompt, prefill and cached tokens are `process`'s to the token.
`cached_tokens` is what the output's rows will say: defined on the tree of all jobs
(`windows.reused`), as in `process`.
"""
from __future__ import annotations

import gc
from contextlib import nullcontext
from typing import Any, Sequence

import numpy as np

from batchgen.jobs import GenerationDefaults
from batchgen.pipeline.run.prefix_index import PrefixIndex
from batchgen.pipeline.engine.schedule import MAX_BATCH_TOKENS, MIN_SHARED_TOKENS, plan, tree_of
from batchgen.pipeline.engine.sortedplan import WindowPlan, plan_sorted
from batchgen.pipeline.engine.types import RequestShape
from batchgen.pipeline.run.windows import WINDOW_JOBS, WINDOW_TOKENS, reused, units, windows
from batchgen.pipeline.run.workers import Workers


def describe(inputs: Sequence[str], defaults: GenerationDefaults, *, model: str | None = None,
             dataset: str | None = None, split: str = "train", prompt_template: str | None = None,
             system: str | None = None, min_shared_tokens: int = MIN_SHARED_TOKENS,
             max_batch_tokens: int = MAX_BATCH_TOKENS,
             top: int = 10, trust_remote_code: bool = False, window_jobs: int = WINDOW_JOBS,
             window_tokens: int = WINDOW_TOKENS, adapters: tuple[str, ...] = (),
             workers: int = 0) -> dict[str, Any]:
    from batchgen.pipeline.run.preflight import check_inputs
    from batchgen.pipeline.run.options import RunOptions

    options = RunOptions(model=model, defaults=defaults, dataset=dataset, split=split, prompt_template=prompt_template,
                         system=system, trust_remote_code=trust_remote_code, adapters=adapters)
    # `workers` processes tokenize a big input, then plan its windows
    with Workers(workers) if workers else nullcontext() as pool:
        checked = check_inputs(list(inputs), options, purpose="plan", workers=pool)
        report = summarize(checked.index, invalid=len(checked.invalid), min_shared_tokens=min_shared_tokens,
                           max_batch_tokens=max_batch_tokens, top=top, decode=checked.tokenizer.decode,
                           window_jobs=window_jobs, window_tokens=window_tokens, labels=checked.adapters.labels(),
                           workers=pool)
    talks = checked.conversations
    if talks is not None and talks.conversations:
        # the index holds each conversation's first turn (the tree shares it); its later turns
        # prefill at least what each later prompt adds besides the replies (`ConversationCounts`)
        report.update(talks.report())
        report["expected_prefill_tokens"] = report["prefill_tokens"] + talks.later_prefill_tokens
    return report


def summarize(index: PrefixIndex, *, invalid: int = 0, min_shared_tokens: int = MIN_SHARED_TOKENS,
              max_batch_tokens: int = MAX_BATCH_TOKENS,
              top: int = 10, decode=None, window_jobs: int = WINDOW_JOBS, window_tokens: int = WINDOW_TOKENS,
              reference: bool = False, labels: dict[int, str | None] | None = None,
              workers: Workers | None = None) -> dict[str, Any]:
    """Pure: the plan's numbers for the indexed prompts: the engine runs exactly this plan (the
    same prefixes, rows and batches), whatever lengths the outputs turn out to have. Each window
    is planned from the index's numbers (`sortedplan`); `reference`: with the engine's own
    scheduler on the tree of the window's prompts instead (slow: for tests). With adapters (the
    index's), groups are per adapter (`labels`: what each adapter index is called), and the
    report lists each adapter's jobs, groups and prompt tokens."""
    positions = np.arange(len(index))
    jobs, held = index.subset(positions)
    adapter = index.adapters[jobs] if index.adapters is not None else None  # by position
    lengths, weights = index.lengths[jobs], index.weights[jobs]
    first, shapes = index.requests_of(jobs)
    groups = units(held, lengths, weights, min_shared_tokens)
    cuts = windows(held, index.prompt_tokens(jobs), min_shared_tokens, window_jobs, window_tokens)
    unit_of = np.repeat(np.arange(len(groups)), groups.ends - groups.starts)
    size = groups.ends - groups.starts
    weight = np.add.reduceat(weights, groups.starts) if len(groups) else np.zeros(0, np.int64)
    ranked = [k for k in np.lexsort((groups.starts, -groups.depth, -weight)).tolist() if groups.grouped[k]][:top]
    prefixes_in = np.zeros(len(groups), dtype=np.int64)  # cached prefixes the run prefills per group
    shared = batches = prefill = 0

    def window(a: int, b: int) -> tuple[Any, ...]:  # the window's requests, numbered from 0
        return (first[a : b + 1] - first[a], RequestShape(*(c[first[a] : first[b]] for c in shapes)),
                min_shared_tokens, max_batch_tokens, adapter[a:b] if adapter is not None else None)

    if reference:
        plans = [_reference_window(index, positions[a:b], held[a:b], *window(a, b)) for a, b in cuts]
    else:
        calls = [(lengths[a:b], held[a:b], weights[a:b], *window(a, b)) for a, b in cuts]
        plans = workers.map(plan_window, calls) if workers is not None and len(cuts) > 1 else \
            [plan_window(*c) for c in calls]
    for (a, _), work in zip(cuts, plans):
        shared += len(work.prefixes)
        batches += len(work.batches)
        prefill += work.prefill_tokens
        for job, _, _ in work.prefixes:
            prefixes_in[unit_of[a + job]] += 1
    # a group cut into several windows prefills its top prefix in each: the nested ones are the rest
    inner = [a for a, _ in cuts[1:] if unit_of[a - 1] == unit_of[a]]
    spans = 1 + np.bincount(unit_of[inner], minlength=len(groups)) if len(groups) else np.zeros(0, np.int64)
    prompt_tokens = int(shapes.prompt_tokens.sum(dtype=np.int64))
    # what the rows will say: each request reads its job's node of the tree of all jobs
    cached = int((reused(held, lengths, weights, min_shared_tokens) * np.diff(first)).sum())

    def example(k: int) -> str:
        ids = index.head(int(groups.starts[k]), min(int(groups.depth[k]), 24))
        return decode(ids) if decode else str(ids)

    names = labels or {}

    def group(k: int) -> dict[str, Any]:
        out = {"jobs": int(size[k]), "prefix_tokens": int(groups.depth[k]),
               "nested": int(prefixes_in[k] - spans[k]), "example": example(k)}
        if adapter is not None:
            i = int(adapter[groups.starts[k]])
            out["adapter"] = names.get(i, str(i) if i else None)
        return out

    per_adapter = []
    if adapter is not None:
        tokens = index.prompt_tokens(jobs)
        for i in np.unique(adapter).tolist():
            mine = adapter == i
            per_adapter.append({"adapter": names.get(i, str(i) if i else None), "jobs": int(mine.sum()),
                                "groups": int((groups.grouped & mine[groups.starts]).sum()),
                                "prompt_tokens": int(tokens[mine].sum())})
    report = {
        "jobs": len(index) + invalid,
        "invalid": invalid,
        "groups": int(groups.grouped.sum()),
        "shared_prefixes": shared,
        "batches": batches,
        "windows": len(cuts),
        "split_groups": int((groups.grouped & (spans > 1)).sum()),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": prefill,
        "cached_tokens": cached,
        "lower_bound": index.lower_bound(),
        "prefill_saving": 1 - prefill / prompt_tokens if prompt_tokens else 0.0,
        "top_groups": [group(k) for k in ranked],
    }
    if per_adapter:
        report["adapters"] = per_adapter
    return report


def plan_window(lengths: np.ndarray, held: np.ndarray, weights: np.ndarray, first: np.ndarray, shapes: RequestShape,
                min_shared_tokens: int, max_batch_tokens: int, adapters: np.ndarray | None = None) -> WindowPlan:
    # a window's plan is millions of small lists and tuples, none in a cycle (refcounts free them):
    # without the collector's passes over the whole heap they trigger, it takes half the time
    enabled = gc.isenabled()
    gc.disable()
    try:
        return plan_sorted(lengths.tolist(), held.tolist(), weights.tolist(), first.tolist(),
                           RequestShape(*(c.tolist() for c in shapes)), min_shared_tokens=min_shared_tokens,
                           max_batch_tokens=max_batch_tokens,
                           adapters=adapters.tolist() if adapters is not None else None)
    finally:
        if enabled:
            gc.enable()


def _reference_window(index: PrefixIndex, positions: np.ndarray, held: np.ndarray, first: np.ndarray,
                      shapes: RequestShape, min_shared_tokens: int, max_batch_tokens: int,
                      adapters: np.ndarray | None = None) -> WindowPlan:
    """A window planned as the engine plans it: `schedule.plan` on the tree `Engine.plan` builds
    from the window's requests, each keyed by its number and holding its key but the last token."""
    keys = [ids for _, ids in index.prompts(positions)]
    owner = np.repeat(np.arange(len(keys)), np.diff(first)).tolist()
    fed, max_new, n = shapes.fed.tolist(), shapes.max_new_tokens.tolist(), shapes.n.tolist()
    kind = adapters.tolist() if adapters is not None else [0] * len(keys)
    tree, jobs = tree_of((r, keys[j][:-1], fed[r], max_new[r], n[r], kind[j]) for r, j in enumerate(owner))
    work = plan(tree, jobs, min_shared_tokens=min_shared_tokens, max_batch_tokens=max_batch_tokens)
    rows = [r.key for r in work.rows]
    return WindowPlan([(owner[p.key], p.start, p.end) for p in work.prefixes.values()],
                      [k for i, k in enumerate(rows) if not i or rows[i - 1] != k], work.batches, work.prefill_tokens())
