"""Shared-prefix (cascade) attention: the same logits as the copy path, one prefix copy."""
import pytest

from jobsets import SYSTEM, tokenizer
from pipeline import cascade
from pipeline.engine import Engine
from pipeline.types import Request, SamplingParams
from tiny_models import ARCHS, make_model


def group(tok, n=5):
    head = tok.encode_prompt(SYSTEM * 2)
    return [Request(i, head + tok.encode_prompt(f"Question {i}: " + "why " * i)[1:], SamplingParams(max_new_tokens=6))
            for i in range(n)]


def logits_of(engine, reqs):
    """Every logits row the engine computes, in order."""
    seen = []
    real = engine._logits

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append(out.clone())
        return out

    engine._logits = spy
    completions = engine.generate(reqs)
    return seen, sorted((c.key, c.token_ids) for c in completions)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in ("gemma2",)])
def test_cascade_logits_match_the_copy_path(arch):
    tok = tokenizer()
    model = make_model(arch, seed=1)
    if arch == "mistral":
        model.config.sliding_window = 4096  # a window wider than the prompts: the fast path may serve it
    reqs = group(tok)
    fast = Engine(model, eos_token_ids=[], min_shared_tokens=8)
    copy = Engine(model, eos_token_ids=[], min_shared_tokens=8, cascade=False)
    a, out_a = logits_of(fast, reqs)
    b, out_b = logits_of(copy, reqs)
    assert fast.stats.cascade_batches == 1 and copy.stats.cascade_batches == 0
    assert out_a == out_b
    assert len(a) == len(b)
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-4


def test_models_the_fast_path_cannot_serve_fall_back():
    gemma = make_model("gemma2")
    assert cascade.supports(gemma) == "attention logit soft-capping"
    assert Engine(gemma).attention_path.startswith("copy")
    assert Engine(make_model("llama")).attention_path == "cascade"
    # a window the prompts outgrow: that batch copies the prefix instead
    mistral = make_model("mistral")
    tok = tokenizer()
    engine = Engine(mistral, eos_token_ids=[], min_shared_tokens=8)
    engine.generate(group(tok))
    assert engine.stats.cascade_batches == 0


def test_the_batch_cache_holds_no_copy_of_the_shared_prefix():
    tok = tokenizer()
    model = make_model("llama")
    reqs = group(tok, n=4)
    sizes = {}
    for flag in (True, False):
        engine = Engine(model, eos_token_ids=[], min_shared_tokens=8, cascade=flag)
        real = engine._logits

        def spy(input_ids, q_pos, mask, cache, real=real, flag=flag):
            sizes[flag] = max(sizes.get(flag, 0), cache.layers[0].kbuf.shape[2] if cache.layers else 0)
            return real(input_ids, q_pos, mask, cache)

        engine._logits = spy
        engine.generate(reqs)
    head = len(tok.encode_prompt(SYSTEM * 2)) - 1
    assert sizes[False] - sizes[True] >= head - 1  # rows keep only their own tokens


def test_the_fused_kernel_agrees_with_the_matmul_reference():
    import torch

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 3, n, 64, generator=g) for n in (70, 515, 515))
    o, lse = cascade._fused(q, k, v, 0.125)
    ro, rlse = cascade._partial(q, k, v, None, 0.125)
    assert (o - ro).abs().max() < 1e-5 and (lse - rlse).abs().max() < 1e-4
    assert cascade._fused_ok(q.device, q.dtype, 64)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_the_matmul_fallback_gives_the_same_logits(arch, monkeypatch):
    """Where the fused kernel is missing or disagrees, the matmul version serves, in row chunks."""
    import torch

    tok = tokenizer()
    model = make_model(arch, seed=1)
    reqs = group(tok, n=7)
    fused, out_fused = logits_of(Engine(model, eos_token_ids=[], min_shared_tokens=8), reqs)
    d = model.config.hidden_size // model.config.num_attention_heads
    monkeypatch.setitem(cascade._FUSED_OK, ("cpu", torch.float32, getattr(model.config, "head_dim", None) or d), False)
    monkeypatch.setattr(cascade, "_QUERY_ROWS", 9)  # several row chunks per segment
    slow, out_slow = logits_of(Engine(model, eos_token_ids=[], min_shared_tokens=8), reqs)
    assert out_fused == out_slow
    assert max((x - y).abs().max().item() for x, y in zip(fused, slow)) <= 1e-4


def test_a_kernel_that_refuses_a_shape_hands_over_to_the_reference(monkeypatch):
    real = cascade._fused

    def refuse(q, *a, **kw):  # passes the probe (37 queries), refuses the real batch
        if q.shape[2] != 37:
            raise RuntimeError("shape not supported")
        return real(q, *a, **kw)

    tok = tokenizer()
    model = make_model("llama", seed=1)
    reqs = group(tok, n=4)
    want = sorted((c.key, c.token_ids) for c in Engine(model, eos_token_ids=[], min_shared_tokens=8).generate(reqs))
    monkeypatch.setattr(cascade, "_FUSED_OK", {})
    monkeypatch.setattr(cascade, "_fused", refuse)
    engine = Engine(model, eos_token_ids=[], min_shared_tokens=8)
    assert sorted((c.key, c.token_ids) for c in engine.generate(reqs)) == want
    assert engine.stats.cascade_batches == 1 and cascade._FUSED_OK and not any(cascade._FUSED_OK.values())
