"""Logprobs: scored continuations, prompt logprobs and generated tokens' logprobs equal those of
one full uncached forward pass, on every architecture, with shared prefixes doing the work."""
import pytest
import torch

from tests.helpers.jobsets import SHOTS, SYSTEM, edge_case_requests, tokenizer
from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.engine.types import Request, SamplingParams
from tests.helpers.reference import reference_generate
from tests.helpers.tiny_models import ARCHS, make_decoder, make_model

EOS = [2]


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) for every i, from one plain forward: (len - 1,)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def scoring_requests(tok):
    """lm-eval-style pairs: several continuations per context, under shared few-shot headers."""
    head = SYSTEM + SHOTS[0]
    pairs = [(head + "Q: 9+9? A:", c) for c in (" 18", " 19", " 81", " 18.")]  # space-led, some one token
    pairs += [(head + "Q: capital of Peru? A:", c) for c in (" Lima", " Paris", " Lima, of course")]
    pairs += [(head, "Q: 2+2? A: 4.")]  # the context is exactly a shared prefix of the others
    pairs += [(head + "Q: 9+9? A: 18", "")]  # (skipped below: nothing to score)
    pairs += [(head + "Q: 9+9?", " A: 18")]  # ctx + cont is a prefix other jobs hold
    reqs = []
    for context, continuation in pairs:
        if not continuation:
            continue
        ctx, cont = tok.encode_pair(context, continuation)
        reqs.append(Request(len(reqs), ctx + cont, SamplingParams(max_new_tokens=0), score_from=len(ctx)))
    return reqs


@pytest.mark.parametrize("arch", ARCHS)
def test_scored_continuations_equal_a_full_forward(arch, tok):
    model = make_model(arch, seed=2)
    reqs = scoring_requests(tok)
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=300)
    got = {c.key: c for c in engine.run(reqs)}
    assert engine.stats.prefix_nodes > 0 and engine.stats.decode_steps == 0  # shared contexts, no decode loop
    assert engine.stats.prefill_tokens < sum(len(r.prompt_ids) for r in reqs) / 2
    for r in reqs:
        c = got[r.key]
        want = full_logprobs(model, r.prompt_ids)[r.score_from - 1 :]
        assert c.finish_reason == "scored" and c.token_ids == []
        assert len(c.prompt_logprobs) == len(r.prompt_ids) - r.score_from
        assert torch.allclose(torch.tensor(c.prompt_logprobs), want, atol=1e-4), f"{arch}: job {r.key}"
        with torch.inference_mode():
            argmax = model(torch.tensor([r.prompt_ids])).logits[0, r.score_from - 1 : -1].argmax(-1)
        assert c.prompt_greedy == (argmax == torch.tensor(r.prompt_ids[r.score_from :])).tolist()


def test_scoring_rows_beside_generating_rows_leave_them_unchanged(tok):
    model = make_model("llama", seed=2)
    gen = edge_case_requests(tok, max_new_tokens=5)
    score = [Request(f"s{r.key}", r.prompt_ids, r.params.__class__(max_new_tokens=0), score_from=r.score_from)
             for r in scoring_requests(tok)]
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=250)
    got = {(c.key, c.sample_index): c for c in engine.run(gen + score)}
    for r in gen:
        assert got[(r.key, 0)].token_ids == reference_generate(model, r, EOS)
    for r in score:
        want = full_logprobs(model, r.prompt_ids)[r.score_from - 1 :]
        assert torch.allclose(torch.tensor(got[(r.key, 0)].prompt_logprobs), want, atol=1e-4)


def test_long_texts_are_scored_across_many_steps(tok):
    """More scored positions than one forward keeps logits for: scored chunk by chunk."""
    from batchgen.pipeline.engine import prefix_fill as engine_mod

    model = make_model("qwen2", seed=2)
    text = tok.encode_prompt(" ".join(["the river runs long and cold by the town"] * 12))
    reqs = [Request(0, text, SamplingParams(max_new_tokens=0), score_from=1)]
    old = engine_mod.SCORED_ROWS
    engine_mod.SCORED_ROWS = 7
    try:
        c = Engine(model, eos_token_ids=EOS).generate(reqs)[0]
    finally:
        engine_mod.SCORED_ROWS = old
    assert torch.allclose(torch.tensor(c.prompt_logprobs), full_logprobs(model, text), atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "opt"])
