"""Logprobs and scoring at the job level, end to end through `batchgen process` on the tiny model:
the columns equal one full uncached forward pass within 1e-4, validate names bad values with
their location, the Python API gives the CLI's rows, and a crash and rerun keeps every job once."""
import json
import os
import signal
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

from tests.helpers.jobsets import SHOTS, SYSTEM
from tests.helpers.cli_helpers import run, write_jsonl
from batchgen.pipeline.text.scoring import rolling_windows
from batchgen.pipeline.text.tokenize import Tokenizer
from tests.helpers.tiny_models import make_model
from tests.helpers.tiny_tokenizer import make_tokenizer

HEAD = SYSTEM + SHOTS[0]
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is rain wet? Answer yes or no."}]
LONG = " ".join(f"Line {i}: the rain in the plain stays mainly where it falls." for i in range(14))  # > 512 tokens


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(make_tokenizer())


@pytest.fixture(scope="module")
def model():
    return make_model("llama")  # the model_dir fixture's weights


def forward_logprobs(model, ids):
    """log_softmax of one plain forward's logits: row i is the distribution of token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def scored(model, ids, start):
    """log p(ids[i] | ids[:i]) for i >= start, and whether each was the argmax."""
    lp = forward_logprobs(model, ids)[start - 1 : -1]
    target = torch.tensor(ids[start:])
    return lp.gather(1, target[:, None])[:, 0], (lp.argmax(-1) == target)


def test_generated_and_prompt_logprobs_are_the_raw_distribution(tmp_path, model_dir, model, tok):
    rows = [{"id": "greedy", "prompt": HEAD + "Q: Is ice cold? A:", "logprobs": True, "top_logprobs": 3},
            # sampled and penalised: the column is still the unprocessed distribution
            {"id": "sampled", "prompt": HEAD + "Q: Is fire hot? A:", "logprobs": True, "top_logprobs": 2,
             "temperature": 0.9, "repetition_penalty": 1.3, "n": 2, "prompt_logprobs": True},
            {"id": "plain", "prompt": HEAD + "Q: Why? A:"}]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--max-new-tokens", "6", "--min-shared-tokens", "4"], model_dir)
    table = pq.read_table(out)
    assert table.schema.names[-4:] == ["cached_tokens", "completion_tokens", "logprobs", "prompt_logprobs"]
    got = table.to_pylist()
    assert [r["id"] for r in got] == ["greedy", "sampled", "sampled", "plain"]
    assert got[-1]["logprobs"] is None and got[-1]["prompt_logprobs"] is None and got[0]["prompt_logprobs"] is None
    for row, job in zip(got, [rows[0], rows[1], rows[1]]):
        prompt = tok.encode_prompt(job["prompt"])
        generated = [t["id"] for t in row["logprobs"]]
        assert len(generated) == row["completion_tokens"] > 0
        lp = forward_logprobs(model, prompt + generated)[len(prompt) - 1 : -1]
        want = lp.gather(1, torch.tensor(generated)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([t["logprob"] for t in row["logprobs"]]), want, atol=1e-4)
        k = job["top_logprobs"]
        for t, dist in zip(row["logprobs"], lp):
            top_v, top_i = dist.topk(k)
            assert [a["id"] for a in t["top"]] == top_i.tolist()
            assert torch.allclose(torch.tensor([a["logprob"] for a in t["top"]]), top_v, atol=1e-4)
            assert [t["token"]] + [a["token"] for a in t["top"]] == tok.token_texts([t["id"]] + top_i.tolist())
        if job.get("prompt_logprobs"):  # entry i is prompt token i's; the first has none
            assert len(row["prompt_logprobs"]) == len(prompt) and row["prompt_logprobs"][0] is None
            assert torch.allclose(torch.tensor(row["prompt_logprobs"][1:]), scored(model, prompt, 1)[0], atol=1e-4)
    greedy = got[0]["logprobs"]
    assert all(t["id"] == t["top"][0]["id"] for t in greedy)  # greedy picks the raw argmax here


SCORING = [
    # space-led continuations, some a single token; " 18" is an existing prefix of " 18."
    {"id": "add", "prompt": HEAD + "Q: 9+9? A:", "continuations": [" 18", " 19", " 8", " 18."], "topic": "math"},
    # the context is exactly the shared prefix of the other jobs
    {"id": "head", "prompt": HEAD, "continuations": ["Q: 2+2? A: 4.", "Q"]},
    {"id": "peru", "prompt": HEAD + "Q: capital of Peru? A: ", "continuations": ["Lima", "Paris"]},  # space moves
    {"id": "chat", "messages": CHAT, "continuations": ["yes", "no"]},
    {"id": "gen", "prompt": HEAD + "Q: 1+1? A:", "max_new_tokens": 3},  # a generating job beside them
]


def reply_pair(tok, messages, text):
    """A chat job's pair: the ids a generating job of these messages starts from (the generation
    prompt and the newline the template writes after it), then what the reply's text adds."""
    ctx = tok.encode_messages(messages)
    whole = tok.hf(tok.render(messages) + text, add_special_tokens=False)["input_ids"]
    assert whole[: len(ctx)] == ctx
    return ctx, whole[len(ctx) :]


