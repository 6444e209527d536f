"""Scoring jobs' requests and results: rolling windows as lm-eval's, continuations by lm-eval's rules."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.text.scoring import (continuation_requests, continuation_scores, prompt_requests, prompt_scores,
                              rolling_windows)
from tests.helpers.tiny_models import make_model


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(3, 200), min_size=1, max_size=60), st.integers(1, 20))
def test_rolling_windows_are_lm_evals(tokens, window):
    lm_utils = pytest.importorskip("lm_eval.utils")
    want = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
        token_list=tokens[1:], prefix_token=tokens[0], max_seq_len=window, context_len=1)]
    got = list(rolling_windows(tokens, window))
    assert got == [(list(a), list(b)) for a, b in want]
    assert [t for _, pred in got for t in pred] == tokens[1:]  # every token after the first, once
    assert all(len(ctx) + len(pred) - 1 <= window for ctx, pred in got)  # what runs through the model fits


def test_a_long_prompt_is_scored_in_windows_that_fit_the_model():
    model = make_model("llama", seed=1)
    tokens = [5 + (i * 7) % 200 for i in range(50)]
    whole = prompt_requests("job", tokens, window=None)
    split = prompt_requests("job", tokens, window=16)
    assert len(whole) == 1 and len(split) == 4
    engine = Engine(model, eos_token_ids=[])
    lp_whole, _ = prompt_scores(engine.generate(whole))
    lp_split, greedy = prompt_scores(engine.generate(split))
    assert len(lp_whole) == len(lp_split) == len(greedy) == 49
    # the first window sees the same context as the whole text: the same logprobs there
    assert torch.allclose(torch.tensor(lp_split[:16]), torch.tensor(lp_whole[:16]), atol=1e-4)
    with torch.inference_mode():  # later tokens see only their window: check one window by hand
        ctx, pred = list(rolling_windows(tokens, 16))[2]
        logits = model(torch.tensor([ctx + pred[:-1]])).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(ctx) - 1 :].gather(1, torch.tensor(pred)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp_split[32:48]), want, atol=1e-4)


def test_continuations_sum_their_tokens_logprobs():
    model = make_model("qwen2", seed=1)
    ctx = [9, 40, 41, 42, 43, 44, 45, 46, 47]
    pairs = [(ctx, [50]), (ctx, [51, 52]), (ctx, [50, 53, 54])]
    reqs = continuation_requests("q", pairs)
    engine = Engine(model, eos_token_ids=[], min_shared_tokens=4)
    scores = continuation_scores(list(reversed(engine.generate(reqs))))
    assert [s.tokens for s in scores] == [1, 2, 3]
    with torch.inference_mode():
        for (c, cont), s in zip(pairs, scores):
            logits = model(torch.tensor([c + cont])).logits[0].float()
            lp = torch.log_softmax(logits[len(c) - 1 : -1], -1).gather(1, torch.tensor(cont)[:, None])[:, 0]
            assert abs(s.logprob - lp.sum().item()) < 1e-4
            assert s.is_greedy == bool((logits[len(c) - 1 : -1].argmax(-1) == torch.tensor(cont)).all())
    assert engine.stats.prefix_nodes == 1  # the context, once for its three continuations
