"""Conversations in the engine: every turn of every sample equals plain uncached `generate` on the
conversation so far, token for token in float32, while each row keeps its keys and values across
its turns (cut where the next prompt parts from them) and prefills only the rest."""
from __future__ import annotations

import pytest
import torch

from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.engine.types import Request, SamplingParams, TurnError
from tests.helpers.jobsets import SYSTEM, tokenizer
from tests.helpers.reference import reference_generate
from tests.helpers.tiny_models import make_model

EOS = [2]


def reply_of(ids: list[int], rewrite: bool) -> list[int]:
    """The reply as the next prompt holds it: the generated ids, or (as a template that rewrites a
    reply, or a re-tokenized text) with its last two tokens replaced."""
    return ids[: max(0, len(ids) - 2)] + [77, 78] if rewrite else list(ids)


def conversation(key, prompt: list[int], thens: list[list[int]], params: SamplingParams, rewrite: bool = False,
                 reserve: bool = True) -> Request:
    """Turn k+1's prompt = turn k's prompt + its reply + thens[k] (`reply_of`)."""
    def make(ids: list[int], k: int) -> Request:
        def next_turn(sample: int, out: list[int], reason: str) -> Request:
            assert reason in ("stop", "length")
            return make(ids + reply_of(out, rewrite) + thens[k], k + 1)

        rest = sum(params.max_new_tokens + len(t) for t in thens[k:]) if reserve else 0
        return Request(key, ids, params, next_turn=next_turn if k < len(thens) else None, reserve=rest)

    return make(list(prompt), 0)


def prompts_of(request: Request, thens: list[list[int]], turns, rewrite: bool) -> list[list[int]]:
    """Each turn's prompt, from the turns the engine wrote."""
    out = [list(request.prompt_ids)]
    for k, t in enumerate(turns[:-1]):
        out.append(out[-1] + reply_of(t.token_ids, rewrite) + thens[k])
    return out


def check_against_reference(model, requests, thens, got, rewrite=False):
    for r in requests:
        for s in range(r.params.n):
            c = got[(r.key, s)]
            assert c.turns is not None and len(c.turns) == len(thens[r.key]) + 1, (r.key, s)
            assert c.turns[-1].token_ids == c.token_ids and c.finish_reason == c.turns[-1].finish_reason
            for k, (prompt, turn) in enumerate(zip(prompts_of(r, thens[r.key], c.turns, rewrite), c.turns)):
                want = reference_generate(model, Request(0, prompt, r.params), EOS)
                assert turn.token_ids == want, f"job {r.key} sample {s} turn {k}"
                assert turn.prompt_tokens == len(prompt)
                assert turn.finish_reason == ("stop" if want[-1] in EOS else "length")


def workload(tok, max_new=(6, 1, 9), n=(1, 2, 1), turns=3):
    """Conversations under one system prompt (the tree shares it), one-token turns, n samples."""
    head = tok.encode_prompt(SYSTEM)
    requests, thens = [], {}
    for i in range(6):
        params = SamplingParams(max_new_tokens=max_new[i % len(max_new)], n=n[i % len(n)])
        thens[i] = [[30 + i, 40 + k, 50] * (1 + k % 2) for k in range(turns - 1 + i % 2)]
        requests.append(conversation(i, head + [60 + i, 61, 62 + i], thens[i], params))
    return requests, thens


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral", "gpt2", "qwen2", "opt"])
def test_every_turn_equals_uncached_generate(arch):
    tok = tokenizer()
    model = make_model(arch, seed=5)
    requests, thens = workload(tok)
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=400)
    got = {(c.key, c.sample_index): c for c in engine.run(requests)}
    assert len(got) == sum(r.params.n for r in requests)  # one completion per sample, all turns inside
    check_against_reference(model, requests, thens, got)
    assert engine.stats.turns == sum((len(thens[r.key])) * r.params.n for r in requests)
    assert engine.stats.turn_reruns == 0 and engine.stats.carried_tokens > 0
    assert engine.stats.cascade_batches > 0  # the system prompt is read from the shared prefix throughout


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_rewritten_reply_cuts_the_rows_keys_where_the_prompt_parts(arch):
    tok = tokenizer()
    model = make_model(arch, seed=7)
    requests, thens = workload(tok, max_new=(5, 8), n=(2, 1))
    requests = [conversation(r.key, r.prompt_ids, thens[r.key], r.params, rewrite=True) for r in requests]
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=400)
    got = {(c.key, c.sample_index): c for c in engine.run(requests)}
    check_against_reference(model, requests, thens, got, rewrite=True)
    assert engine.stats.turn_reruns == 0


