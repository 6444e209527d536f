"""The core of the project: the engine's greedy output equals plain uncached generation."""
import copy

import pytest
import torch

from tests.helpers.jobsets import SYSTEM, edge_case_requests, tokenizer
from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.engine.prefix_tree import PrefixTree
from tests.helpers.reference import bf16_tie, reference_generate
from batchgen.pipeline.engine.types import Request, SamplingParams
from tests.helpers.tiny_models import ARCHS, make_model

EOS = [2]


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.mark.parametrize("kernels", ["compiled", "pytorch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_uncached_generate(arch, kernels, tok, monkeypatch, device):
    """Through batchgen's compiled CPU attention kernels where they serve the layout, and through
    PyTorch's kernels (BATCHGEN_NATIVE=0), the path every other device and layout takes."""
    if kernels == "compiled" and device.type != "cpu":
        pytest.skip("the compiled attention kernels are CPU kernels")
    if kernels == "pytorch":
        monkeypatch.setenv("BATCHGEN_NATIVE", "0")
    model = make_model(arch).to(device)
    reqs = edge_case_requests(tok)
    # a small budget: a few slots, which rows planned next keep joining as others finish
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=250)
    got = {}
    for c in engine.run(reqs):
        got[(c.key, c.sample_index)] = c
    assert engine.stats.admitted_rows > 3
    # the fast path (shared-prefix attention) runs on every architecture, sliding windows and
    # soft-capping included
    assert engine.stats.cascade_batches > 0
    for r in reqs:
        want = reference_generate(model, r, EOS)
        for s in range(r.params.n):
            c = got[(r.key, s)]
            assert c.token_ids == want, f"{arch}: job {r.key} sample {s}"
            assert c.finish_reason == ("stop" if want[-1] in EOS else "length")
            assert c.prompt_tokens == len(r.prompt_ids) and 0 <= c.cached_tokens < len(r.prompt_ids)
    assert engine.stats.completion_tokens == sum(len(c.token_ids) for c in got.values())


@pytest.mark.parametrize("kernels", ["compiled", "pytorch"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_nested_prefixes_holding_only_their_tails_equal_uncached_generate(arch, kernels, monkeypatch):
    """A prefix no row anchors at holds only its tokens below its anchor, prefilled over that
    anchor; a deeper prefix that is an anchor copies its tokens from both; rows copy from the tail.
    With prompt logprobs, which rows below score through each prefix."""
    if kernels == "pytorch":
        monkeypatch.setenv("BATCHGEN_NATIVE", "0")
    model = make_model(arch, seed=11)  # (a vocabulary of 256)
    head, mid, deep = list(range(100, 140)), list(range(200, 210)), list(range(150, 170))
    prompts = ([head + [5 + i] for i in range(2)] + [head + mid + [7 + i] for i in range(2)]
               + [head + mid + deep + [9 + i, 40 + i] for i in range(3)])
    reqs = [Request(i, p, SamplingParams(max_new_tokens=5), score_from=1 if i % 2 else None)
            for i, p in enumerate(prompts)]
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=8)
    tails = [p for p in engine.plan(reqs).prefixes.values() if p.anchor is not None]
    assert [(p.start, p.end, p.base) for p in tails] == [(40, 50, 40)]
    got = {c.key: c for c in engine.run(reqs)}
    for r in reqs:
        assert got[r.key].token_ids == reference_generate(model, r, EOS), f"{arch}: job {r.key}"
        if r.score_from is not None:
            with torch.inference_mode():
                logits = model(torch.tensor([r.prompt_ids])).logits[0].float()
            want = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(r.prompt_ids[1:])[:, None])[:, 0]
            assert torch.allclose(torch.tensor(got[r.key].prompt_logprobs), want, atol=1e-4), r.key


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_equivalence_holds_for_any_batch_budget(arch, tok):
    model = make_model(arch, seed=3)
    reqs = edge_case_requests(tok, max_new_tokens=6)
    outs = []
    for budget in (60, 10_000):
        engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=1, max_batch_tokens=budget)
        outs.append(sorted((c.key, c.sample_index, c.token_ids) for c in engine.run(reqs)))
    assert outs[0] == outs[1]


