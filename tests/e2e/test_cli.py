"""`batchgen` end to end on a tiny model saved to disk: every input format, outputs, plan, validate."""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.cli_helpers import run, write_jsonl
from batchgen.pipeline.cli import main
from tests.helpers.reference import reference_generate
from batchgen.pipeline.text.tokenize import Tokenizer
from batchgen.pipeline.engine.types import Request, SamplingParams
from tests.helpers.tiny_models import make_model
from tests.helpers.tiny_tokenizer import make_tokenizer

SYSTEM = "You answer briefly and kindly, in plain words, and you never make things up. "


def test_process_jsonl_in_input_order_with_extras_samples_and_errors(tmp_path, model_dir):
    rows = [
        {"id": "b", "prompt": SYSTEM + "What is rain?", "topic": "weather"},
        {"id": "a", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
         "topic": "chat", "n": 2},
        "{not json",
        {"id": "c", "prompt": SYSTEM + "What is snow?", "topic": "weather", "max_new_tokens": 3},
        {"id": "d", "prompt": "", "topic": "bad"},
    ]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--max-new-tokens", "6", "--min-shared-tokens", "4"], model_dir)
    table = pq.read_table(out).to_pylist()
    assert [(r["id"], r["sample_index"]) for r in table] == [("b", 0), ("a", 0), ("a", 1), ("c", 0)]
    assert [r["topic"] for r in table] == ["weather", "chat", "chat", "weather"]
    assert pq.read_schema(out).names == ["topic", "id", "sample_index", "completion", "finish_reason",
                                         "prompt_tokens", "cached_tokens", "completion_tokens"]
    assert table[3]["completion_tokens"] <= 3
    assert table[0]["cached_tokens"] == 0 or table[3]["cached_tokens"] > 0
    # greedy output is plain generate's, job by job
    tok, model = Tokenizer(make_tokenizer()), make_model("llama")
    want = reference_generate(model, Request(0, tok.encode_prompt(rows[0]["prompt"]), SamplingParams(6)), [2])
    assert table[0]["completion"] == tok.decode(want)
    assert table[1]["completion"] == table[2]["completion"]  # greedy samples agree
    errors = pq.read_table(str(out) + ".errors.parquet").to_pylist()
    assert {e["location"] for e in errors} == {f"{src}:3", f"{src}:5"}
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert summary["jobs"] == 5 and summary["completed"] == 3 and summary["failed"] == 2
    assert summary["prompt_tokens"] == sum(r["prompt_tokens"] for r in table if r["sample_index"] == 0)
    assert summary["cached_tokens"] > 0 and summary["prefill_tokens"] < summary["prompt_tokens"]
    for key in ("wall_seconds", "model", "versions", "options", "completion_tokens"):
        assert key in summary
    # an existing output is never replaced without --overwrite
    again = run(["process", str(src), "-o", str(out)], model_dir, ok=False)
    assert again.exit_code != 0 and "--overwrite" in again.output


def test_parquet_input_with_template_and_jsonl_output(tmp_path, model_dir):
    src = tmp_path / "reviews.parquet"
    pq.write_table(pa.table({"text": ["good boots", "bad tent", "fine"], "stars": [5, 1, 3]}), src)
    out = tmp_path / "out.jsonl"
    run(["process", str(src), "-o", str(out), "--output-format", "jsonl", "--max-new-tokens", "4",
         "--prompt-template", SYSTEM + "Rewrite: {text}"], model_dir)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["id"], x["text"], x["stars"]) for x in lines] == [(0, "good boots", 5), (1, "bad tent", 1), (2, "fine", 3)]
    assert all(x["finish_reason"] in ("stop", "length") for x in lines)