def test_generated_tokens_logprobs_and_echo_equal_a_full_forward(arch, tok):
    model = make_model(arch, seed=4)
    reqs = edge_case_requests(tok, max_new_tokens=5)
    for r in reqs:
        r.params = SamplingParams(max_new_tokens=r.params.max_new_tokens, n=r.params.n, logprobs=3)
    reqs[6].score_from = 1  # echo: this job's prompt logprobs too (those its shared prefix holds scored there)
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=300)
    got = {(c.key, c.sample_index): c for c in engine.run(reqs)}
    for r in reqs:
        c = got[(r.key, 0)]
        assert c.token_ids == reference_generate(model, r, EOS)
        full = r.prompt_ids + c.token_ids
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), dim=-1)
        for i, t in enumerate(c.logprobs):
            row = logprobs[len(r.prompt_ids) - 1 + i]
            assert t.token_id == c.token_ids[i] and abs(t.logprob - row[t.token_id].item()) < 1e-4
            values, ids = row.topk(3)
            assert [i for i, _ in t.top] == ids.tolist() and torch.allclose(torch.tensor([v for _, v in t.top]), values,
                                                                            atol=1e-4)
        if r.score_from is not None:
            assert torch.allclose(torch.tensor(c.prompt_logprobs), full_logprobs(model, r.prompt_ids), atol=1e-4)
        else:
            assert c.prompt_logprobs is None


def prompt_scoring_requests(tok):
    """Prompts scored from their second token, alone (max_new_tokens 0) and while generating (echo),
    under nested shared prefixes (a system prompt, few-shot headers below it, questions below
    those), a prompt that is exactly a prefix the others share, and one- and two-token prompts."""
    texts = [SYSTEM + SHOTS[0] + q for q in ("Q: why?", "Q: where is it?", "Q: 9+9? A: 18")]
    texts += [SYSTEM + SHOTS[1] + "Q: why?", SYSTEM + SHOTS[0], SYSTEM]
    reqs = []
    for i, text in enumerate(texts):
        ids = tok.encode_prompt(text)
        reqs.append(Request(f"alone{i}", ids, SamplingParams(max_new_tokens=0), score_from=1))
        reqs.append(Request(f"echo{i}", ids, SamplingParams(max_new_tokens=3), score_from=1))
    reqs.append(Request("gen", tok.encode_prompt(SYSTEM + SHOTS[0] + "Q: who?"), SamplingParams(max_new_tokens=3)))
    reqs.append(Request("one", [7], SamplingParams(max_new_tokens=3), score_from=1))
    reqs.append(Request("two", [7, 9], SamplingParams(max_new_tokens=0), score_from=1))
    reqs.append(Request("two-echo", [7, 9], SamplingParams(max_new_tokens=2), score_from=1))
    return reqs


@pytest.mark.parametrize("arch,options", [("llama", {}), ("mistral", {}), ("gpt2", {"cascade": False}),
                                          ("qwen2", {"step_tokens": 24, "scored_rows": 5}), ("decoder", {})])
def test_prompt_logprobs_under_shared_prefixes_are_scored_once_and_equal_a_full_forward(arch, options, tok,
                                                                                         monkeypatch, tmp_path):
    from batchgen.pipeline.engine import prefix_fill as engine_mod

    if arch == "decoder":  # batchgen's own decoder runs the engine, transformers' model is the reference
        model, runner = make_decoder("llama", tmp_path, seed=3)
    else:
        model = runner = make_model(arch, seed=3)
    reqs = prompt_scoring_requests(tok)
    options = dict(options)
    monkeypatch.setattr(engine_mod, "SCORED_ROWS", options.pop("scored_rows", engine_mod.SCORED_ROWS))
    engine = Engine(runner, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=400, **options)
    got = {(c.key, c.sample_index): c for c in engine.run(reqs)}
    for r in reqs:
        c = got[(r.key, 0)]
        if r.score_from is None:
            assert c.prompt_logprobs is None
        else:
            want = full_logprobs(model, r.prompt_ids)
            assert len(c.prompt_logprobs) == len(r.prompt_ids) - 1, r.key
            assert torch.allclose(torch.tensor(c.prompt_logprobs), want, atol=2e-5, rtol=0), f"{arch}: {r.key}"
            with torch.inference_mode():
                argmax = model(torch.tensor([r.prompt_ids])).logits[0, :-1].argmax(-1)
            assert c.prompt_greedy == (argmax == torch.tensor(r.prompt_ids[1:])).tolist()
        if r.params.max_new_tokens:
            assert c.token_ids == reference_generate(model, r, EOS), r.key
    # the headers were prefilled (and scored) once for all the rows below them
    assert engine.stats.prefix_nodes >= 3
    assert engine.stats.prefill_tokens < sum(r.fed_len for r in reqs) / 2
    assert all(got[(f"alone{i}", 0)].cached_tokens > len(tok.encode_prompt(SYSTEM)) / 2 for i in range(6))
