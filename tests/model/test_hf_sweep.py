"""The sweep that earns transformers' model code's allow-list (`batchgen.pipeline.model.hf_support`).

For every model type on the list, random tiny configs (tests/helpers/hf_families.py: key/value
heads, head sizes, biases, QK norms, sliding windows and layer types, rope types, MoE routing,
multipliers, NoPE layers, MLA, attention sinks), every 1-D weight randomised so that no knob is a
no-op, saved and loaded as the CLI loads them (`load_model`, transformers' model code), run by the
engine on jobs with nested shared prefixes, a prompt equal to a shared prefix, one-token prompts,
n > 1 and sliding windows crossed: greedy tokens equal to plain uncached `generate`'s, float32.
A model type added to the list without a family here fails `test_every_listed_family_is_swept`.

Before issue 48 gpt_oss and granite_swa ran here without their attention sinks (different text,
silently): their cases fail on that code.
"""
from __future__ import annotations

import random

import pytest
import torch

from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.engine.types import Request, SamplingParams
from batchgen.pipeline.model.hf import HFModel
from batchgen.pipeline.model.hf_support import SUPPORTED
from batchgen.pipeline.model.load import load_model
from tests.helpers import hf_families
from tests.helpers.reference import reference_generate
from tests.helpers.tiny_models import model_from_config

EOS = [2]
SEEDS = (0, 1)
CASES = [(family, seed) for family in sorted(SUPPORTED) for seed in SEEDS]


def _requests(seed: int) -> list[Request]:
    g = random.Random(seed)
    toks = lambda n: [g.randrange(3, 256) for _ in range(n)]  # noqa: E731
    head, mid = toks(14), toks(5)
    prompts = [head + mid + toks(9), head + mid + toks(3), head + toks(20),  # nested prefixes
               head + mid,  # a prompt equal to the prefix where two longer ones part
               head,  # and one equal to the outer shared prefix
               [g.randrange(3, 256)], [g.randrange(3, 256)],  # one-token prompts
               toks(31)]  # alone, past every window
    return [Request(i, p, SamplingParams(max_new_tokens=g.choice([5, 8]), n=2 if i in (1, 5) else 1))
            for i, p in enumerate(prompts)]


def test_every_listed_family_is_swept():
    for family in SUPPORTED:
        hf_families.config(family, 0)  # a KeyError names a family the sweep cannot draw


@pytest.mark.parametrize("family,seed", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_transformers_model_code_equals_generate(family, seed, tmp_path):
    config = hf_families.config(family, seed)
    reference = hf_families.randomize(model_from_config(config, seed=seed), seed)
    reference.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), "cpu", "float32", own_decoder=False)
    assert isinstance(model, torch.nn.Module) and not isinstance(model, HFModel)
    requests = _requests(seed)
    knobs = random.Random(seed).choice([dict(min_shared_tokens=4, max_batch_tokens=48),
                                        dict(min_shared_tokens=1, max_batch_tokens=4096, step_tokens=16)])
    got: dict = {}
    for c in Engine(model, eos_token_ids=EOS, **knobs).run(requests):
        got.setdefault(c.key, []).append(c.token_ids)
    for r in requests:
        want = reference_generate(reference, r, EOS)
        assert got[r.key] == [want] * r.params.n, f"{family} seed {seed} job {r.key} (prompt of {len(r.prompt_ids)})"