def test_openai_batch_in_and_out(tmp_path, model_dir):
    rows = [
        {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "n": 2}},
        {"custom_id": "r2", "method": "POST", "url": "/v1/completions",
         "body": {"model": "x", "prompt": "Once upon", "max_tokens": 3, "temperature": 0.7, "seed": 1}},
    ]
    src = write_jsonl(tmp_path / "batch.jsonl", rows)
    out = tmp_path / "answers.jsonl"
    run(["process", str(src), "-o", str(out), "--output-format", "openai"], model_dir)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["r1", "r2"]
    chat, text = lines[0]["response"]["body"], lines[1]["response"]["body"]
    assert len(chat["choices"]) == 2 and "message" in chat["choices"][0]
    assert len(text["choices"]) == 1 and "text" in text["choices"][0]
    assert text["usage"]["completion_tokens"] <= 3


def test_plan_and_validate(tmp_path, model_dir):
    header = SYSTEM * 2
    rows = [{"prompt": header + f"Question {i}?"} for i in range(6)] + [{"prompt": "alone"}]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows + [{"prompt": 3}])
    res = run(["plan", str(src), "--min-shared-tokens", "8", "--json"], model_dir)
    report = json.loads(res.output)
    assert report["jobs"] == 8 and report["invalid"] == 1 and report["groups"] == 1
    assert report["top_groups"][0]["jobs"] == 6
    assert report["lower_bound"] <= report["prefill_tokens"] <= report["lower_bound"] + 7
    assert report["prefill_saving"] > 0.5
    text = run(["plan", str(src), "--min-shared-tokens", "8"], model_dir).output
    assert "saving" in text and "top groups" in text
    bad = run(["validate", str(src)], model_dir, ok=False)
    assert bad.exit_code == 1 and f"{src}:8: field 'prompt'" in bad.output
    good = write_jsonl(tmp_path / "good.jsonl", rows)
    assert run(["validate", str(good)], model_dir).exit_code == 0


