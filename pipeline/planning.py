"""`batchgen plan`: the prefix tree's shape and the prefill it saves, from the tokenizer alone.

It checks and tokenizes exactly as `process` does (`preflight.check_inputs`, so its invalid count
is what `process` would refuse), cuts the same windows, and plans each window with the engine's
own scheduler (`schedule.plan`) on the tree the engine builds from that window's requests: the
prefixes, the prefill and the batches it reports are the ones `process` runs, summed over
windows. The trees are built from the sorted index (`tree_of_sorted`, no token compared), one
window at a time.
"""
from __future__ import annotations

import gc
from typing import Any, Sequence

import numpy as np

from jobs import GenerationDefaults
from pipeline.prefix_index import PrefixIndex
from pipeline.schedule import plan, tree_of_sorted
from pipeline.windows import COLLECT_JOBS, WINDOW_JOBS, WINDOW_TOKENS, units, windows


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
              top: int = 10, decode=None, window_jobs: int = WINDOW_JOBS,
              window_tokens: int = WINDOW_TOKENS) -> dict[str, Any]:
    """Pure: the plan's numbers for the indexed prompts: the engine runs exactly this plan (the
    same prefixes, rows and batches), whatever lengths the outputs turn out to have."""
    positions = np.arange(len(index))
    jobs, held = index.subset(positions)
    lengths = index.lengths[jobs]
    groups = units(held, lengths, index.weights[jobs], min_shared_tokens)
    cuts = windows(held, lengths, min_shared_tokens, window_jobs, window_tokens)
    unit_of = np.repeat(np.arange(len(groups)), groups.ends - groups.starts)
    size = groups.ends - groups.starts
    weight = np.add.reduceat(index.weights[jobs], groups.starts) if len(groups) else np.zeros(0, np.int64)
    ranked = [k for k in np.lexsort((groups.starts, -groups.depth, -weight)).tolist() if groups.grouped[k]][:top]
    wanted = {int(groups.starts[k]): k for k in ranked}  # first positions of the groups listed
    examples: dict[int, list[int]] = {}
    prefixes_in = np.zeros(len(groups), dtype=np.int64)  # cached prefixes the run prefills per group
    shared = batches = prefill = 0
    prompts = index.prompts(positions)
    for a, b in cuts:
        window = [next(prompts) for _ in range(b - a)]
        for pos, k in wanted.items():
            if a <= pos < b:
                examples[k] = window[pos - a][1][: min(int(groups.depth[k]), 24)]
        commons = held[a:b].copy()
        commons[0] = 0  # a window's first sequence starts its own tree
        numbers = [job for job, _ in window]
        gc.disable()  # a tree is a million small objects: no collection passes while it is built
        try:
            tree, shapes = tree_of_sorted(zip(range(a, b), (ids for _, ids in window), index.max_new[numbers].tolist(),
                                              index.weights[numbers].tolist(), commons.tolist()))
            work = plan(tree, shapes, min_shared_tokens=min_shared_tokens, max_batch_tokens=max_batch_tokens)
        finally:
            gc.enable()
        shared += len(work.prefixes)
        batches += len(work.batches)
        prefill += work.prefill_tokens()
        for p in work.prefixes.values():
            prefixes_in[unit_of[p.key]] += 1
        del window, tree, shapes, work
        if b - a >= COLLECT_JOBS:
            gc.collect()  # the tree's nodes hold each other: freed here, before the next window's
    # a group cut into several windows prefills its top prefix in each: the nested ones are the rest
    inner = [a for a, _ in cuts[1:] if unit_of[a - 1] == unit_of[a]]
    spans = 1 + np.bincount(unit_of[inner], minlength=len(groups)) if len(groups) else np.zeros(0, np.int64)
    prompt_tokens = int(index.lengths.sum())

    def example(k: int) -> str:
        return decode(examples[k]) if decode else str(examples[k])

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
