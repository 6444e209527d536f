"""Conversations end to end: `batchgen process` generates every assistant turn of a chat job (its
`"content": null` messages) and every round of a prompt job's `then`, in one run; each turn equals
plain uncached `generate` on the conversation rendered up to it, with the earlier turns as the
output wrote them."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import batchgen
from batchgen.pipeline.cli import main
from batchgen.pipeline.engine.types import Request, SamplingParams
from batchgen.pipeline.text.tokenize import Tokenizer
from batchgen.pipeline.text.turns import render_turn
from batchgen.jobs import GenerationDefaults, Job, Location
from tests.helpers.cli_helpers import run, write_jsonl
from tests.helpers.reference import reference_generate
from tests.helpers.tiny_models import make_model
from tests.helpers.tiny_tokenizer import CHAT_TEMPLATE, make_tokenizer

SYSTEM = "You answer briefly and kindly, in plain words, and you never make things up. "
# a template that rewrites a reply: an assistant message's content is stripped, and cut at '|'
REWRITING = CHAT_TEMPLATE.replace("{{ m['content'] }}",
                                  "{% if m['role'] == 'assistant' %}{{ m['content'].split('|')[0] | trim }}"
                                  "{% else %}{{ m['content'] }}{% endif %}")


def chat(*users, system=SYSTEM):
    out = [{"role": "system", "content": system}] if system else []
    for u in users:
        out += [{"role": "user", "content": u}, {"role": "assistant", "content": None}]
    return out


def conversation_jobs():
    return [
        {"id": "mt1", "messages": chat("Name a fruit.", "Why that one?"), "category": "writing"},
        {"id": "mt2", "messages": chat("Name a river.", "How long is it?", "And its source?"), "n": 2},
        {"id": "one", "messages": chat("Say a word.", "Another."), "max_new_tokens": 1},  # one-token turns
        {"id": "stop", "messages": chat("Count up.", "Go on."), "stop": ["e"]},  # a stop string ends turns
        {"id": "story", "prompt": "Once upon a time", "then": [" Then", ""]},  # append and continue
        {"id": "plain", "prompt": SYSTEM + "Q: rain?"},  # an ordinary job beside them
        {"id": "tools", "messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": None},
                                     {"role": "tool", "content": "42"}, {"role": "user", "content": "So?"},
                                     {"role": "assistant", "content": None}]},
    ]


@pytest.fixture(scope="module")
def rewriting_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama-rewriting")
    make_model("llama").save_pretrained(d)
    tok = make_tokenizer()
    tok.chat_template = REWRITING
    tok.save_pretrained(d)
    return d


def check_turns(model, tok: Tokenizer, rows, jobs, max_new_tokens):
    """Every turn of every row equals `generate` on its conversation rendered with the turns before it."""
    by_id = {j["id"]: j for j in jobs}
    for row in rows:
        spec = by_id[row["id"]]
        job = Job.from_row(spec, Location("t"), GenerationDefaults(max_new_tokens=max_new_tokens), 0)
        if job.then is None:
            assert row.get("turns") is None
            continue
        assert len(row["turns"]) == job.turns == len(row["turn_finish_reasons"]) == len(row["turn_completion_tokens"])
        assert row["completion"] == row["turns"][-1] and row["finish_reason"] == row["turn_finish_reasons"][-1]
        assert row["completion_tokens"] == row["turn_completion_tokens"][-1]
        for k in range(job.turns):
            prompt, messages = render_turn(job, row["turns"][:k])
            [ids] = tok.encode_many([prompt], [messages])
            want = reference_generate(model, Request(0, ids, SamplingParams(max_new_tokens=job.max_new_tokens)), [2])
            cut = next((i + 1 for i in range(len(want)) if tok.completion_text(want[: i + 1], job.stop)[1]), None)
            want = want[:cut] if cut else want
            text, stopped = tok.completion_text(want, job.stop)
            reason = "stop" if stopped or want[-1] == 2 else "length"
            where = f"{row['id']} sample {row['sample_index']} turn {k}"
            assert (row["turns"][k], row["turn_finish_reasons"][k], row["turn_completion_tokens"][k]) == \
                (text, reason, len(want)), where
            if k == job.turns - 1:
                assert row["prompt_tokens"] == len(ids), where


@pytest.mark.slow
@pytest.mark.parametrize("template", ["plain", "rewriting"])
def test_every_turn_equals_generate_on_the_conversation_so_far(tmp_path, model_dir, rewriting_dir, template):
    directory = model_dir if template == "plain" else rewriting_dir
    jobs = conversation_jobs()
    src = write_jsonl(tmp_path / "jobs.jsonl", jobs)
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--max-new-tokens", "5", "--min-shared-tokens", "4"], directory)
    rows = pq.read_table(out).to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [
        ("mt1", 0), ("mt2", 0), ("mt2", 1), ("one", 0), ("stop", 0), ("story", 0), ("plain", 0), ("tools", 0)]
    assert rows[0]["category"] == "writing"
    tok = Tokenizer.load(str(directory))
    check_turns(make_model("llama"), tok, rows, jobs, 5)
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert summary["turns"] == 1 + 2 * 2 + 1 + 1 + 2 + 1
    assert summary["turn_reruns"] == 0 and summary["carried_tokens"] > 0
    # completion tokens: every turn's of a conversation
    assert summary["completion_tokens"] == sum(sum(r["turn_completion_tokens"] or [r["completion_tokens"]]) for r in rows)
    assert summary["run_completion_tokens"] == summary["completion_tokens"]  # this run's share: every turn too
    # n = 2: each sample its own branch, from its first turn on (greedy: the same text)
    assert rows[1]["turns"] == rows[2]["turns"]
    if template == "plain":  # turns that end by a stop string (its text cut: the next prompt parts from the
        # generated ids), by EOS and by their length limit; one-token turns
        assert rows[4]["turn_finish_reasons"][0] == "stop" and rows[4]["turn_completion_tokens"][0] < 5
        assert "stop" in rows[1]["turn_finish_reasons"] and "length" in rows[1]["turn_finish_reasons"]
        assert rows[3]["turn_completion_tokens"] == [1, 1]


def test_the_python_api_gives_the_same_columns(tmp_path, model_dir):
    jobs = conversation_jobs()[:2]
    rows = batchgen.generate(jobs, model=str(model_dir), max_new_tokens=4, min_shared_tokens=4)
    assert [r["id"] for r in rows] == ["mt1", "mt2", "mt2"]
    tok = Tokenizer.load(str(model_dir))
    check_turns(make_model("llama"), tok, rows, jobs, 4)


def test_bad_conversations_are_refused_with_their_location(tmp_path, model_dir):
    rows = [
        {"id": 1, "messages": [{"role": "user", "content": None}]},
        {"id": 2, "messages": chat("a", "b") + [{"role": "user", "content": "c"}]},
        {"id": 3, "prompt": "x", "then": "y"},
        {"id": 4, "prompt": "x", "then": [" y"], "logprobs": True},
        {"id": 5, "prompt": "x", "then": [" y" * 300]},  # outgrows the context window
        {"custom_id": "r", "body": {"messages": chat("a")}},
        {"id": 7, "prompt": "x", "then": [" y"]},
    ]
    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    res = run(["validate", str(src), "--max-new-tokens", "3"], model_dir, ok=False)
    assert res.exit_code == 1
    lines = [line for line in res.output.splitlines() if "bad.jsonl:" in line]
    assert len(lines) == 6, res.output
    assert "bad.jsonl:1" in lines[0] and "messages[0].content" in lines[0] and "only an assistant" in lines[0]
    assert "bad.jsonl:2" in lines[1] and "messages[5]" in lines[1]
    assert "bad.jsonl:3" in lines[2] and "'then'" in lines[2]
    assert "bad.jsonl:4" in lines[3] and "'logprobs'" in lines[3]
    assert "bad.jsonl:5" in lines[4] and "context window" in lines[4]
    assert "bad.jsonl:6" in lines[5] and "body.messages[2].content" in lines[5] and "Batch API" in lines[5]
    out = tmp_path / "out.parquet"
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(out), "--max-new-tokens", "3",
                                    "--model", str(model_dir)])
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in pq.read_table(out).to_pylist()] == [7]
    assert len(pq.read_table(str(out) + ".errors.parquet")) == 6


def test_a_served_run_validates_conversations(tmp_path, model_dir):
    """A completions server runs conversations (each turn a request, made by batchgen as the turn
    before it is answered: tests/e2e/test_vllm_conversations.py), so `validate --engine vllm`
    reports none of them; what a conversation cannot be, it still reports, with the location."""
    rows = [{"id": 1, "prompt": "x", "then": [" y"]},
            {"id": 2, "messages": chat("a") + [{"role": "user", "content": "b"}, {"role": "assistant", "content": None}]},
            {"id": 3, "prompt": "one turn"},
            {"id": 4, "prompt": "x", "then": [" y"], "logprobs": True}]
    src = write_jsonl(tmp_path / "turns.jsonl", rows)
    res = run(["validate", str(src), "--max-new-tokens", "3", "--engine", "vllm"], model_dir, ok=False)
    lines = [line for line in res.output.splitlines() if "turns.jsonl:" in line]
    assert len(lines) == 1 and "turns.jsonl:4" in lines[0] and "'logprobs'" in lines[0], res.output
    ok = write_jsonl(tmp_path / "ok.jsonl", rows[:3])
    run(["validate", str(ok), "--max-new-tokens", "3", "--engine", "vllm"], model_dir)  # exits 0


def test_plan_reports_conversations_turns_and_the_expected_prefill(tmp_path, model_dir):
    jobs = conversation_jobs()
    src = write_jsonl(tmp_path / "jobs.jsonl", jobs)
    res = run(["plan", str(src), "--json", "--max-new-tokens", "5", "--min-shared-tokens", "4"], model_dir)
    report = json.loads(res.output)
    assert report["conversations"] == 6 and report["turns"] == 2 + 3 * 2 + 2 + 2 + 3 + 2
    assert report["expected_prefill_tokens"] == report["prefill_tokens"] + report["later_turn_prefill_tokens"]
    # a run prefills that, but for replies whose re-tokenized text parts from the generated ids
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--max-new-tokens", "5", "--min-shared-tokens", "4"], model_dir)
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert report["expected_prefill_tokens"] <= summary["prefill_tokens"] <= report["expected_prefill_tokens"] + 4 * 9
    text = run(["plan", str(src), "--max-new-tokens", "5"], model_dir).output
    assert "conversations: 6   turns: 17" in text


def single_turn_jobs(job_row, turns):
    """Each turn of a conversation as an ordinary job: its conversation so far, earlier turns filled in."""
    job = Job.from_row(job_row, Location("t"), GenerationDefaults(), 0)
    out = []
    for k in range(job.turns):
        prompt, messages = render_turn(job, turns[:k])
        row = {key: v for key, v in job_row.items() if key not in ("messages", "prompt", "then", "id")}
        out.append({**row, "id": k, **({"prompt": prompt} if prompt is not None else {"messages": messages})})
    return out


def test_every_turn_follows_its_constraint_and_its_adapter(tmp_path, model_dir):
    """Structured output holds per turn, and an adapter runs every turn: each turn is what the same
    job, run alone on the conversation so far, gives."""
    from tests.helpers.tiny_adapters import make_adapter

    adapter = make_adapter(make_model("llama"), tmp_path / "lora", rank=4, seed=3)
    engine = batchgen.Engine.load(str(model_dir), dtype="float32")
    jobs = [{"id": "json", "messages": chat("Give a record.", "Another."), "regex": "[a-z]{2,4}!"},
            {"id": "choice", "prompt": "Yes or no? ", "then": [" Sure? ", " Really? "], "choice": ["yes", "no"]},
            {"id": "lora", "messages": chat("Hi.", "Go on."), "adapter": str(adapter)}]
    rows = engine.generate(jobs, max_new_tokens=6, min_shared_tokens=4)
    assert [r["error"] for r in rows] == [None] * 3
    import re
    assert all(re.fullmatch("[a-z]{2,4}!", t) for t in rows[0]["turns"])
    assert len(rows[1]["turns"]) == 3 and set(rows[1]["turns"]) <= {"yes", "no"}
    for spec, row in zip(jobs, rows):
        alone = engine.generate(single_turn_jobs(spec, row["turns"]), max_new_tokens=6, min_shared_tokens=4)
        assert [r["completion"] for r in alone] == row["turns"], spec["id"]
        assert [r["finish_reason"] for r in alone] == row["turn_finish_reasons"], spec["id"]
    base = engine.generate([{**jobs[2], "adapter": None}], max_new_tokens=6)
    assert base[0]["turns"] != rows[2]["turns"]  # the adapter made a difference


@pytest.mark.slow
def test_the_default_model_answers_every_turn_as_generate_does(tmp_path):
    """SmolLM2 (batchgen's own decoder) on two-turn questions under one system prompt, MT-bench's
    shape; the reference is transformers' model code, uncached."""
    from batchgen.pipeline.model.load import load_model

    system = "You are a concise assistant. Answer in one sentence."
    jobs = [{"id": f"q{i}", "messages": chat(a, b, system=system)} for i, (a, b) in enumerate([
        ("Name a large river.", "Where does it end?"), ("What is rain?", "And snow?"),
        ("Give me a colour.", "Why that one?")])]
    src = write_jsonl(tmp_path / "jobs.jsonl", jobs)
    out = tmp_path / "out.parquet"
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(out), "--max-new-tokens", "10",
                                    "--min-shared-tokens", "2", "--device", "cpu", "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out).to_pylist()
    model, source = load_model(None, "cpu", "float32", own_decoder=False)
    eos = model.generation_config.eos_token_id
    tok = Tokenizer.load(source)
    for spec, row in zip(jobs, rows):
        job = Job.from_row(spec, Location("t"), GenerationDefaults(max_new_tokens=10), 0)
        for k in range(2):
            _, messages = render_turn(job, row["turns"][:k])
            want = reference_generate(model, Request(0, tok.encode_messages(messages), SamplingParams(10)),
                                      eos if isinstance(eos, list) else [eos])
            assert row["turns"][k] == tok.decode(want) and row["turn_completion_tokens"][k] == len(want), (spec["id"], k)
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert summary["model_code"] == "batchgen" and summary["turns"] == 3 and summary["turn_reruns"] == 0