def expected_scores(model, tok, job):
    out = []
    for text in job["continuations"]:
        ctx, cont = tok.encode_pair(job["prompt"], text) if "prompt" in job else reply_pair(tok, job["messages"], text)
        lp, greedy = scored(model, ctx + cont, len(ctx))
        out.append((text, lp.sum().item(), len(cont), bool(greedy.all())))
    return out


def check_scoring_rows(rows, model, tok):
    by_id = {r["id"]: r for r in rows}
    assert [r["id"] for r in rows] == [j["id"] for j in SCORING]
    for job in SCORING[:-1]:
        row = by_id[job["id"]]
        assert (row["completion"], row["finish_reason"], row["completion_tokens"]) == ("", "scored", 0)
        assert "logprobs" not in row and row["sample_index"] == 0  # no job asked: no column
        want = expected_scores(model, tok, job)
        assert [(s["continuation"], s["tokens"], s["is_greedy"]) for s in row["scores"]] == \
            [(t, n, g) for t, _, n, g in want]
        assert [s["logprob"] for s in row["scores"]] == pytest.approx([v for _, v, _, _ in want], abs=1e-4)
        best = max(range(len(want)), key=lambda i: (want[i][1], -i))  # the first of equal ones
        assert row["best_continuation"] == want[best][0]
    assert by_id["add"]["topic"] == "math" and by_id["add"]["scores"][2]["tokens"] == 2  # " 8": space + digit
    assert by_id["gen"]["scores"] is None and by_id["gen"]["best_continuation"] is None
    assert by_id["gen"]["completion_tokens"] > 0


def test_scoring_jobs_equal_full_forward_sums_in_parquet_jsonl_and_the_api(tmp_path, model_dir, model, tok):
    src = write_jsonl(tmp_path / "jobs.jsonl", SCORING)
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--min-shared-tokens", "4", "--max-new-tokens", "4"], model_dir)
    check_scoring_rows(pq.read_table(out).to_pylist(), model, tok)
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert summary["prefill_tokens"] < summary["prompt_tokens"] / 2  # the header and contexts prefilled once
    jsonl = tmp_path / "out.jsonl"
    run(["process", str(src), "-o", str(jsonl), "--output-format", "jsonl", "--min-shared-tokens", "4",
         "--max-new-tokens", "4"], model_dir)
    check_scoring_rows([json.loads(x) for x in jsonl.read_text().splitlines()], model, tok)

    import batchgen

    rows = batchgen.generate(SCORING, str(model_dir), max_new_tokens=4, min_shared_tokens=4, dtype="float32")
    check_scoring_rows(rows, model, tok)
    # the Batch API has no shape for scores: refused with the location, the others run
    res = run(["process", str(src), "-o", str(tmp_path / "o.jsonl"), "--output-format", "openai"], model_dir)
    errors = [json.loads(x) for x in (tmp_path / "o.jsonl.errors.jsonl").read_text().splitlines()]
    assert len(errors) == 4 and errors[0]["error"]["message"].startswith(f"{src}:1: field 'continuations'")
    assert res.exit_code == 0