def test_prefill_grows_with_the_conversation_not_its_square():
    """Each turn prefills only what its prompt adds (the reply's tokens are never prefilled again):
    a run's prefill is about the final context's length, where rerunning each turn's prompt whole
    prefills every turn's context again."""
    tok = tokenizer()
    model = make_model("llama", seed=5)
    thens = {0: [[30 + k, 31, 32, 33] for k in range(7)]}
    params = SamplingParams(max_new_tokens=6)
    request = conversation(0, tok.encode_prompt(SYSTEM), thens[0], params)
    engine = Engine(model, eos_token_ids=EOS)
    [c] = engine.run([request])
    check_against_reference(model, [request], thens, {(0, 0): c})
    prompts = prompts_of(request, thens[0], c.turns, False)
    final = len(prompts[-1])
    # the minimum: every prompt token once, but each turn's reply, fed while decoding; one token a
    # turn is fed again (the one whose logits start the turn, the reply's last)
    minimum = final - sum(len(t.token_ids) - 1 for t in c.turns[:-1])
    assert engine.stats.prefill_tokens <= minimum + len(c.turns)
    assert engine.stats.prefill_tokens < sum(len(p) for p in prompts) / 3  # rerunning each prompt whole
    # every turn keeps all the slot held: the last prompt and its reply but the reply's last token
    assert engine.stats.carried_tokens == sum(len(p) + len(t.token_ids) - 1 for p, t in zip(prompts, c.turns[:-1]))


def test_a_turn_that_outgrows_its_slot_reruns_in_a_later_pass():
    """No reserve: the slots are sized for the first turn, so later turns rerun from their
    prompt in a later pass of the same run, with the same tokens."""
    tok = tokenizer()
    model = make_model("llama", seed=5)
    requests, thens = workload(tok)
    requests = [conversation(r.key, r.prompt_ids, thens[r.key], r.params, reserve=False) for r in requests]
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=400)
    got = {(c.key, c.sample_index): c for c in engine.run(requests)}
    check_against_reference(model, requests, thens, got)
    assert engine.stats.turn_reruns > 0
    assert engine.stats.jobs == len(requests) and engine.stats.rows == sum(r.params.n for r in requests)


def test_rows_dropped_under_memory_pressure_rerun_their_turn_exactly():
    tok = tokenizer()
    model = make_model("llama", seed=5)
    requests, thens = workload(tok)
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=400)
    real, fired = engine.forward, []

    def failing(step, keep):
        # a later turn's prefill beside decoding rows, small enough that rows are sent back
        if step.n_dec and step.segments and step.tokens - step.n_dec <= 16 and engine.stats.turns and len(fired) < 2:
            fired.append(step.tokens)
            raise torch.OutOfMemoryError("injected")
        return real(step, keep)

    engine.forward = failing
    got = {(c.key, c.sample_index): c for c in engine.run(requests)}
    assert len(fired) == 2 and engine.stats.oom_splits == 2
    check_against_reference(model, requests, thens, got)


def test_a_turn_that_cannot_be_made_fails_its_sample_alone():
    tok = tokenizer()
    model = make_model("llama", seed=5)
    params = SamplingParams(max_new_tokens=4)

    def refuse(sample, out, reason):
        raise TurnError("the conversation outgrows the context window")

    bad = Request(0, tok.encode_prompt(SYSTEM + "a"), params, next_turn=refuse)
    good = conversation(1, tok.encode_prompt(SYSTEM + "b"), [[40, 41]], params)
    got = {c.key: c for c in Engine(model, eos_token_ids=EOS, min_shared_tokens=4).run([bad, good])}
    assert got[0].finish_reason == "error" and "context window" in got[0].error and len(got[0].turns) == 1
    check_against_reference(model, [good], {1: [[40, 41]]}, {(1, 0): got[1]})
