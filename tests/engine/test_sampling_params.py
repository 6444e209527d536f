"""Sampling parameters: the batched processors equal transformers' processors (and OpenAI's
presence/frequency penalties) row by row, and greedy output with them equals `model.generate`."""
import pytest
import torch
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from tests.helpers.jobsets import SYSTEM, tokenizer
from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.engine.sampling import process
from batchgen.pipeline.engine.sampling import RowState, sample
from batchgen.pipeline.engine.types import Request, SamplingParams
from tests.helpers.tiny_models import make_model

EOS = [2]


def reference_process(logits: torch.Tensor, row: RowState) -> torch.Tensor:
    """One row (1, V) through transformers' processors, in generate's order, and OpenAI's penalties."""
    p = row.params
    ids = torch.tensor([list(row.prompt) + row.tokens])
    procs = LogitsProcessorList()
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias}))
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    out = procs(ids, logits.clone())
    for t in set(row.tokens):  # OpenAI: generated tokens only
        out[0, t] -= p.frequency_penalty * row.tokens.count(t) + p.presence_penalty
    if p.min_tokens:
        out = MinNewTokensLengthLogitsProcessor(len(row.prompt), p.min_tokens, sorted(row.ends))(ids, out)
    return out


ROWS = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),  # below 1 rewards repeats
    SamplingParams(presence_penalty=0.8, frequency_penalty=0.5),
    SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.3),
    SamplingParams(min_tokens=10),  # not reached: EOS and the stop token held back
    SamplingParams(min_tokens=2),  # reached
    SamplingParams(logit_bias=((3, 4.5), (7, -100.0), (2, 1.0))),
    SamplingParams(logit_bias=((5, 2.0),), repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=1.1,
                   min_tokens=9, stop_token_ids=(11,)),
]


def test_processors_equal_transformers_row_by_row():
    torch.manual_seed(0)
    vocab = 40
    rows = []
    for i, params in enumerate(ROWS):
        prompt = [int(t) for t in torch.randint(0, vocab, (6 + i,))]
        tokens = [int(t) for t in torch.randint(0, vocab, (4,))] + [9, 9, 9]  # repeats count
        rows.append(RowState(params, None, list(tokens), prompt, frozenset(EOS) | frozenset(params.stop_token_ids)))
    logits = torch.randn(len(rows), vocab) * 3
    got = process(logits.clone(), rows)
    for i, row in enumerate(rows):
        want = reference_process(logits[i : i + 1], row)
        torch.testing.assert_close(got[i : i + 1], want, msg=f"row {i}: {row.params}")
    assert torch.isinf(got[5, 2]) and torch.isinf(got[8, 11]) and not torch.isinf(got[6, 2])
    # the processors' state follows accepted tokens
    rows[3].accept(21)
    again = process(logits.clone(), rows)
    torch.testing.assert_close(again[3:4], reference_process(logits[3:4], rows[3]))


def test_untouched_rows_cost_nothing_and_keep_their_logits():
    logits = torch.randn(2, 30)
    rows = [RowState(SamplingParams(), None), RowState(SamplingParams(), None)]
    before = logits.clone()
    assert sample(logits, rows).tolist() == before.argmax(-1).tolist()
    assert torch.equal(logits, before) and rows[0]._seen is None and rows[0]._counts is None


def _requests(tok, n_new: int = 12) -> list[Request]:
    eos_bias = ((2, 40.0),)  # EOS would win at once: min_tokens holds it back
    params = [
        SamplingParams(max_new_tokens=n_new, repetition_penalty=1.5),
        SamplingParams(max_new_tokens=n_new, min_tokens=4, logit_bias=eos_bias),
        SamplingParams(max_new_tokens=n_new, logit_bias=((40, 6.0), (41, 6.0), (60, -100.0))),
        SamplingParams(max_new_tokens=n_new, repetition_penalty=1.3, min_tokens=6, logit_bias=eos_bias + ((44, 3.0),)),
        SamplingParams(max_new_tokens=n_new),  # defaults, in the same batch
        SamplingParams(max_new_tokens=n_new, repetition_penalty=2.0, n=2),
    ]
    return [Request(i, tok.encode_prompt(SYSTEM + f"Question {i}: why is the sky blue?"), p)
            for i, p in enumerate(params)]