def test_missing_input_is_a_clean_error(tmp_path, model_dir):
    res = run(["process", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.parquet")], model_dir, ok=False)
    assert res.exit_code == 1 and "nope.jsonl" in res.output and "Traceback" not in res.output


@pytest.mark.slow
def test_subprocess_run_with_env_vars(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": SYSTEM + f"Q{i}"} for i in range(3)])
    out = tmp_path / "o.parquet"
    env = {"BATCHGEN_MODEL": str(model_dir), "BATCHGEN_MAX_NEW_TOKENS": "3", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "batchgen", "process", str(src), "-o", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert pq.read_table(out).num_rows == 3
    assert "3/3 jobs done" in proc.stderr
    version = subprocess.run([sys.executable, "-m", "batchgen", "--version"], capture_output=True, text=True)
    assert "batchgen, version" in version.stdout
    # the script skips the interpreter's teardown (batchgen.pipeline.cli.script): exit codes and messages stay
    missing = subprocess.run([sys.executable, "-m", "batchgen", "process", str(tmp_path / "nope.jsonl"), "-o",
                              str(tmp_path / "o2.parquet")], capture_output=True, text=True, env=env, timeout=300)
    assert missing.returncode == 1 and "nope.jsonl" in missing.stderr and "Traceback" not in missing.stderr
    usage = subprocess.run([sys.executable, "-m", "batchgen", "process", "--no-such-flag"], capture_output=True,
                           text=True, env=env, timeout=300)
    assert usage.returncode == 2 and "no-such-flag" in usage.stderr


def test_every_environment_variable_is_documented_in_the_docs():
    docs = Path(__file__).parents[2] / "docs"
    names = {p.envvar for cmd in main.commands.values() for p in cmd.params if p.envvar}
    assert "BATCHGEN_TRUST_REMOTE_CODE" in names
    listed = (docs / "cli.md").read_text()
    assert sorted(n for n in names if n not in listed) == []
    # the one that runs a model's own code is documented beside its flag, with the warning
    para = next(p for p in (docs / "install.md").read_text().split("\n\n") if "BATCHGEN_TRUST_REMOTE_CODE" in p)
    assert "--trust-remote-code" in para and "trust" in para.lower() and "code" in para


def test_progress_lines_in_logs(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": SYSTEM + f"Q{i}"} for i in range(4)])
    res = run(["process", str(src), "-o", str(tmp_path / "o.parquet"), "--max-new-tokens", "2",
               "--progress-every", "0"], model_dir)
    lines = [x for x in res.stderr.splitlines() if x.startswith("batchgen: ")]
    assert len(lines) >= 4 and lines[-1].startswith("batchgen: 4/4 jobs (100.0%), ")
    assert all("tokens/s" in x and "ETA" in x for x in lines)


def test_jobs_without_a_seed_sample_apart_and_reruns_repeat(tmp_path, model_dir):
    """--seed is the run's seed: each job without its own derives one from it and its id, so two
    jobs with one prompt give different samples, and the same command gives the same text."""
    rows = [{"id": i, "prompt": SYSTEM + "Tell me a story."} for i in range(4)] + \
           [{"id": 9, "prompt": SYSTEM + "Tell me a story.", "seed": 5}, {"id": 10, "prompt": SYSTEM + "Tell me a story.", "seed": 5}]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    texts = []
    for k in range(2):
        out = tmp_path / f"out{k}.parquet"
        run(["process", str(src), "-o", str(out), "--max-new-tokens", "12", "--temperature", "1.0"], model_dir)
        texts.append(pq.read_table(out).column("completion").to_pylist())
    assert texts[0] == texts[1]
    assert len(set(texts[0][:4])) > 1  # not one sample four times
    assert texts[0][4] == texts[0][5]  # the same explicit seed, the same sample


# --- bad option values are usage errors (exit code 2), on every command that takes them ---------

BAD_OPTIONS = [
    (["--presence-penalty", "5"], "--presence-penalty"),
    (["--frequency-penalty", "-3"], "--frequency-penalty"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--logit-bias", '{"5": 200}'], "--logit-bias"),
    (["--logit-bias", '{"²": 1}'], "--logit-bias"),
    (["--logit-bias", "[oops"], "--logit-bias"),
    (["--seed", str(2**70)], "--seed"),
    (["--n", "20000"], "--n"),
    (["--stop", ""], "--stop"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--min-tokens", "9", "--max-new-tokens", "4"], "--min-tokens"),
    (["--top-logprobs", "2"], "--top-logprobs"),
    (["--json-schema", "no-such-schema.json"], "--json-schema"),
    (["--json-schema", "{oops"], "--json-schema"),
    (["--regex", "(["], "--regex"),
    (["--choice", "yes", "--regex", "y"], "--choice"),
    (["--prompt-template", "Summarize: {}"], "--prompt-template"),
    (["--prompt-template", "{text"], "--prompt-template"),
    (["--temperature", "-1"], "--temperature"),  # click's own range check: the same exit code
]


@pytest.mark.parametrize("command", ["process", "plan", "validate"])
@pytest.mark.parametrize("args, flag", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_a_bad_option_value_is_a_usage_error(tmp_path, model_dir, command, args, flag):
    src = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "hello"}])
    out = ["-o", str(tmp_path / "out.parquet")] if command == "process" else []
    res = run([command, str(src), *out, *args], model_dir, ok=False)
    assert res.exit_code == 2, res.output + repr(res.exception)
    assert f"Error: Invalid value for '{flag}'" in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out.parquet.parts").exists()


@pytest.mark.parametrize("args, flag", [(["--shard", "3/2"], "--shard"), (["--shard", "x"], "--shard"),
                                        (["--device", "gpu-please"], "--device"),
                                        (["--shard", "0/2", "--output-format", "jsonl"], "--output-format"),
                                        (["--engine", "ray", "--output-format", "jsonl"], "--output-format")])
def test_bad_process_options_are_usage_errors(tmp_path, model_dir, args, flag):
    src = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "hello"}])
    out = tmp_path / ("out.jsonl" if "--output-format" in args else "out.parquet")
    res = run(["process", str(src), "-o", str(out), *args], model_dir, ok=False)
    assert res.exit_code == 2 and f"Error: Invalid value for '{flag}'" in res.output, res.output


# --- validate reports what process refuses under its --output-format and --engine ---------------

def test_validate_takes_the_output_format_and_engine_of_process(tmp_path, model_dir, monkeypatch):
    rows = [{"id": "gen", "prompt": "hello"}, {"id": "score", "prompt": "Is it", "continuations": [" yes", " no"]}]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    assert run(["validate", str(src)], model_dir).exit_code == 0  # Parquet output holds scores
    out = tmp_path / "out.jsonl"
    run(["process", str(src), "-o", str(out), "--output-format", "openai", "--max-new-tokens", "2"], model_dir)
    refused = [json.loads(x) for x in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in refused] == ["score"]
    for how in (["--output-format", "openai"], []):
        if not how:
            monkeypatch.setenv("BATCHGEN_OUTPUT_FORMAT", "openai")  # the variable process reads, read too
        res = run(["validate", str(src), *how], model_dir, ok=False)
        assert res.exit_code == 1 and res.stdout.splitlines() == [f"{src}:2: field 'continuations': a scoring "
                                                                  "job's scores have no OpenAI output shape; use "
                                                                  "--output-format parquet or jsonl"], res.output
    monkeypatch.delenv("BATCHGEN_OUTPUT_FORMAT")
    for how in (["--engine", "ray"], []):
        if not how:
            monkeypatch.setenv("BATCHGEN_ENGINE", "ray")
        res = run(["validate", str(src), *how], model_dir, ok=False)
        assert res.exit_code == 1 and res.stdout.splitlines() == [f"{src}:2: a scoring job (continuations, or "
                                                                  "prompt_logprobs with max_new_tokens 0) does not "
                                                                  "run with --engine ray yet; run it without "
                                                                  "--engine ray"], res.output
    # plain rows too, where every one of them is refused by the defaults (no Job is made of them)
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "hello"}, {"prompt": "there"}])
    res = run(["validate", str(plain), "--max-new-tokens", "0", "--prompt-logprobs"], model_dir, ok=False)
    assert res.exit_code == 1 and [x.split(": ")[0] for x in res.stdout.splitlines()] == [f"{plain}:1", f"{plain}:2"]
    res = run(["validate", str(src), "--output-format", "jsonl"], model_dir, ok=False)  # BATCHGEN_ENGINE=ray
    assert res.exit_code == 2 and "is not supported with --engine ray" in res.output, res.output