def test_prompt_logprobs_alone_in_rolling_windows_beyond_the_context_window(tmp_path, model_dir, model, tok):
    rows = [{"id": "short", "prompt": HEAD + "Q: 3+3? A: 6.", "prompt_logprobs": True, "max_new_tokens": 0},
            {"id": "long", "prompt": LONG, "echo": True, "max_new_tokens": 0}]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--min-shared-tokens", "4"], model_dir)
    short, long = pq.read_table(out).to_pylist()
    ids = tok.encode_prompt(rows[0]["prompt"])
    assert short["prompt_logprobs"][0] is None and len(short["prompt_logprobs"]) == len(ids)
    assert torch.allclose(torch.tensor(short["prompt_logprobs"][1:]), scored(model, ids, 1)[0], atol=1e-4)
    assert (short["completion"], short["completion_tokens"], short["finish_reason"]) == ("", 0, "scored")
    ids = tok.encode_prompt(LONG)
    assert len(ids) > 512  # the tiny model's context window
    want = torch.cat([scored(model, ctx + pred, len(ctx))[0] for ctx, pred in rolling_windows(ids, 512)])
    assert len(long["prompt_logprobs"]) == len(ids) and long["prompt_logprobs"][0] is None
    assert torch.allclose(torch.tensor(long["prompt_logprobs"][1:]), want, atol=1e-4)
    # generating as well, the prompt must fit
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": LONG, "prompt_logprobs": True, "max_new_tokens": 2}])
    assert "exceeds the model's context window of 512" in run(["validate", str(bad)], model_dir, ok=False).output


def test_prompts_scored_alone_share_their_header_and_score_it_once(tmp_path, model_dir, model, tok):
    rows = [{"id": f"p{i}", "prompt": HEAD + f"Q: {i}+{i}? A: {2 * i}.", "prompt_logprobs": True,
             "max_new_tokens": 0} for i in range(6)]
    rows.append({"id": "head", "prompt": HEAD, "prompt_logprobs": True, "max_new_tokens": 0})  # the header itself
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--min-shared-tokens", "4"], model_dir)
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert summary["prefill_tokens"] < summary["prompt_tokens"] / 3 and summary["shared_prefixes"] >= 1
    head = len(tok.encode_prompt(HEAD))
    for row, job in zip(pq.read_table(out).to_pylist(), rows):
        ids = tok.encode_prompt(job["prompt"])
        assert row["cached_tokens"] >= head - 2  # all of the header but the tokens it runs itself
        got = torch.tensor(row["prompt_logprobs"][1:])
        assert torch.allclose(got, scored(model, ids, 1)[0], atol=2e-5, rtol=0), row["id"]


def test_a_chat_continuation_is_scored_as_the_assistants_reply(tmp_path, model_dir, model, tok):
    rows = [{"id": "chat", "messages": CHAT, "continuations": ["yes", "no"]},
            {"id": "gen", "messages": CHAT, "max_new_tokens": 2}]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--min-shared-tokens", "4"], model_dir)
    chat, gen = pq.read_table(out).to_pylist()
    rendered, ctx = tok.render(CHAT), tok.encode_messages(CHAT)
    assert rendered.endswith("<|im_start|>assistant\n")  # the template writes a newline after the prompt
    for score, text in zip(chat["scores"], ["yes", "no"]):
        cont = tok.hf(rendered + text, add_special_tokens=False)["input_ids"][len(ctx) :]
        assert tok.decode(cont) == text  # the reply's tokens only: the newline is the prompt's
        assert score["tokens"] == len(cont)
        assert score["logprob"] == pytest.approx(scored(model, ctx + cont, len(ctx))[0].sum().item(), abs=2e-5)
    # the context is the generating job's prompt: both share all of it but its last token
    assert chat["cached_tokens"] == 2 * (len(ctx) - 1) and gen["cached_tokens"] == len(ctx) - 1