@torch.inference_mode()
def generate_reference(model, request: Request) -> list[int]:
    p = request.params
    ids = torch.tensor([request.prompt_ids])
    kwargs = {}
    if p.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = p.repetition_penalty
    if p.min_tokens:
        kwargs["min_new_tokens"] = p.min_tokens
    if p.logit_bias:
        kwargs["sequence_bias"] = {(t,): b for t, b in p.logit_bias}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=p.max_new_tokens, eos_token_id=EOS, pad_token_id=EOS[0], **kwargs)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_greedy_with_penalties_bias_and_min_tokens_equals_generate(arch):
    tok = tokenizer()
    model = make_model(arch)
    reqs = _requests(tok)
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4)
    got = {(c.key, c.sample_index): c for c in engine.run(reqs)}
    assert engine.stats.cached_tokens > 0  # the shared prefix is still shared
    for r in reqs:
        want = generate_reference(model, r)
        for s in range(r.params.n):
            assert got[(r.key, s)].token_ids == want, f"{arch}: job {r.key} sample {s}"
    # EOS was biased to win: it came exactly when min_tokens let it
    assert got[(1, 0)].token_ids[-1] == 2 and len(got[(1, 0)].token_ids) == 5
    assert got[(1, 0)].finish_reason == "stop"


@torch.inference_mode()
def loop_reference(model, request: Request) -> list[int]:
    """Uncached greedy decoding, one job, processors applied by reference_process."""
    row = RowState(request.params, None, [], request.prompt_ids, frozenset(EOS) | set(request.params.stop_token_ids))
    for _ in range(request.params.max_new_tokens):
        ids = torch.tensor([request.prompt_ids + row.tokens])
        logits = model(input_ids=ids).logits[:, -1].float()
        token = int(reference_process(logits, row).argmax(-1))
        row.tokens.append(token)
        if token in row.ends:
            break
    return row.tokens


def test_presence_frequency_and_stop_token_ids_equal_a_reference_loop():
    tok = tokenizer()
    model = make_model("qwen2")
    reqs = [Request(i, tok.encode_prompt(SYSTEM + f"Item {i}:"), SamplingParams(max_new_tokens=10, **kw))
            for i, kw in enumerate([dict(presence_penalty=1.5), dict(frequency_penalty=2.0),
                                    dict(presence_penalty=-2.0, frequency_penalty=0.7, repetition_penalty=1.2), {}])]
    plain = {c.key: c.token_ids for c in Engine(model, eos_token_ids=EOS, min_shared_tokens=4).run(reqs)}
    got = {}
    for c in Engine(model, eos_token_ids=EOS, min_shared_tokens=4).run(reqs):
        got[c.key] = c.token_ids
        assert c.token_ids == loop_reference(model, reqs[c.key]), f"job {c.key}"
    # a stop token ends a row like EOS (and is reported, as EOS is)
    stop_at = plain[3][3]
    reqs[3].params = SamplingParams(max_new_tokens=10, stop_token_ids=(stop_at,))
    (c,) = [c for c in Engine(model, eos_token_ids=EOS).run([reqs[3]])]
    assert c.token_ids == plain[3][: plain[3].index(stop_at) + 1] and c.finish_reason == "stop"


def test_sampled_rows_with_processors_do_not_depend_on_their_batch():
    tok = tokenizer()
    model = make_model("llama")
    job = Request(0, tok.encode_prompt(SYSTEM + "Tell a story."),
                  SamplingParams(max_new_tokens=10, temperature=0.9, top_k=30, seed=5, n=3, repetition_penalty=1.2,
                                 presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((50, 3.0),), min_tokens=3))
    alone = sorted((c.sample_index, c.token_ids) for c in Engine(model, eos_token_ids=EOS).run([job]))
    others = _requests(tok, 8)
    for r in others:
        r.key += 1
    mixed = sorted((c.sample_index, c.token_ids) for c in Engine(model, eos_token_ids=EOS, min_shared_tokens=4)
                   .run([*others, job]) if c.key == 0)
    assert mixed == alone and len({tuple(t) for _, t in alone}) > 1
