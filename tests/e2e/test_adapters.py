"""LoRA adapters per job, end to end: one file mixing four adapters and the base model over shared
prefixes (a prompt equal to a shared prefix, n > 1, logprobs, scoring) gives, job for job, what
PEFT's merged model for that job's adapter gives: greedy tokens equal to its uncached `generate`,
logprobs and scores within 1e-4 of its full forward, in float32, on both model codes. Prefixes are
shared only within an adapter; the output says which adapter each job ran; resume knows adapters."""
import json
import os

import pyarrow.parquet as pq
import pytest
import torch

from batchgen.pipeline.engine.types import Request, SamplingParams
from batchgen.pipeline.text.tokenize import Tokenizer
from tests.helpers.cli_helpers import run, write_jsonl
from tests.helpers.reference import reference_generate
from tests.helpers.tiny_adapters import make_adapter, merged
from tests.helpers.tiny_models import make_model
from tests.helpers.tiny_tokenizer import make_tokenizer

SHARED = "You answer briefly and kindly, in plain words, and you never make things up. "
# (name, rank, targets, rslora): ranks 1, 8 and 64, attention only, MLP only, everything
KINDS = [("r1", 1, ("q_proj", "v_proj"), False), ("r8", 8, ("gate_proj", "up_proj", "down_proj"), False),
         ("r64", 64, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
         ("rs", 4, ("o_proj", "down_proj"), True)]
NEW = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = make_model("llama")  # the model_dir fixture's weights
    return {name: make_adapter(base, root / name, rank=rank, targets=targets, rslora=rslora, seed=i + 1)
            for i, (name, rank, targets, rslora) in enumerate(KINDS)}


@pytest.fixture(scope="module")
def references(adapters):
    base = make_model("llama")
    return {None: base, **{name: merged(base, path) for name, path in adapters.items()}}


def mixed_rows():
    """Per adapter (None: the base model): a prompt that is the shared prefix itself, one with
    n = 2, one with logprobs and prompt logprobs, a scoring job; all over one shared prefix."""
    rows = []
    for who in [None] + [k[0] for k in KINDS]:
        tag = {"adapter": who} if who else {}
        name = who or "base"
        rows += [{"id": f"{name}-prefix", "prompt": SHARED, **tag},
                 {"id": f"{name}-n2", "prompt": SHARED + "What is rain?", "n": 2, **tag},
                 {"id": f"{name}-lp", "prompt": SHARED + "Name a colour.", "logprobs": True, "top_logprobs": 2,
                  "prompt_logprobs": True, **tag},
                 {"id": f"{name}-score", "prompt": SHARED + "Is the sky blue?", "continuations": [" yes", " no"],
                  **tag}]
    return rows


def _logprobs(model, ids):
    """log-softmax of the model's full forward over `ids`: (len(ids), V)."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("code", ["batchgen", "transformers"])
def test_every_job_equals_its_adapters_merged_model(tmp_path, model_dir, adapters, references, code, monkeypatch):
    if code == "transformers":
        monkeypatch.setenv("BATCHGEN_DECODER", "0")
    rows = mixed_rows()
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    flags = [f for name, path in adapters.items() for f in ("--adapter", f"{name}={path}")]
    run(["process", str(src), "-o", str(out), "--max-new-tokens", str(NEW), "--min-shared-tokens", "4",
         "--dtype", "float32", *flags], model_dir)
    table = pq.read_table(out).to_pylist()
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert summary["model_code"] == code and summary["failed"] == 0
    assert summary["adapter_jobs"] == {"": 4, **{k[0]: 4 for k in KINDS}}
    tok = Tokenizer(make_tokenizer())
    by_id = {}
    for r in table:
        by_id.setdefault(r["id"], []).append(r)
    for row in rows:
        got, who = by_id[row["id"]], row.get("adapter")
        model = references[who]
        assert all(r["adapter"] == who for r in got)
        if "continuations" in row:
            [r] = got
            for text, s in zip(row["continuations"], r["scores"]):
                ctx, cont = tok.encode_pair(row["prompt"], text)
                lp = _logprobs(model, ctx + cont)
                want = sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
                assert abs(s["logprob"] - want) < 1e-4, (row["id"], s, want)
            continue
        ids = tok.encode_prompt(row["prompt"])
        want = reference_generate(model, Request(0, ids, SamplingParams(NEW)), [2])
        assert len(got) == row.get("n", 1)
        for r in got:  # token for token: the completion's text and its length
            assert r["completion"] == tok.decode(want) and r["completion_tokens"] == len(want), (row["id"], code)
        if row.get("logprobs"):
            [r] = got
            lp = _logprobs(model, ids + want)
            assert [x["id"] for x in r["logprobs"]] == want
            for i, x in enumerate(r["logprobs"]):
                assert abs(x["logprob"] - float(lp[len(ids) - 1 + i, x["id"]])) < 1e-4
            for i, p in enumerate(r["prompt_logprobs"][1:], start=1):
                assert abs(p - float(lp[i - 1, ids[i]])) < 1e-4
    # prefixes are shared within each adapter, never across: each job's cached tokens are its
    # adapter's shared prefix, the same in every adapter
    cached = {r["id"]: r["cached_tokens"] for r in table if r["sample_index"] == 0}
    for suffix in ("prefix", "n2", "lp"):
        values = {cached[f"{who}-{suffix}"] for who in ["base"] + [k[0] for k in KINDS]}
        assert len(values) == 1 and values.pop() > 0
    # what `plan` predicts for this file is what ran
    plan = json.loads(run(["plan", str(src), "--json", "--max-new-tokens", str(NEW), "--min-shared-tokens", "4",
                           *flags], model_dir).output)
    assert plan["groups"] == 1 + len(KINDS)
    assert plan["cached_tokens"] == summary["cached_tokens"]
    assert plan["prefill_tokens"] == summary["prefill_tokens"]


def test_the_same_prompts_without_adapters_share_across_what_would_be_adapters(tmp_path, model_dir):
    """The control: the tree separates adapters, not prompts (without adapters all jobs share)."""
    rows = [{k: v for k, v in r.items() if k != "adapter"} | {"id": f"{r['id']}-{i}"}
            for i, r in enumerate(mixed_rows())]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    plan = json.loads(run(["plan", str(src), "--json", "--max-new-tokens", str(NEW), "--min-shared-tokens", "4"],
                          model_dir).output)
    assert plan["groups"] == 1


def test_openai_body_model_selects_a_registered_adapter(tmp_path, model_dir, adapters, references):
    """body.model naming a registered adapter runs it; any other body.model is the base model's
    name (the default adapter's, with --adapter PATH)."""
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": SHARED + "What is rain?", "max_tokens": NEW}}
             for i, model in enumerate(["r8", "gpt-4o-mini", "rs"])]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--min-shared-tokens", "4",
         "--adapter", f"r8={adapters['r8']}", "--adapter", f"rs={adapters['rs']}"], model_dir)
    table = pq.read_table(out).to_pylist()
    assert [r["adapter"] for r in table] == ["r8", None, "rs"]
    tok = Tokenizer(make_tokenizer())
    ids = tok.encode_prompt(SHARED + "What is rain?")
    for r, who in zip(table, ["r8", None, "rs"]):
        assert r["completion"] == tok.decode(reference_generate(references[who], Request(0, ids, SamplingParams(NEW)),
                                                                [2]))
    # a default adapter for every job that names none: the unregistered body.model runs it
    out2 = tmp_path / "default.parquet"
    run(["process", str(src), "-o", str(out2), "--min-shared-tokens", "4", "--adapter", f"r8={adapters['r8']}",
         "--adapter", str(adapters["r1"])], model_dir)
    assert [r["adapter"] for r in pq.read_table(out2).to_pylist()] == ["r8", str(adapters["r1"]), str(adapters["r1"])]


