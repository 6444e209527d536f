"""The embedded default model (SmolLM2-135M-Instruct) end to end through the CLI."""
import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.pipeline.cli import main
from batchgen.pipeline.model.load import load_model
from tests.helpers.reference import reference_generate
from batchgen.pipeline.text.tokenize import Tokenizer
from batchgen.pipeline.engine.types import Request, SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = ("You are a concise assistant for a public library. Answer in one or two sentences, "
          "and say so when you do not know.")


def test_default_model_greedy_output_equals_plain_generate(tmp_path):
    jobs = [
        {"id": "dream1", "prompt": "I have a dream"},
        {"id": "dream2", "prompt": "I have a dream"},  # the whole prompt is a shared prefix
        {"id": "dream3", "prompt": "I have a dream that"},
        *({"id": f"q{i}", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
          for i, q in enumerate(["When do you open?", "Can I renew a book online?", "Do you have wifi?"])),
        {"id": "n", "messages": [{"role": "user", "content": "Name a fruit."}], "n": 2},
    ]
    src = tmp_path / "jobs.jsonl"
    src.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    out = tmp_path / "out.parquet"
    result = CliRunner().invoke(main, ["process", str(src), "-o", str(out), "--max-new-tokens", "12",
                                       "--min-shared-tokens", "2", "--device", "cpu", "--dtype", "float32"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == ["dream1", "dream2", "dream3", "q0", "q1", "q2", "n", "n"]

    model, source = load_model(None, "cpu", "float32", own_decoder=False)  # transformers' model code
    tok = Tokenizer.load(source)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    for job, row in zip(jobs[:-1] + [jobs[-1], jobs[-1]], rows):
        ids = tok.encode_messages(job["messages"]) if "messages" in job else tok.encode_prompt(job["prompt"])
        want = reference_generate(model, Request(0, ids, SamplingParams(max_new_tokens=12)), eos)
        assert row["completion"] == tok.decode(want), job["id"]
        assert row["completion_tokens"] == len(want)
    assert rows[1]["cached_tokens"] > 0  # the repeated prompt reused the shared prefix
    assert rows[4]["cached_tokens"] >= len(tok.encode_messages([{"role": "system", "content": SYSTEM}])) - 2
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert summary["model"] == "SmolLM2-135M-Instruct" and summary["prefill_tokens"] < summary["prompt_tokens"]
    assert summary["model_code"] == "batchgen"  # the CLI ran batchgen's own decoder, checked against transformers


def test_default_model_with_a_random_adapter_equals_its_merged_model(tmp_path):
    """A random rank-8 adapter on every projection of the real default model: its jobs' greedy
    output is `generate` of PEFT's merged model, the base model's jobs beside them unchanged."""
    from tests.helpers.tiny_adapters import make_adapter, merged

    import torch
    import transformers

    _, source = load_model(None, "cpu", "float32", own_decoder=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()  # plain tensors
    adapter = make_adapter(model, tmp_path / "adapter", rank=8, seed=5, size=0.2)
    prompts = ["I have a dream", "I have a dream that", "The library opens at"]
    jobs = [{"id": f"{who}{i}", "prompt": p, **({"adapter": "a"} if who == "a" else {})}
            for who in ("a", "base") for i, p in enumerate(prompts)]
    src = tmp_path / "jobs.jsonl"
    src.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    out = tmp_path / "out.parquet"
    result = CliRunner().invoke(main, ["process", str(src), "-o", str(out), "--max-new-tokens", "12",
                                       "--min-shared-tokens", "2", "--device", "cpu", "--dtype", "float32",
                                       "--adapter", f"a={adapter}"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    rows = pq.read_table(out).to_pylist()
    tok = Tokenizer.load(source)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    tuned = merged(model, adapter)
    for job, row in zip(jobs, rows):
        ids = tok.encode_prompt(job["prompt"])
        want = reference_generate(tuned if "adapter" in job else model, Request(0, ids, SamplingParams(12)), eos)
        assert row["completion"] == tok.decode(want) and row["adapter"] == job.get("adapter"), job["id"]
    assert [r["completion"] for r in rows[:3]] != [r["completion"] for r in rows[3:]]  # the adapter counts
