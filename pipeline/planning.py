"""`batchgen plan`: the prefix tree's shape and the prefill it saves, from the tokenizer alone."""
from __future__ import annotations

from typing import Any, Sequence

from jobs import GenerationDefaults, InvalidRow, Job, read_jobs
from pipeline.prefix_tree import PrefixTree
from pipeline.runner import to_requests
from pipeline.schedule import plan, shared_nodes, tree_of
from pipeline.tokenize import Tokenizer


def describe(inputs: Sequence[str], defaults: GenerationDefaults, *, model: str | None = None,
             dataset: str | None = None, split: str = "train", prompt_template: str | None = None,
             system: str | None = None, min_shared_tokens: int = 16, max_batch_tokens: int = 65536,
             top: int = 10, trust_remote_code: bool = False) -> dict[str, Any]:
    from pipeline.model import default_model_path

    jobs: dict[int, Job] = {}
    invalid = 0
    for order, item in enumerate(read_jobs(inputs, defaults, dataset=dataset, split=split,
                                           prompt_template=prompt_template, system=system)):
        if isinstance(item, InvalidRow):
            invalid += 1
        else:
            jobs[order] = item
    source = model if model is not None else str(default_model_path())
    tokenizer = Tokenizer.load(source, trust_remote_code=trust_remote_code)
    requests, bad = to_requests(jobs, tokenizer, None, defaults.seed)
    return summarize([r.prompt_ids for r in requests], [r.params.max_new_tokens for r in requests],
                     [r.params.n for r in requests], invalid=invalid + len(bad), min_shared_tokens=min_shared_tokens,
                     max_batch_tokens=max_batch_tokens, top=top, decode=tokenizer.decode)


def summarize(prompts: Sequence[list[int]], max_new: Sequence[int], ns: Sequence[int], *, invalid: int = 0,
              min_shared_tokens: int = 16, max_batch_tokens: int = 65536, top: int = 10,
              decode=None) -> dict[str, Any]:
    """Pure: the plan's numbers for tokenized prompts: the engine runs exactly this plan (the same
    prefixes, rows and batches), whatever lengths the outputs turn out to have."""
    tree, shapes = tree_of((i, ids[:-1], len(ids), max_new[i], ns[i]) for i, ids in enumerate(prompts))
    full = PrefixTree()
    for i, ids in enumerate(prompts):
        full.insert(i, ids)
    work = plan(tree, shapes, min_shared_tokens=min_shared_tokens, max_batch_tokens=max_batch_tokens)
    shared = shared_nodes(tree, min_shared_tokens)
    # a group: a shared prefix with no shared ancestor; nested: shared prefixes inside it
    groups = [n for n in shared if not _has_shared_ancestor(n, shared)]
    groups.sort(key=lambda n: (-n.size, -n.depth))
    prompt_tokens = sum(len(p) for p in prompts)
    prefill = work.prefill_tokens()

    def example(node) -> str:
        key = node
        while not key.keys:
            key = next(iter(key.children.values()))
        ids = prompts[key.keys[0]][: min(node.depth, 24)]
        return decode(ids) if decode else str(ids)

    return {
        "jobs": len(prompts) + invalid,
        "invalid": invalid,
        "groups": len(groups),
        "shared_prefixes": len(shared),
        "batches": len(work.batches),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": prefill,
        "lower_bound": full.token_count(),
        "prefill_saving": 1 - prefill / prompt_tokens if prompt_tokens else 0.0,
        "top_groups": [
            {"jobs": sum(len(n.keys) for n in g.walk()), "prefix_tokens": g.depth, "nested": sum(1 for n in g.walk() if n in shared) - 1,
             "example": example(g)}
            for g in groups[:top]
        ],
    }


def _has_shared_ancestor(node, shared) -> bool:
    p = node.parent
    while p is not None:
        if p in shared:
            return True
        p = p.parent
    return False
