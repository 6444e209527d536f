"""Conversations on a real vLLM (`--server`): every turn is a request of its own, made by
batchgen's renderer as the turn before it is answered, and sent ahead of the requests not yet sent.

One server for the module (test_vllm_engine's fixtures; its tiny random Llama has a chat template).
Checked: each turn equals vLLM's own `LLM.generate` on the conversation rendered up to that turn
with the earlier turns as the text batchgen wrote (the ids built here with batchgen's own renderer
and tokenizer, so a served path that renders differently fails); n = 2; turns ending by their length
limit and by a stop string; the server's cached tokens of a later turn reach into the earlier reply
(the history stayed in its prefix cache); a later turn the server refuses fails its job as one
located error row; `--verify` runs the conversations on batchgen's own engine turn by turn; and a
SIGKILL mid-run, rerun, gives every conversation once, each conversation's turns sent back to back.
"""
from __future__ import annotations

import json
import signal
import subprocess
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.jobs import GenerationDefaults, Job, Location
from batchgen.pipeline.engine.turns import common_prefix
from batchgen.pipeline.text.tokenize import Tokenizer
from batchgen.pipeline.text.turns import encode_turn
from tests.e2e.test_vllm_engine import (MAX_MODEL_LEN, ROOT, VENV, WRAPPER, _batchgen, _none_left, _Proxy,
                                        _write, server, tiny)  # noqa: F401 (the module's fixtures)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (VENV / "bin" / "vllm").exists(), reason="vLLM's venv: run `make vllm-env`")]

NEW = 12
SYSTEM = "You are a patient storyteller who answers in short plain sentences. "
BLOCK = 128  # vLLM's CPU KV block: its prefix cache holds whole blocks


def _chat(*users):
    out = [{"role": "system", "content": SYSTEM}]
    for u in users:
        out += [{"role": "user", "content": u}, {"role": "assistant", "content": None}]
    return out


def _padded(tok: Tokenizer, text: str, length: int) -> str:
    """`text` and x's: a prompt of `length` ids (one character one token past the merges)."""
    pad = length - len(tok.encode_prompt(text))
    assert pad >= 0
    return text + "x" * pad


def _jobs(tok: Tokenizer) -> list[dict]:
    return [
        {"id": "chat1", "messages": _chat("Name a fruit.", "Why that one?")},
        {"id": "chat2", "messages": _chat("Name a river.", "How long is it?", "And its source?"), "n": 2},
        {"id": "story", "prompt": "Once upon a time", "then": ["\nThen:", ""]},  # three rounds
        {"id": "stop", "messages": _chat("Count up.", "Go on."), "stop": ["e", "a", "o", "t"]},
        # turn 1's prompt ends 6 ids short of a block boundary: turn 2 finds that block, which holds the
        # first reply's tokens, in the server's cache only if the history stayed there
        {"id": "cache", "prompt": _padded(tok, "Tell a long tale. ", 2 * BLOCK - 6), "then": ["\nMore:"]},
        # turn 2's prompt passes the server's --max-model-len (not the model's window, which batchgen checks)
        {"id": "too-long", "prompt": "Short start.", "then": ["y" * (MAX_MODEL_LEN + 20)]},
        {"id": "plain", "prompt": SYSTEM + "Q: rain?"},  # an ordinary job beside them
    ]


def _as_job(spec: dict) -> Job:
    return Job.from_row(spec, Location("t"), GenerationDefaults(max_new_tokens=NEW), 0)


def _args(tiny, jobs, out, url):
    return [jobs, "-o", out, "--model", tiny, "--dtype", "float32", "--max-new-tokens", NEW, "--commit-every", 1,
            "--server", url]


def _reference(tiny: Path, prompts: list[list[int]], d: Path) -> list[list[int]]:
    """vLLM's own LLM.generate, greedy, on these ids (one engine start for them all)."""
    spec = {"model": str(tiny), "prompts": prompts, "max_tokens": NEW, "dtype": "float32",
            "args": {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True}}
    (d / "spec.json").write_text(json.dumps(spec))
    subprocess.run([str(WRAPPER), "python", str(ROOT / "tests" / "helpers" / "vllm_reference.py"),
                    str(d / "spec.json"), str(d / "out.json")], check=True, capture_output=True, timeout=600)
    return json.loads((d / "out.json").read_text())["token_ids"]


@pytest.fixture(scope="module")
def served(tiny, server, tmp_path_factory):
    """One run of the module's jobs on the server, with --verify on every job it can verify."""
    d = tmp_path_factory.mktemp("served")
    tok = Tokenizer.load(str(tiny))
    specs = _jobs(tok)
    out = d / "out.parquet"
    r = _batchgen([*_args(tiny, _write(d / "jobs.jsonl", specs), out, server.url), "--verify", 50])
    assert r.returncode == 0, r.stderr
    return {"tok": tok, "specs": specs, "rows": pq.read_table(out).to_pylist(), "dir": d,
            "summary": json.loads(Path(f"{out}.summary.json").read_text()),
            "errors": pq.read_table(f"{out}.errors.parquet").to_pylist()}


