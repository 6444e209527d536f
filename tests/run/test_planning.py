"""`batchgen plan` predicts the work the engine then does: the same batches, the same prefill."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.helpers.jobsets import edge_case_requests, tokenizer
from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.run.planning import summarize
from batchgen.pipeline.run.prefix_index import PrefixIndex
from tests.helpers.tiny_models import make_model


@pytest.mark.parametrize("budget", [120, 250, 100_000])
def test_plan_predicts_the_engines_batches_and_prefill(budget):
    reqs = edge_case_requests(tokenizer(), max_new_tokens=6)
    index = PrefixIndex.of([r.prompt_ids for r in reqs], [r.params.n for r in reqs],
                           [r.params.max_new_tokens for r in reqs])
    engine = Engine(make_model("llama"), eos_token_ids=[2], min_shared_tokens=4, max_batch_tokens=budget)
    # the runner hands the engine a window's requests in the index's sorted order
    engine.generate([reqs[j] for j in index.order[np.arange(len(index))].tolist()])
    planned = summarize(index, min_shared_tokens=4, max_batch_tokens=budget)
    assert planned["batches"] == engine.stats.batches  # rows may stop early at EOS: batches do not depend on it
    assert planned["prefill_tokens"] == engine.stats.prefill_tokens
    assert planned["shared_prefixes"] == engine.stats.prefix_nodes


def mixed_jobs():
    """Generating, scoring (prompt and chat) and prompt-scoring jobs under one header: samples,
    echo, continuations, a prompt scored alone that is the header itself, one longer than the
    context window (rolling windows), a one-token prompt."""
    from tests.helpers.jobsets import SHOTS, SYSTEM

    head = SYSTEM + SHOTS[0]
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is rain wet?"}]
    long = " ".join(f"Line {i}: the rain in the plain stays mainly where it falls." for i in range(14))
    rows = [{"id": f"gen{i}", "prompt": head + f"Q: {i}+1? A:", "n": 1 + (i % 3 == 0)} for i in range(5)]
    rows += [{"id": f"score{i}", "prompt": head + f"Q: {i}+{i}? A:", "continuations": [f" {2 * i}", " 0", " 00"]}
             for i in range(4)]
    rows += [{"id": f"alone{i}", "prompt": head + f"Q: why {i}?", "prompt_logprobs": True, "max_new_tokens": 0}
             for i in range(3)]
    rows += [{"id": "echo", "prompt": head + "Q: who?", "echo": True, "max_new_tokens": 2},
             {"id": "header", "prompt": head, "prompt_logprobs": True, "max_new_tokens": 0},
             {"id": "chat-gen", "messages": chat, "max_new_tokens": 2},
             {"id": "chat-score", "messages": chat, "continuations": ["yes", "no"]},
             {"id": "long", "prompt": long, "prompt_logprobs": True, "max_new_tokens": 0},
             {"id": "one", "prompt": "Q", "prompt_logprobs": True, "max_new_tokens": 2}]
    return rows


@pytest.mark.parametrize("extra", [[], ["--window-jobs", "3"]])
def test_plan_predicts_process_to_the_token_for_generating_scoring_and_prompt_scoring_jobs(tmp_path, model_dir,
                                                                                            extra):
    import json

    from tests.helpers.cli_helpers import run, write_jsonl

    src = write_jsonl(tmp_path / "jobs.jsonl", mixed_jobs())
    args = ["--min-shared-tokens", "4", "--max-new-tokens", "3", "--max-batch-tokens", "600", *extra]
    report = json.loads(run(["plan", str(src), "--json", *args], model_dir).stdout)
    run(["process", str(src), "-o", str(tmp_path / "out.parquet"), *args], model_dir)
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert summary["failed"] == 0
    keys = ("prompt_tokens", "prefill_tokens", "cached_tokens", "batches", "shared_prefixes")
    assert {k: report.get(k) for k in keys} == {k: summary[k] for k in keys}
    assert report["prefill_tokens"] >= report["lower_bound"]
    assert summary["cached_tokens"] > summary["prompt_tokens"] / 2  # prompt-scoring jobs share the header too


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(3, 200), min_size=1, max_size=40), st.sampled_from([0, 1, 5]), st.integers(1, 3),
       st.booleans(), st.sampled_from([None, 8, 64]), st.lists(st.lists(st.integers(3, 200), min_size=1, max_size=4),
                                                             max_size=3))
def test_a_jobs_index_entry_is_what_the_requests_process_runs_share_and_run(ids, max_new, n, echo, window, conts):
    """The prefix index's key and shapes of a job equal those of the requests the runner makes
    of it: every request shares the key but its last token, and has the shape plan counts."""
    from batchgen.jobs import GenerationDefaults, Job, Location
    from batchgen.pipeline.text.expand import JobTokens, index_entry, job_requests

    record = {"prompt": "x", "max_new_tokens": max_new, "n": n if max_new else 1, "prompt_logprobs": echo or not max_new}
    if conts:
        record = {"prompt": "x", "continuations": ["y"] * len(conts)}
    [job] = Job.from_record(record, Location(""), GenerationDefaults(), 0)
    if window is not None and not conts and max_new and len(ids) + max_new > window:
        window = None  # a generating job must fit its window: checked before any request is made
    tokens = JobTokens(ids, [(ids, c) for c in conts] if conts else None)
    key, shapes = index_entry(job, tokens, window)
    requests = job_requests(0, job, tokens, tokenizer(), window, seed=0)
    assert shapes == [r.shape for r in requests]
    assert key == ids[: len(key)] and all(r.shared_len == len(key) - 1 for r in requests)
    assert all(r.prompt_ids[: len(key) - 1] == key[:-1] for r in requests)
