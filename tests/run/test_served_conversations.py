"""A served conversation's bookkeeping without a server (executors.ServedConversations): the
requests it sends, each later turn rendered by pipeline/text's renderer from the turn before it,
each sample its own branch, the last turn yielded with every turn, and a turn that cannot be made
failing its sample. The real server: tests/e2e/test_vllm_conversations.py."""
from __future__ import annotations

import pytest

from batchgen.jobs import GenerationDefaults, Job, Location
from batchgen.pipeline.engine.turns import Turn
from batchgen.pipeline.engine.types import Completion
from batchgen.pipeline.run.executors import ServedConversations
from batchgen.pipeline.serve.mapping import request_body
from batchgen.pipeline.text.expand import job_requests, tokenize_jobs
from batchgen.pipeline.text.tokenize import Tokenizer
from batchgen.pipeline.text.turns import encode_turn, turn_seed
from tests.helpers.tiny_tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(d)
    return Tokenizer.load(str(d))


def _first(tok, row, window=1024, seed=5):
    job = Job.from_row(row, Location("t"), GenerationDefaults(max_new_tokens=3), 0)
    [tokens] = tokenize_jobs(tok, [job])
    [request] = job_requests(7, job, tokens, tok, window, seed)
    return job, request


def _answer(request, text_ids, reason="length"):
    return Completion(request.key, 0, text_ids, reason, len(request.prompt_ids), 0)


def test_each_sample_is_its_own_branch_and_ends_with_every_turn(tok):
    job, first = _first(tok, {"prompt": "Once", "then": [" then", ""], "n": 2, "temperature": 0.5})
    talks = ServedConversations()
    sent = talks.split(first)  # n = 2: one request per sample, as vLLM seeds an n-request's samples
    assert [r.key for r in sent] == [Turn(7, 0, 0), Turn(7, 1, 0)] and all(r.params.n == 1 for r in sent)
    assert [request_body(r, job, "m")["seed"] for r in sent] == [5, 6]
    replies = {0: [[30, 31, 32], [40], [50, 51]], 1: [[33, 34], [41, 42, 43], [52]]}
    done = {}
    pending = list(sent)
    while pending:
        r = pending.pop(0)
        sample, turn = r.key.sample, r.key.turn
        out = talks.ended(r, _answer(r, replies[sample][turn]))
        if out is None:
            nxt = talks.next
            assert nxt.key == Turn(7, sample, turn + 1) and nxt.params.n == 1
            texts = [tok.completion_text(ids, ())[0] for ids in replies[sample][: turn + 1]]
            assert nxt.prompt_ids == encode_turn(tok, job, texts)  # pipeline/text's renderer, whole
            assert request_body(nxt, job, "m")["seed"] == turn_seed(5, turn + 1) + sample
            assert talks.first(nxt) is first
            pending.append(nxt)
        else:
            done[sample] = out
    for sample, out in done.items():
        assert (out.key, out.sample_index) == (7, sample)
        assert [t.token_ids for t in out.turns] == replies[sample] and out.token_ids == replies[sample][-1]
        assert all((t.key, t.sample_index) == (7, sample) for t in out.turns)


def test_a_turn_that_cannot_be_made_fails_its_sample_with_its_turns(tok):
    # the model's window passes turn 1 (4 + 3 tokens) but not turn 2's prompt + max_new_tokens
    job, first = _first(tok, {"prompt": "Hi", "then": [" and more text"]}, window=12)
    talks = ServedConversations()
    assert talks.split(first) == [first]  # one sample: the request as it is
    out = talks.ended(first, _answer(first, [30, 31, 32]))
    assert out is not None and out.finish_reason == "error" and "context window" in out.error
    assert [t.token_ids for t in out.turns] == [[30, 31, 32]]


def test_a_refused_turn_ends_its_conversation(tok):
    _, first = _first(tok, {"prompt": "Hi", "then": [" so", " and"]})
    talks = ServedConversations()
    assert talks.ended(first, _answer(first, [30])) is None
    second = talks.next
    refused = Completion(second.key, 0, [], "error", len(second.prompt_ids), 0, error="turn 2: the server answered 400")
    out = talks.ended(second, refused)
    assert out.error == "turn 2: the server answered 400" and (out.key, out.sample_index) == (7, 0)
    assert [t.token_ids for t in out.turns] == [[30], []]