def test_every_turn_equals_llm_generate_on_the_conversation_so_far(tiny, served):
    tok, rows = served["tok"], served["rows"]
    specs = {s["id"]: s for s in served["specs"]}
    assert [(r["id"], r["sample_index"]) for r in rows] == [
        ("chat1", 0), ("chat2", 0), ("chat2", 1), ("story", 0), ("stop", 0), ("cache", 0), ("plain", 0)]
    prompts, where = [], []
    for row in rows:
        job = _as_job(specs[row["id"]])
        if job.then is None:
            assert row["turns"] is None
            continue
        assert len(row["turns"]) == job.turns == len(row["turn_finish_reasons"]) == len(row["turn_completion_tokens"])
        assert (row["completion"], row["finish_reason"], row["completion_tokens"]) == \
            (row["turns"][-1], row["turn_finish_reasons"][-1], row["turn_completion_tokens"][-1])
        for k in range(job.turns):  # batchgen's own renderer, on the turns as the output wrote them
            prompts.append(encode_turn(tok, job, row["turns"][:k]))
            where.append((row, job, k))
        assert row["prompt_tokens"] == len(prompts[-1])  # the last turn's prompt
    reference = _reference(tiny, prompts, served["dir"])
    for (row, job, k), want in zip(where, reference):
        cut = next((i + 1 for i in range(len(want)) if tok.completion_text(want[: i + 1], job.stop)[1]), None)
        want = want[:cut] if cut else want
        text, stopped = tok.completion_text(want, job.stop)
        reason = "stop" if stopped or want[-1] == 2 else "length"
        assert (row["turns"][k], row["turn_finish_reasons"][k], row["turn_completion_tokens"][k]) == \
            (text, reason, len(want)), f"{row['id']} sample {row['sample_index']} turn {k + 1}"
    by_id = {(r["id"], r["sample_index"]): r for r in rows}
    assert by_id["chat2", 0]["turns"] == by_id["chat2", 1]["turns"]  # n = 2, greedy: each branch the same
    reasons = [f for r in rows for f in r["turn_finish_reasons"] or []]
    assert "length" in reasons and by_id["stop", 0]["turn_finish_reasons"][0] == "stop"


def test_the_history_stays_in_the_servers_cache_and_the_summary_counts_turns(served):
    rows, summary, tok = served["rows"], served["summary"], served["tok"]
    cache = next(r for r in rows if r["id"] == "cache")
    first = len(tok.encode_prompt(_as_job(next(s for s in served["specs"] if s["id"] == "cache")).prompt))
    assert cache["turn_completion_tokens"][0] >= 7, cache  # its reply crosses the block boundary
    # turn 2's cached tokens (the row's: the last turn's, as the server reports them) reach past turn 1's
    # prompt: the block the first reply completed was still in the server's prefix cache
    assert cache["cached_tokens"] >= 2 * BLOCK > first, (cache["cached_tokens"], first)
    assert summary["engine"] == "server"
    # later turns: chat1 1, chat2 2 x 2, story 2, stop 1, cache 1, too-long 1 (its turn 2 refused: not counted)
    assert summary["turns"] == 1 + 4 + 2 + 1 + 1
    assert summary["carried_tokens"] >= 2 * BLOCK
    assert summary["completion_tokens"] == sum(sum(r["turn_completion_tokens"] or [r["completion_tokens"]])
                                               for r in rows)


def test_a_later_turn_the_server_refuses_fails_its_conversation(served):
    errors = served["errors"]
    assert [e["id"] for e in errors] == ["too-long"]
    assert errors[0]["location"].endswith(":6") and "turn 2: the server answered 400" in errors[0]["reason"], errors


def test_verify_runs_the_conversations_on_batchgens_engine(served):
    v = served["summary"]["verify"]
    # every greedy one-sample job: chat1, story, stop, cache, plain (chat2 has n = 2; too-long failed)
    assert v["jobs"] == 5 and v["agree"] == 5, v


def test_killed_then_rerun_gives_every_conversation_once(tiny, server, served, tmp_path):
    """SIGKILL at the first commit, then the same command through a recording proxy at --concurrency
    1: the rest is redone, every conversation once and equal to an uninterrupted run's, and each
    conversation's turns went out back to back (a next turn before the requests not yet sent)."""
    jobs = _write(tmp_path / "jobs.jsonl", served["specs"])
    out = tmp_path / "out.parquet"
    mark = str(uuid.uuid4())
    r = _batchgen([*_args(tiny, jobs, out, server.url), "--concurrency", 2], mark, BATCHGEN_FAULT="after-commit")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert list(Path(f"{out}.parts").glob("*.parquet"))  # its first commit (results or an error row)
    proxy = _Proxy(server.url, fail=0)
    try:
        r = _batchgen([*_args(tiny, jobs, out, proxy.url), "--concurrency", 1])
    finally:
        proxy.close()
    assert r.returncode == 0, r.stderr
    rows = pq.read_table(out).to_pylist()
    assert [(x["id"], x["sample_index"], x["turns"]) for x in rows] == \
        [(x["id"], x["sample_index"], x["turns"]) for x in served["rows"]]
    assert json.loads(Path(f"{out}.summary.json").read_text())["resumed_jobs"] >= 1
    # the rerun's requests, conversation by conversation: each one's prompts (its first turn's, then its
    # later turns', which start with it) were sent back to back
    tok = served["tok"]
    firsts = [encode_turn(tok, _as_job(s), []) for s in served["specs"]]
    owner = [max(range(len(firsts)), key=lambda i: common_prefix(firsts[i], p)) for p in proxy.prompts]
    assert len(owner) > len(set(owner))  # later turns were redone
    assert owner == sorted(owner, key=owner.index), owner  # contiguous: no conversation interleaved
    _none_left(mark)