def test_the_python_api_takes_adapters(model_dir, adapters, references):
    import batchgen

    engine = batchgen.Engine.load(str(model_dir), dtype="float32")
    jobs = [{"id": 1, "prompt": SHARED + "What is rain?", "adapter": "r1"},
            {"id": 2, "prompt": SHARED + "What is rain?"},
            {"id": 3, "prompt": SHARED + "What is rain?", "adapter": str(adapters["r64"])}]
    out = engine.generate(jobs, adapters={"r1": adapters["r1"]}, max_new_tokens=NEW, min_shared_tokens=4)
    tok = Tokenizer(make_tokenizer())
    ids = tok.encode_prompt(jobs[0]["prompt"])
    for r, who in zip(out, ["r1", None, "r64"]):
        assert r["error"] is None
        want = reference_generate(references[who], Request(0, ids, SamplingParams(NEW)), [2])
        assert r["completion"] == tok.decode(want)
    bad = engine.generate([{"prompt": "Hi", "adapter": "nobody"}], adapters={"r1": adapters["r1"]}, max_new_tokens=2)
    assert "is neither a registered adapter name" in bad[0]["error"]


def test_an_adapter_name_may_hold_spaces(tmp_path, model_dir, adapters, references):
    """`--adapter "my adapter=DIR"` registers "my adapter" (a name is any text without '=', '/' or
    '\\'): jobs select it by that name, the output and the summary say it; a NAME=PATH whose name
    holds a path's separator is a path, and the refusal says what a name may hold."""
    import batchgen

    name = "my adapter"
    rows = [{"id": "a", "prompt": SHARED + "What is rain?", "adapter": name},
            {"id": "b", "prompt": SHARED + "What is rain?"}]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--max-new-tokens", str(NEW), "--min-shared-tokens", "4",
         "--adapter", f"{name}={adapters['r8']}"], model_dir)
    table = pq.read_table(out).to_pylist()
    assert [r["adapter"] for r in table] == [name, None]
    tok = Tokenizer(make_tokenizer())
    ids = tok.encode_prompt(rows[0]["prompt"])
    for r, who in zip(table, ["r8", None]):
        assert r["completion"] == tok.decode(reference_generate(references[who], Request(0, ids, SamplingParams(NEW)),
                                                                [2]))
    assert json.loads(open(str(out) + ".summary.json").read())["adapter_jobs"] == {"": 1, name: 1}
    api = batchgen.generate(rows, str(model_dir), adapters={name: adapters["r8"]}, max_new_tokens=NEW,
                            min_shared_tokens=4, dtype="float32")
    assert [(r["adapter"], r["completion"]) for r in api] == [(r["adapter"], r["completion"]) for r in table]
    for spec, says in ((f"org/x={adapters['r8']}", "in NAME=PATH a name is any text but empty, without '=', '/'"),
                       (f" ={adapters['r8']}", "names no adapter before '='")):
        bad = run(["validate", str(src), "--adapter", spec], model_dir, ok=False)
        assert bad.exit_code == 2 and says in bad.output, bad.output
    with pytest.raises(batchgen.BatchgenError, match="a name is any text but empty, without '='"):
        batchgen.generate(rows, str(model_dir), adapters={"a/b": adapters["r8"]})