def test_a_reply_that_merges_with_the_generation_prompt_is_refused_with_its_field():
    from batchgen.jobs import GenerationDefaults, Job, Location
    from batchgen.pipeline.text.expand import tokenize_jobs
    from batchgen.pipeline.text.tokenize import TokenizerError

    merging = Tokenizer(make_tokenizer(extra_merges=[("\n", "\n")]))  # "\n\n" is one token
    [job] = Job.from_record({"messages": CHAT, "continuations": ["yes", "\nyes"]}, Location("x.jsonl", line=1),
                            GenerationDefaults(), 0)
    [got] = tokenize_jobs(merging, [job])
    assert isinstance(got, TokenizerError) and str(got).startswith("field 'continuations[1]': ")
    plain = Tokenizer(make_tokenizer())  # where the newline is a token of its own, the reply may begin with one
    [ok] = tokenize_jobs(plain, [job])
    assert ok.ids == plain.encode_messages(CHAT) and plain.decode(ok.pairs[1][1]) == "\nyes"


def test_validate_reports_bad_logprob_and_scoring_fields_with_their_location(tmp_path, model_dir):
    rows = [{"prompt": "x", "logprobs": "yes"},
            {"prompt": "x", "top_logprobs": 3},
            {"prompt": "x", "logprobs": True, "top_logprobs": 50},
            {"prompt": "x", "continuations": []},
            {"prompt": "x", "continuations": [" a"], "n": 2},
            {"prompt": "x", "continuations": [" a"], "json_schema": {"type": "object"}},
            {"prompt": "x", "max_new_tokens": 0},
            {"prompt": "Q:", "continuations": [" a", LONG]},
            {"prompt": "x", "continuations": [" fine"], "id": "ok"}]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    res = run(["validate", str(src)], model_dir, ok=False)
    assert res.exit_code == 1
    for line, message in [(1, "field 'logprobs' must be true or false"),
                          (2, "field 'top_logprobs' is 3 but logprobs is not true"),
                          (3, "field 'top_logprobs' must be an integer in [0, 20]"),
                          (4, "field 'continuations' must be a non-empty list of non-empty strings"),
                          (5, "field 'n' is a generation parameter, but this job has continuations"),
                          (6, "field 'json_schema' is a generation parameter, but this job has continuations"),
                          (7, "field 'max_new_tokens' must be a positive integer, got 0"),
                          (8, "field 'continuations[1]': prompt + continuation are")]:
        assert f"{src}:{line}: {message}" in res.output, res.output
    assert f"{src}:9" not in res.output
    res = run(["validate", str(src), "--top-logprobs", "2"], model_dir, ok=False)
    assert "top_logprobs" in res.output and "logprobs is not true" in res.output


@pytest.mark.slow
def test_a_killed_scoring_run_resumes_to_every_job_once(tmp_path, model_dir):
    rows = [{"id": f"q{i}", "prompt": HEAD + f"Q: {i}+{i}? A:", "continuations": [f" {2 * i}", f" {i}", " 0"]}
            for i in range(12)]
    rows += [{"id": f"g{i}", "prompt": HEAD + f"Q: {i}? A:", "logprobs": True} for i in range(4)]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    args = ["--max-new-tokens", "3", "--min-shared-tokens", "4", "--commit-every", "2", "--window-jobs", "4"]
    ref = tmp_path / "ref.parquet"
    run(["process", str(src), "-o", str(ref), *args], model_dir)
    out = tmp_path / "out.parquet"
    env = {**os.environ, "BATCHGEN_MODEL": str(model_dir), "BATCHGEN_FAULT": "after-commit"}
    proc = subprocess.run([sys.executable, "-m", "batchgen", "process", str(src), "-o", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL and os.path.exists(str(out) + ".parts/manifest.json")
    run(["process", str(src), "-o", str(out), *args], model_dir)
    got, want = pq.read_table(out).to_pylist(), pq.read_table(ref).to_pylist()
    assert [r["id"] for r in got] == [r["id"] for r in rows]  # every job once, in input order
    for a, b in zip(got, want):
        assert a["scores"] == b["scores"] or all(x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
                                                 for x, y in zip(a["scores"], b["scores"]))
        assert a["best_continuation"] == b["best_continuation"]
        for count in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            assert a[count] == b[count], (a["id"], count)
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    reference = json.loads((tmp_path / "ref.parquet.summary.json").read_text())
    assert summary["resumed_jobs"] > 0
    for count in ("jobs", "completed", "rows", "prompt_tokens", "cached_tokens", "completion_tokens"):
        assert summary[count] == reference[count], count
