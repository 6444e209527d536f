"""Benchmark workloads: token-id prompts with a known prefix structure (seeded, reproducible).

Token ids are synthetic by default: uniform draws from [100, vocab) with a seeded RNG. Prefix
sharing is a property of token ids, so the model never needs to read real text for the
scheduling and caching work to be measured. Pass `pool=` (a long token stream, e.g. a text
file run through the model's tokenizer) to draw contiguous windows of real tokens instead.

Every builder returns a `Workload` carrying its prompts and the radix-tree lower bound on
prefill work: the number of distinct (prefix-position, token) pairs over the full prompts,
`PrefixTree().token_count()`; no prefix cache can run fewer prompt tokens through the model.

`scale` shrinks a workload for smoke runs: it multiplies the number of leaf jobs under each
shared prefix (floor 2) and keeps the tree shape and every token length, so the per-job cost
and the sharing pattern stay those of the full workload.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from pipeline.prefix_tree import PrefixTree

DEFAULT_VOCAB = 49152
LOW_ID = 100  # keep clear of special tokens

Draw = Callable[[int], list[int]]


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]  # one per job (request)
    lower_bound: int  # radix-tree prefill lower bound over `prompts`
    description: str
    n: int = 1  # samples per prompt
    temperature: float = 0.0  # 0: greedy

    @property
    def jobs(self) -> int:
        return len(self.prompts)

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all rows (every sample re-reads its prompt when nothing is shared)."""
        return sum(len(p) for p in self.prompts) * self.n


def lower_bound(prompts: Sequence[Sequence[int]]) -> int:
    tree = PrefixTree()
    for i, p in enumerate(prompts):
        tree.insert(i, p)
    return tree.token_count()


def make_draw(rng: random.Random, vocab: int = DEFAULT_VOCAB, pool: Sequence[int] | None = None) -> Draw:
    """`draw(k)`: k fresh token ids: uniform synthetic ids, or a random window of `pool`."""
    if pool is None:
        return lambda k: [rng.randrange(LOW_ID, vocab) for _ in range(k)]
    pool = list(pool)

    def draw(k: int) -> list[int]:
        if k > len(pool):
            raise ValueError(f"token pool has {len(pool)} tokens, a segment needs {k}")
        start = rng.randrange(0, len(pool) - k + 1)
        return pool[start : start + k]

    return draw


def _leaves(count: int, scale: float) -> int:
    return max(2, round(count * scale))


def _vary(rng: random.Random, length: int) -> int:
    """A leaf length around `length` (+-1/3: 30 -> 20..40)."""
    spread = length // 3
    return rng.randint(max(1, length - spread), length + spread)


def _finish(name, prompts, rng, description, **kw) -> Workload:
    rng.shuffle(prompts)  # interleave groups: the system under test must find the sharing itself
    return Workload(name, prompts, lower_bound(prompts), description, **kw)


def _under_heads(rng: random.Random, draw: Draw, heads: int, head_len: int, per_head: int,
                 leaf_len: int) -> list[list[int]]:
    """`heads` shared heads of `head_len` tokens, each followed by `per_head` leaves of ~`leaf_len`."""
    prompts = []
    for _ in range(heads):
        head = draw(head_len)
        prompts += [head + draw(_vary(rng, leaf_len)) for _ in range(per_head)]
    return prompts


def system_prompt(jobs: int = 256, groups: int = 8, prefix: int = 512, suffix: int = 30, *,
                  scale: float = 1.0, seed: int = 0, vocab: int = DEFAULT_VOCAB, pool=None) -> Workload:
    """`groups` shared system prompts of `prefix` tokens, each followed by ~`suffix`-token jobs."""
    rng = random.Random(seed)
    draw = make_draw(rng, vocab, pool)
    per_group = _leaves(jobs // groups, scale)
    prompts = _under_heads(rng, draw, groups, prefix, per_group, suffix)
    return _finish("system_prompt", prompts, rng,
                   f"{groups} groups x {per_group} jobs, prefix {prefix}, suffix {suffix}+-{suffix // 3}")


def fewshot(headers: int = 4, questions: int = 16, header_len: int = 400, q_len: int = 24, *,
            scale: float = 1.0, seed: int = 0, vocab: int = DEFAULT_VOCAB, pool=None) -> Workload:
    """`headers` few-shot headers, each followed by `questions` different questions."""
    rng = random.Random(seed + 1)
    draw = make_draw(rng, vocab, pool)
    per_header = _leaves(questions, scale)
    prompts = _under_heads(rng, draw, headers, header_len, per_header, q_len)
    return _finish("fewshot", prompts, rng,
                   f"{headers} headers x {per_header} questions, header {header_len}, question {q_len}+-{q_len // 3}")


def n_samples(prompts: int = 8, n: int = 8, length: int = 300, temperature: float = 0.7, *,
              scale: float = 1.0, seed: int = 0, vocab: int = DEFAULT_VOCAB, pool=None) -> Workload:
    """`prompts` unrelated prompts, each sampled `n` times (temperature sampling)."""
    rng = random.Random(seed + 2)
    draw = make_draw(rng, vocab, pool)
    count = _leaves(prompts, scale)
    ps = [draw(length) for _ in range(count)]
    return _finish("n_samples", ps, rng, f"{count} prompts of {length} x n={n} samples, T={temperature}",
                   n=n, temperature=temperature)


def nested(system: int = 300, headers: int = 4, header_len: int = 150, docs: int = 3, doc_len: int = 100,
           questions: int = 4, q_len: int = 20, *,
           scale: float = 1.0, seed: int = 0, vocab: int = DEFAULT_VOCAB, pool=None) -> Workload:
    """Three shared levels: system -> few-shot headers -> documents -> questions."""
    rng = random.Random(seed + 3)
    draw = make_draw(rng, vocab, pool)
    per_doc = _leaves(questions, scale)
    sys_ids = draw(system)
    prompts = []
    for _ in range(headers):
        h = sys_ids + draw(header_len)
        for _ in range(docs):
            d = h + draw(doc_len)
            prompts += [d + draw(_vary(rng, q_len)) for _ in range(per_doc)]
    return _finish("nested", prompts, rng,
                   f"system {system} -> {headers} headers of {header_len} -> {docs} docs of {doc_len} "
                   f"-> {per_doc} questions of {q_len}+-{q_len // 3}")


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "system_prompt": system_prompt,
    "fewshot": fewshot,
    "n_samples": n_samples,
    "nested": nested,
}


def build(name: str, *, scale: float = 1.0, seed: int = 0, vocab: int = DEFAULT_VOCAB, pool=None) -> Workload:
    return WORKLOADS[name](scale=scale, seed=seed, vocab=vocab, pool=pool)