def test_prefill_work_is_the_radix_tree_bound(tok):
    reqs = edge_case_requests(tok, max_new_tokens=2)
    engine = Engine(make_model("llama"), eos_token_ids=[], min_shared_tokens=1)
    completions = engine.generate(reqs)
    held_back, full = PrefixTree(), PrefixTree()
    for r in reqs:
        held_back.insert(r.key, r.prompt_ids[:-1])
        full.insert(r.key, r.prompt_ids)
    # every shared token once, plus exactly the held-back last token of each job
    assert engine.stats.prefill_tokens == held_back.token_count() + len(reqs)
    assert full.token_count() <= engine.stats.prefill_tokens <= full.token_count() + len(reqs)
    assert engine.stats.prompt_tokens == sum(len(r.prompt_ids) for r in reqs)
    # a job's prompt is its reused tokens plus the suffix it ran itself
    assert engine.stats.cached_tokens == sum(c.cached_tokens for c in completions if c.sample_index == 0)
    assert engine.stats.prompt_tokens - engine.stats.cached_tokens < engine.stats.prefill_tokens
    system_len = len(tok.encode_prompt(SYSTEM))
    by_key = {c.key: c for c in completions}
    assert by_key[4].cached_tokens >= system_len  # a question under system + shots + doc reuses them
    want = sum(r.params.max_new_tokens * r.params.n for r in reqs)  # no EOS: every row runs to its length
    assert engine.stats.decode_steps > 0 and engine.stats.completion_tokens == want


def test_min_shared_tokens_disables_sharing_without_changing_output(tok):
    model = make_model("qwen2")
    reqs = edge_case_requests(tok, max_new_tokens=5)
    shared = Engine(model, eos_token_ids=EOS, min_shared_tokens=1)
    unshared = Engine(model, eos_token_ids=EOS, min_shared_tokens=10_000)
    a = sorted((c.key, c.sample_index, c.token_ids) for c in shared.run(reqs))
    b = sorted((c.key, c.sample_index, c.token_ids) for c in unshared.run(reqs))
    assert a == b
    assert unshared.stats.prefill_tokens == unshared.stats.prompt_tokens
    assert shared.stats.prefill_tokens < unshared.stats.prefill_tokens / 2


def sampled(key, prompt, seed, n=3):
    return Request(key, prompt, SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=40, seed=seed, n=n))


def test_seeded_sampling_does_not_depend_on_the_batch(tok):
    model = make_model("llama")
    prompt = tok.encode_prompt(SYSTEM + "Tell me a story.")
    others = [sampled(100 + i, tok.encode_prompt(SYSTEM + f"Question {i}?"), seed=i, n=1) for i in range(49)]

    def run(reqs, budget):
        engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=budget)
        return {(c.key, c.sample_index): c.token_ids for c in engine.run(reqs) if c.key == "me"}

    alone = run([sampled("me", prompt, 42)], 100_000)
    in_group = run(others[:25] + [sampled("me", prompt, 42)] + others[25:], 100_000)
    small_batches = run(others + [sampled("me", prompt, 42)], 150)
    assert alone == in_group == small_batches
    assert len({tuple(v) for v in alone.values()}) > 1, "the samples of one job differ from each other"
    assert run([sampled("me", prompt, 43)], 100_000) != alone, "another seed gives another text"


def test_stop_strings_and_eos_end_rows_early(tok):
    model = make_model("llama")
    reqs = edge_case_requests(tok, max_new_tokens=12)[:6]
    free = {c.key: c.token_ids for c in Engine(model, eos_token_ids=[]).run(reqs)}
    # stop when the job's third generated token shows up, whatever it decodes to
    for r in reqs:
        third = tok.decode(free[r.key][:3])
        r.stop = tok.stop_check([third[-1:]]) if third.strip() else None
    stopped = {c.key: c for c in Engine(model, eos_token_ids=[]).run(reqs)}
    for r in reqs:
        c = stopped[r.key]
        assert c.token_ids == free[r.key][: len(c.token_ids)]
        if r.stop is not None:
            assert len(c.token_ids) <= 3 and c.finish_reason == "stop"
    # an EOS id that greedy decoding emits ends the row there, the EOS kept
    eos = free[0][4]
    c = next(c for c in Engine(model, eos_token_ids=[eos]).run(reqs[:1]))
    assert c.token_ids == free[0][: free[0].index(eos) + 1] and c.finish_reason == "stop"


def test_non_finite_logits_fail_one_row_alone(tok, monkeypatch):
    model = make_model("llama")
    reqs = edge_case_requests(tok, max_new_tokens=4)[:4]
    engine = Engine(model, eos_token_ids=EOS)
    real = engine.forward
    calls = []

    def poisoned(*args):
        logits = real(*args)
        if not calls:
            logits[0, 5] = float("nan")  # one logit of one row of the first forward
            logits[1, 7] = float("inf")  # and an infinite one of another
            logits[2] = 3e38  # finite, though the row's sum is not: it runs on
        calls.append(1)
        return logits

    monkeypatch.setattr(engine, "forward", poisoned)
    out = engine.generate(reqs)
    assert [c.finish_reason for c in out].count("error") == 2
    assert sum(c.error is None and len(c.token_ids) > 0 for c in out) == len(out) - 2