@pytest.mark.slow  # subprocesses, one killed
def test_resume_with_adapters_and_a_changed_adapter_refuses_it(tmp_path, model_dir, adapters):
    """A run killed after its first commit resumes to the uninterrupted output; an adapter whose
    weights changed in place makes the finished work another run's (refused without --overwrite)."""
    import shutil
    import subprocess
    import sys

    mine = tmp_path / "r8"
    shutil.copytree(adapters["r8"], mine)
    rows = [{"id": i, "prompt": SHARED + f"Item {i}?", **({"adapter": "a"} if i % 2 else {})} for i in range(8)]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    args = ["--max-new-tokens", "4", "--min-shared-tokens", "4", "--commit-every", "2", "--adapter", f"a={mine}"]
    ref = tmp_path / "ref.parquet"
    run(["process", str(src), "-o", str(ref), *args], model_dir)
    out = tmp_path / "out.parquet"
    env = {**os.environ, "BATCHGEN_MODEL": str(model_dir), "BATCHGEN_FAULT": "after-commit",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    killed = subprocess.run([sys.executable, "-m", "batchgen", "process", str(src), "-o", str(out), *args], env=env,
                            capture_output=True, text=True)
    assert killed.returncode != 0 and os.path.exists(str(out) + ".parts")
    run(["process", str(src), "-o", str(out), *args], model_dir)
    assert pq.read_table(out).to_pylist() == pq.read_table(ref).to_pylist()
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert summary["resumed_jobs"] > 0 and summary["adapter_jobs"] == {"": 4, "a": 4}
    # the adapter retrained in place: the killed run's work is not this run's
    subprocess.run([sys.executable, "-m", "batchgen", "process", str(src), "-o", str(tmp_path / "k.parquet"), *args],
                   env=env, capture_output=True, text=True)
    make_adapter(make_model("llama"), mine, rank=8, targets=KINDS[1][2], seed=99)
    refused = run(["process", str(src), "-o", str(tmp_path / "k.parquet"), *args], model_dir, ok=False)
    assert refused.exit_code == 1 and "--overwrite" in refused.output, refused.output


def _rows_of(path):
    return pq.read_table(path).to_pylist()


def test_shards_keep_adapter_groups_whole_and_merge_to_the_unsharded_output(tmp_path, model_dir, adapters):
    rows = [{"id": f"{who}-{i}", "prompt": SHARED + f"Item {i}?", **({"adapter": who} if who else {})}
            for who in (None, "r1", "r8") for i in range(3)]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    args = ["--max-new-tokens", "4", "--min-shared-tokens", "4", "--adapter", f"r1={adapters['r1']}",
            "--adapter", f"r8={adapters['r8']}"]
    whole = tmp_path / "whole.parquet"
    run(["process", str(src), "-o", str(whole), *args], model_dir)
    shards = [tmp_path / f"s{i}.parquet" for i in range(3)]
    for i, out in enumerate(shards):
        run(["process", str(src), "-o", str(out), "--shard", f"{i}/3", *args], model_dir)
    # a prefix group per adapter: each shard holds one adapter's jobs whole
    held = [{r["adapter"] for r in _rows_of(s)} for s in shards]
    assert sorted(len(h) for h in held) == [1, 1, 1] and set().union(*held) == {None, "r1", "r8"}
    merged_out = tmp_path / "merged.parquet"
    from click.testing import CliRunner

    from batchgen.pipeline.cli import main

    result = CliRunner().invoke(main, ["merge", *map(str, shards), "-o", str(merged_out)])
    assert result.exit_code == 0, result.output
    assert _rows_of(merged_out) == _rows_of(whole)
    summary = json.loads((tmp_path / "merged.parquet.summary.json").read_text())
    assert summary["adapter_jobs"] == {"": 3, "r1": 3, "r8": 3}


def test_structured_output_with_an_adapter_is_the_merged_models(model_dir, adapters, references):
    """A constrained job on an adapter chooses what the same job on the merged model chooses."""
    import batchgen

    jobs = [{"id": i, "prompt": SHARED + q, "choice": ["yes", "no", "maybe"], "adapter": "r64"}
            for i, q in enumerate(["Is rain wet?", "Is fire cold?", "Is snow white?"])]
    engine = batchgen.Engine.load(str(model_dir), dtype="float32")
    got = engine.generate(jobs, adapters={"r64": adapters["r64"]}, max_new_tokens=8, min_shared_tokens=4)
    plain = batchgen.Engine(references["r64"], make_tokenizer())
    want = plain.generate([{k: v for k, v in j.items() if k != "adapter"} for j in jobs], max_new_tokens=8,
                          min_shared_tokens=4)
    assert [r["completion"] for r in got] == [r["completion"] for r in want]
    assert all(r["completion"] in ("yes", "no", "maybe") and r["adapter"] == "r64" for r in got)


@pytest.mark.slow
def test_ray_engine_with_adapters_equals_the_local_engine(tmp_path, model_dir, adapters):
    pytest.importorskip("ray")
    rows = [{"id": f"{who}-{i}", "prompt": SHARED + f"Item {i}?", **({"adapter": who} if who else {})}
            for who in (None, "r1", "rs") for i in range(3)]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    args = ["--max-new-tokens", "4", "--min-shared-tokens", "4", "--adapter", f"r1={adapters['r1']}",
            "--adapter", f"rs={adapters['rs']}"]
    local = tmp_path / "local.parquet"
    run(["process", str(src), "-o", str(local), *args], model_dir)
    out_dir = tmp_path / "ray_out"
    run(["process", str(src), "-o", str(out_dir), "--engine", "ray", "--workers", "1", *args], model_dir)
    import pyarrow as pa

    parts = pa.concat_tables([pq.read_table(p) for p in sorted(out_dir.glob("part-*.parquet"))])
    ray_rows = sorted(parts.to_pylist(), key=lambda r: (r["_batchgen_order"], r["sample_index"]))
    for r in ray_rows:
        del r["_batchgen_order"]
    assert ray_rows == _rows_of(local)
    ray_summary = json.loads((out_dir / "summary.json").read_text())
    local_summary = json.loads((tmp_path / "local.parquet.summary.json").read_text())
    assert ray_summary["prefill_tokens"] == local_summary["prefill_tokens"]
    assert ray_summary["adapter_jobs"] == local_summary["adapter_jobs"] == {"": 3, "r1": 3, "rs": 3}