# --- a value nested deeper than Parquet stores is one located row; the others run ----------------

def _nested(depth, kind):
    value = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def test_deeply_nested_values_are_located_rows_and_the_deepest_allowed_round_trip(tmp_path, model_dir):
    deep = '{"id": "deep", "prompt": "hi", "meta": ' + "[" * 5000 + "]" * 5000 + "}"
    rows = [{"id": "a", "prompt": "hello"}, deep, {"id": "lists", "prompt": "x", "meta": _nested(49, "list")},
            {"id": "objects", "prompt": "y", "tree": _nested(98, "object")},
            {"id": "too-deep", "prompt": "z", "tree": _nested(99, "object")}]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    res = run(["validate", str(src)], model_dir, ok=False)
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert [x.split(": ")[0] for x in res.stdout.splitlines()] == [f"{src}:2", f"{src}:5"], res.output
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--max-new-tokens", "2"], model_dir)
    table = pq.read_table(out).to_pylist()  # the deepest values Parquet stores, stored and read back
    assert [r["id"] for r in table] == ["a", "lists", "objects"]
    assert table[1]["meta"] == _nested(49, "list") and table[2]["tree"] == _nested(98, "object")
    errors = pq.read_table(str(out) + ".errors.parquet").to_pylist()
    assert [(e["id"], e["location"]) for e in errors] == [(None, f"{src}:2"), ("too-deep", f"{src}:5")]  # 2 unread
    assert all("nested too deeply" in e["reason"] for e in errors)
