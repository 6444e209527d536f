"""The engine with LoRA adapters: rows of different adapters run in the same forwards (no batch per
adapter), a prefix is cached per adapter (never read by another adapter's rows, and prefilled
with its own adapter), and every request's greedy tokens are its merged model's uncached
`generate`. (The output through the CLI: tests/e2e/test_adapters.py.)"""
import pytest

from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.engine.types import Request, SamplingParams
from batchgen.pipeline.model.adapter_files import inspect_adapter
from batchgen.pipeline.model.hf import as_forward
from tests.helpers.reference import reference_generate
from tests.helpers.tiny_adapters import make_adapter, merged
from tests.helpers.tiny_models import make_model

HEAD = list(range(10, 40))  # a shared head of 30 tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = make_model("llama")
    dirs = [make_adapter(base, root / f"a{i}", rank=r, seed=i) for i, r in enumerate((1, 8, 4), start=1)]
    return base, dirs


def test_adapters_share_forwards_not_prefixes(setup):
    base, dirs = setup
    forward = as_forward(make_model("llama"))
    forward.set_adapters([inspect_adapter(d, base.config) for d in dirs])
    engine = Engine(forward, eos_token_ids=[2], min_shared_tokens=4)
    requests = [Request((a, i), HEAD + tail, SamplingParams(max_new_tokens=5, n=1 + (i == 1)), adapter=a)
                for a in range(4) for i, tail in enumerate([[50], [51, 52], []])]  # [] : the prompt is the head
    seen = []  # per forward: the adapters its tokens run with (0: some token runs the base model)
    real = engine.forward

    def recording(step, keep):
        with_adapter = sum(len(range(step.tokens)[i]) if isinstance(i, slice) else len(i) for _, i in step.lora)
        seen.append({a for a, _ in step.lora} | ({0} if with_adapter < step.tokens else set()))
        return real(step, keep)

    engine.forward = recording
    plan = engine.plan(requests)
    got = {(c.key, c.sample_index): c.token_ids for c in engine.run(requests)}
    # one cached head per adapter, each read only by its own adapter's rows
    assert sorted(p.key[0] for p in plan.prefixes.values() if p.parent is None) == [0, 1, 2, 3]
    for p in plan.prefixes.values():  # a nested prefix is of its parent's adapter
        assert p.parent is None or plan.prefixes[p.parent].key[0] == p.key[0]
    for row in plan.rows:
        if row.prefix is not None:
            assert plan.prefixes[row.prefix].key[0] == row.key[0]
    # decode steps mix every adapter and the base model in one forward
    assert max(len(s) for s in seen) == 4 and engine.stats.batches == 1
    models = [base] + [merged(base, d) for d in dirs]
    for r in requests:
        want = reference_generate(models[r.adapter], r, [2])
        for s in range(r.params.n):
            assert got[(r.key, s)] == want, (r.key, s)


def test_without_adapters_the_same_requests_share_one_head(setup):
    """The control: the same prompts on the base model alone share one cached head."""
    engine = Engine(as_forward(make_model("llama")), eos_token_ids=[2], min_shared_tokens=4)
    requests = [Request((a, i), HEAD + tail, SamplingParams(max_new_tokens=5))
                for a in range(4) for i, tail in enumerate([[50], [51, 52], []])]
    assert len([p for p in engine.plan(requests).prefixes.values() if p.parent is None]) == 1


def test_a_prefix_is_prefilled_with_its_adapter(setup, monkeypatch):
    """A cached prefix's segment carries its rows' adapter (its keys and values are that adapter's)."""
    from batchgen.pipeline.engine import loop, prefix_fill

    base, dirs = setup
    forward = as_forward(make_model("llama"))
    forward.set_adapters([inspect_adapter(dirs[0], base.config)])
    segments = []
    real = loop.build

    def build(decode, ids, chunks, kv, device):
        segments.extend((seg.adapter, kv is None) for seg, _ in chunks)
        return real(decode, ids, chunks, kv, device)

    monkeypatch.setattr(loop, "build", build)  # the rows' steps
    monkeypatch.setattr(prefix_fill, "build", build)  # the prefixes'
    engine = Engine(forward, eos_token_ids=[2], min_shared_tokens=4)
    requests = [Request(i, HEAD + [50 + i], SamplingParams(max_new_tokens=2), adapter=1) for i in range(3)]
    list(engine.run(requests))
    assert (1, True) in segments and all(a == 1 for a, _ in segments)  # the prefix's prefill, and the rows'