def test_naive_hf_recipe_is_wrong_when_the_whole_prompt_is_cached(tok):
    """The bug batchgen exists to avoid: cache a prompt, deep-copy, generate with the full prompt."""
    model = make_model("llama")
    prompt = tok.encode_prompt("I have a dream")
    req = Request(0, prompt, SamplingParams(max_new_tokens=8))
    want = reference_generate(model, req, [])
    ids = torch.tensor([prompt])
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache)
        try:
            out = model.generate(input_ids=ids, past_key_values=copy.deepcopy(cache), max_new_tokens=8,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            naive = out[0, ids.shape[1]:].tolist()
        except IndexError:  # transformers <= 5.2
            naive = None
    assert naive != want
    assert Engine(model, eos_token_ids=[]).generate([req, Request(1, prompt, req.params)])[0].token_ids == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_both_attention_paths(tok, dtype):
    """Half precision: greedy ids may differ from unbatched generate by rounding, but every row
    completes, with finite logits, on the cascade and the copy path alike."""
    model = make_model("llama", dtype=dtype)
    reqs = edge_case_requests(tok, max_new_tokens=4)
    for cascade in (True, False):
        engine = Engine(model, eos_token_ids=[], min_shared_tokens=4, cascade=cascade)
        out = engine.generate(reqs)
        assert len(out) == sum(r.params.n for r in reqs)
        assert all(c.error is None and len(c.token_ids) == r_len(reqs, c.key) for c in out)
        assert (engine.stats.cascade_batches > 0) == cascade


def r_len(reqs, key):
    return next(r.params.max_new_tokens for r in reqs if r.key == key)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2"])
def test_bfloat16_greedy_equals_bfloat16_uncached_generate(arch, tok, device):
    """In bfloat16 the engine's and plain generate's kernels round differently, so greedy choices
    between logits tied at bfloat16 precision may go either way. Every row equals uncached
    generate token for token, or parts from it exactly where the reference's own logits are tied."""
    model = make_model(arch, dtype=torch.bfloat16).to(device)
    reqs = edge_case_requests(tok)
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=250)
    got = {(c.key, c.sample_index): c.token_ids for c in engine.run(reqs)}
    assert engine.stats.cascade_batches > 0 and engine.stats.admitted_rows > 3
    equal = 0
    for r in reqs:
        want = reference_generate(model, r, EOS)
        for s in range(r.params.n):
            if got[(r.key, s)] == want:
                equal += 1
            else:
                assert bf16_tie(model, r.prompt_ids, want, got[(r.key, s)]), f"{arch}: job {r.key} sample {s}"
    assert equal >= len(got) * 2 // 3


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gpt2"])
def test_static_decode_steps_equal_uncached_generate(arch, tok, device):
    """Decode steps on static shapes (every slot of a bucket, full-capacity reads, device buffers:
    what a CUDA graph captures) give the same text as the dynamic steps and plain generate."""
    model = make_model(arch).to(device)
    reqs = edge_case_requests(tok)
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=250, static_decode=True)
    got = {(c.key, c.sample_index): c.token_ids for c in engine.run(reqs)}
    for r in reqs:
        want = reference_generate(model, r, EOS)
        for s in range(r.params.n):
            assert got[(r.key, s)] == want, f"{arch}: job {r.key} sample {s}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "opt"])
def test_a_model_packed_in_place_equals_the_plain_model_s_uncached_generate(arch, tok):
    """A model batchgen loads has its linear weights packed in place (`kernels.pack_in_place`):
    the engine on it still equals plain Hugging Face generate on the same weights, unpacked."""
    from batchgen.pipeline.model import kernels

    if not kernels.onednn_ok(torch.float32, packed=True):
        pytest.skip("oneDNN's linear is not available in this torch build")
    plain, packed = make_model(arch), make_model(arch)  # same seed: same weights
    assert kernels.pack_in_place(packed) > 0
    reqs = edge_case_requests(tok)
    engine = Engine(packed, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=250)
    got = {(c.key, c.sample_index): c.token_ids for c in engine.run(reqs)}
    assert engine.stats.cascade_batches > 0
    for r in reqs:
        want = reference_generate(plain, r, EOS)
        for s in range(r.params.n):
            assert got[(r.key, s)] == want, f"{arch}: job {r.key} sample {s}"
