"""Shared-prefix attention: the same logits as the copy path, one prefix copy, fused == reference."""
import pytest
import torch

from tests.helpers.jobsets import SYSTEM, tokenizer
from batchgen.pipeline.model import attention
from batchgen.pipeline.model import kv
from batchgen.pipeline.engine.engine import Engine, EngineError
from batchgen.pipeline.engine.types import Request, SamplingParams
from tests.helpers.tiny_models import ARCHS, make_model


def group(tok, n=5):
    head = tok.encode_prompt(SYSTEM * 2)
    return [Request(i, head + tok.encode_prompt(f"Question {i}: " + "why " * i)[1:], SamplingParams(max_new_tokens=6))
            for i in range(n)]


def logits_of(engine, reqs):
    """Every logits row the engine computes, in order, and the completions."""
    seen = []
    real = engine.forward

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append(out.clone())
        return out

    engine.forward = spy
    completions = engine.generate(reqs)
    return torch.cat(seen), sorted((c.key, c.token_ids) for c in completions)


@pytest.mark.parametrize("arch", ARCHS)
def test_cascade_logits_match_the_copy_path(arch):
    tok = tokenizer()
    model = make_model(arch, seed=1)
    reqs = group(tok)
    # one batch either way, so both run the same steps in the same order
    fast = Engine(model, eos_token_ids=[], min_shared_tokens=8, max_batch_tokens=10**6)
    copy = Engine(model, eos_token_ids=[], min_shared_tokens=8, max_batch_tokens=10**6, cascade=False)
    a, out_a = logits_of(fast, reqs)
    b, out_b = logits_of(copy, reqs)
    assert fast.stats.cascade_batches == 1 and copy.stats.cascade_batches == 0
    assert out_a == out_b
    assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-4


def test_the_batch_cache_holds_no_copy_of_the_shared_prefix(monkeypatch):
    tok = tokenizer()
    model = make_model("llama")
    reqs = group(tok, n=4)
    capacity = {}
    real = kv.RowKV.__init__
    for flag in (True, False):
        def spy(self, shapes, slots, cap, *a, flag=flag, **k):
            capacity[flag] = max(capacity.get(flag, 0), cap)
            real(self, shapes, slots, cap, *a, **k)

        monkeypatch.setattr(kv.RowKV, "__init__", spy)
        Engine(model, eos_token_ids=[], min_shared_tokens=8, cascade=flag).generate(reqs)
    head = len(tok.encode_prompt(SYSTEM * 2)) - 1
    assert capacity[False] - capacity[True] >= head - 16  # rows keep only their own tokens (slots round to 16)


def test_the_fused_kernel_agrees_with_the_matmul_reference():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 64, generator=g) for h, n in ((6, 70), (2, 515), (2, 515)))
    mask = torch.zeros(2, 1, 1, 515)
    mask[0, ..., 400:] = float("-inf")
    for m, causal, kk, vv in ((None, False, k, v), (mask, False, k, v), (None, True, k[:, :, :70], v[:, :, :70])):
        o, lse = attention._fused(q, kk, vv, m, 0.125, causal)
        ref_mask = attention.causal_mask(70, 70, q.dtype, q.device) if causal else m
        ro, rlse = attention.partial(q, kk, vv, ref_mask, 0.125)
        assert (o - ro).abs().max() < 1e-5 and (lse - rlse).abs().max() < 1e-4
    assert attention.fused_ok(q.device, q.dtype, 64)


def test_a_softcapped_reference_equals_eager_softcapping():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, n, 16, generator=g) * 3 for h, n in ((4, 9), (2, 30), (2, 30)))
    o, lse = attention.partial(q, k, v, None, 0.25, softcap=5.0)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.tanh(q @ kk.transpose(-1, -2) * 0.25 / 5.0) * 5.0
    assert torch.allclose(o, torch.softmax(scores, -1) @ vv, atol=1e-5)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral"])
def test_the_matmul_fallback_gives_the_same_logits(arch, monkeypatch):
    """Where the fused kernel is missing or disagrees, the matmul reference serves every part."""
    tok = tokenizer()
    model = make_model(arch, seed=1)
    reqs = group(tok, n=7)
    fused, out_fused = logits_of(Engine(model, eos_token_ids=[], min_shared_tokens=8), reqs)
    d = model.config.hidden_size // model.config.num_attention_heads
    monkeypatch.setitem(attention._FUSED_OK, ("cpu", torch.float32, getattr(model.config, "head_dim", None) or d), False)
    slow, out_slow = logits_of(Engine(model, eos_token_ids=[], min_shared_tokens=8), reqs)
    assert out_fused == out_slow
    assert (fused - slow).abs().max().item() <= 1e-4


def test_a_kernel_that_refuses_a_shape_hands_over_to_the_reference(monkeypatch):
    real = attention._fused

    def refuse(q, *a, **kw):  # passes the probe (37 queries), refuses the real work
        if q.shape[2] != 37:
            raise RuntimeError("shape not supported")
        return real(q, *a, **kw)

    tok = tokenizer()
    model = make_model("llama", seed=1)
    reqs = group(tok, n=4)
    want = sorted((c.key, c.token_ids) for c in Engine(model, eos_token_ids=[], min_shared_tokens=8).generate(reqs))
    monkeypatch.setenv("BATCHGEN_NATIVE", "0")  # PyTorch's kernels, not the compiled ones
    monkeypatch.setattr(attention, "_FUSED_OK", {})
    monkeypatch.setattr(attention, "_fused", refuse)
    engine = Engine(model, eos_token_ids=[], min_shared_tokens=8)
    assert sorted((c.key, c.token_ids) for c in engine.generate(reqs)) == want
    assert attention._FUSED_OK and not any(attention._FUSED_OK.values())


def test_a_model_whose_attention_bypasses_the_registry_is_refused_clearly():
    model = make_model("llama")
    for layer in model.model.layers:
        del layer.self_attn.layer_idx  # as if an architecture did not index its attention layers
    with pytest.raises(EngineError, match="batchgen"):
        Engine(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_buffers_start_as_zeros_in_separate_views(dtype):
    from batchgen.pipeline.model.kv import zeroed

    shapes = [(2, 3, 5, 7), (1, 2, 3, 4), (0, 3, 4, 4), (4, 1, 1000, 64)]
    bufs = zeroed(shapes, dtype, torch.device("cpu"))
    assert [tuple(b.shape) for b in bufs] == shapes
    assert all(b.dtype == dtype and b.is_contiguous() and not b.any() for b in bufs)
    bufs[0].fill_(1.0)  # a write lands in its own buffer only
    bufs[3][1, 0, 999, 5] = 2.0
    assert bufs[0].all() and not bufs[1].any() and float(bufs[3].sum()) == 2.0
    assert {b.data_ptr() % 4096 for b in bufs if b.numel()} == {0}  # each starts on a page
