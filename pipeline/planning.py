"""`batchgen plan`: the prefix tree's shape and the prefill it saves, from the tokenizer alone.

It checks and tokenizes exactly as `process` does (`preflight.check_inputs`, so its invalid count
is what `process` would refuse), cuts the same windows, and plans each window as the engine's
own scheduler (`schedule.plan`) plans the tree the engine builds from that window's requests:
the prefixes, the prefill and the batches it reports are the ones `process` runs, summed over
windows. Each window is planned from the sorted index's numbers (`sortedplan.plan_sorted`: the
same plan without a Python tree or a token list); `summarize(reference=True)` builds the trees
and runs `schedule.plan` itself, and the tests hold the two equal.
"""
from __future__ import annotations

import gc
from typing import Any, Sequence

import numpy as np

from jobs import GenerationDefaults
from pipeline.prefix_index import PrefixIndex
from pipeline.schedule import plan, tree_of_sorted
from pipeline.sortedplan import WindowPlan, plan_sorted
from pipeline.windows import WINDOW_JOBS, WINDOW_TOKENS, units, windows


def describe(inputs: Sequence[str], defaults: GenerationDefaults, *, model: str | None = None,
             dataset: str | None = None, split: str = "train", prompt_template: str | None = None,
             system: str | None = None, min_shared_tokens: int = 16, max_batch_tokens: int = 65536,
             top: int = 10, trust_remote_code: bool = False, window_jobs: int = WINDOW_JOBS,
             window_tokens: int = WINDOW_TOKENS) -> dict[str, Any]:
    from pipeline.preflight import check_inputs
    from pipeline.runner import RunOptions

    options = RunOptions(model=model, defaults=defaults, dataset=dataset, split=split, prompt_template=prompt_template,
                         system=system, trust_remote_code=trust_remote_code)
    checked = check_inputs(list(inputs), options, purpose="plan")
    return summarize(checked.index, invalid=len(checked.invalid), min_shared_tokens=min_shared_tokens,
                     max_batch_tokens=max_batch_tokens, top=top, decode=checked.tokenizer.decode,
                     window_jobs=window_jobs, window_tokens=window_tokens)


def summarize(index: PrefixIndex, *, invalid: int = 0, min_shared_tokens: int = 16, max_batch_tokens: int = 65536,
              top: int = 10, decode=None, window_jobs: int = WINDOW_JOBS, window_tokens: int = WINDOW_TOKENS,
              reference: bool = False) -> dict[str, Any]:
    """Pure: the plan's numbers for the indexed prompts: the engine runs exactly this plan (the
    same prefixes, rows and batches), whatever lengths the outputs turn out to have. Each window
    is planned from the index's numbers (`sortedplan`); `reference`: with the engine's own
    scheduler on the tree of the window's prompts instead (slow: for tests)."""
    positions = np.arange(len(index))
    jobs, held = index.subset(positions)
    lengths, weights, max_new = index.lengths[jobs], index.weights[jobs], index.max_new[jobs]
    groups = units(held, lengths, weights, min_shared_tokens)
    cuts = windows(held, lengths, min_shared_tokens, window_jobs, window_tokens)
    unit_of = np.repeat(np.arange(len(groups)), groups.ends - groups.starts)
    size = groups.ends - groups.starts
    weight = np.add.reduceat(weights, groups.starts) if len(groups) else np.zeros(0, np.int64)
    ranked = [k for k in np.lexsort((groups.starts, -groups.depth, -weight)).tolist() if groups.grouped[k]][:top]
    prefixes_in = np.zeros(len(groups), dtype=np.int64)  # cached prefixes the run prefills per group
    shared = batches = prefill = 0
    for a, b in cuts:
        if reference:
            work = _reference_window(index, positions[a:b], held[a:b], min_shared_tokens, max_batch_tokens)
        else:
            work = _window(lengths[a:b], held[a:b], weights[a:b], max_new[a:b], min_shared_tokens, max_batch_tokens)
        shared += len(work.prefixes)
        batches += len(work.batches)
        prefill += work.prefill_tokens
        for first, _, _ in work.prefixes:
            prefixes_in[unit_of[a + first]] += 1
    # a group cut into several windows prefills its top prefix in each: the nested ones are the rest
    inner = [a for a, _ in cuts[1:] if unit_of[a - 1] == unit_of[a]]
    spans = 1 + np.bincount(unit_of[inner], minlength=len(groups)) if len(groups) else np.zeros(0, np.int64)
    prompt_tokens = int(index.lengths.sum())

    def example(k: int) -> str:
        ids = index.head(int(groups.starts[k]), min(int(groups.depth[k]), 24))
        return decode(ids) if decode else str(ids)

    return {
        "jobs": len(index) + invalid,
        "invalid": invalid,
        "groups": int(groups.grouped.sum()),
        "shared_prefixes": shared,
        "batches": batches,
        "windows": len(cuts),
        "split_groups": int((groups.grouped & (spans > 1)).sum()),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": prefill,
        "lower_bound": index.lower_bound(),
        "prefill_saving": 1 - prefill / prompt_tokens if prompt_tokens else 0.0,
        "top_groups": [
            {"jobs": int(size[k]), "prefix_tokens": int(groups.depth[k]),
             "nested": int(prefixes_in[k] - spans[k]), "example": example(k)}
            for k in ranked
        ],
    }


def _window(lengths: np.ndarray, held: np.ndarray, weights: np.ndarray, max_new: np.ndarray, min_shared_tokens: int,
            max_batch_tokens: int) -> WindowPlan:
    # a window's plan is millions of small lists and tuples, none in a cycle (refcounts free them):
    # without the collector's passes over the whole heap they trigger, it takes half the time
    enabled = gc.isenabled()
    gc.disable()
    try:
        return plan_sorted(lengths.tolist(), held.tolist(), weights.tolist(), max_new.tolist(),
                           min_shared_tokens=min_shared_tokens, max_batch_tokens=max_batch_tokens)
    finally:
        if enabled:
            gc.enable()


def _reference_window(index: PrefixIndex, positions: np.ndarray, held: np.ndarray, min_shared_tokens: int,
                      max_batch_tokens: int) -> WindowPlan:
    """A window planned as the engine plans it: `schedule.plan` on the tree of its prompts."""
    window = list(index.prompts(positions))
    numbers = [job for job, _ in window]
    commons = held.copy()
    commons[0] = 0  # a window's first sequence starts its own tree
    tree, shapes = tree_of_sorted(zip(range(len(window)), (ids for _, ids in window), index.max_new[numbers].tolist(),
                                      index.weights[numbers].tolist(), commons.tolist()))
    work = plan(tree, shapes, min_shared_tokens=min_shared_tokens, max_batch_tokens=max_batch_tokens)
    keys = [r.key for r in work.rows]
    return WindowPlan([(p.key, p.start, p.end) for p in work.prefixes.values()],
                      [k for i, k in enumerate(keys) if not i or keys[i - 1] != k], work.batches, work.prefill_tokens())
