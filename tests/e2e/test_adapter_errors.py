"""Bad adapters through the CLI: `validate` reports each one with its job's location, `process`
refuses the same rows before any work and runs every other job; a bad `--adapter` is a usage error.
`plan` shows groups per adapter. (Outputs of good adapters: tests/e2e/test_adapters.py.)"""
import json

import pyarrow.parquet as pq
import pytest

from tests.helpers.cli_helpers import run, write_jsonl
from tests.helpers.tiny_adapters import make_adapter
from tests.helpers.tiny_models import make_model

SHARED = "You answer briefly and kindly, in plain words, and you never make things up. "


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """One adapter directory per kind of refusal, by what the message says of it."""
    import transformers as T

    from tests.helpers.tiny_models import COMMON, LLAMA_LIKE

    root = tmp_path_factory.mktemp("bad-adapters")
    llama = make_model("llama")
    out = {"missing": (root / "nowhere", "no such directory")}
    other = T.LlamaForCausalLM(T.LlamaConfig(**COMMON, **(LLAMA_LIKE | dict(hidden_size=32))))
    out["other-base"] = (make_adapter(other, root / "other", rank=2), "an adapter for another base model")
    rank = make_adapter(llama, root / "rank", rank=8, targets=("k_proj",))
    config = json.loads((rank / "adapter_config.json").read_text())
    (rank / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    out["rank"] = (rank, "rank mismatch")
    out["dora"] = (make_adapter(llama, root / "dora", rank=2, use_dora=True), "a DoRA adapter (use_dora)")
    cut = make_adapter(llama, root / "cut", rank=8)
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[:-10])
    out["truncated"] = (cut, "adapter_model.safetensors is truncated")
    return out


def _lines(result):
    return sorted(line for line in result.output.splitlines() if line.startswith(("/", ".")) and ": " in line)


def test_validate_reports_every_bad_adapter_and_process_refuses_the_same_rows_only(tmp_path, model_dir, bad):
    rows = [{"id": "base", "prompt": SHARED + "What is rain?"}]
    rows += [{"id": kind, "prompt": SHARED + f"Say {kind}.", "adapter": kind} for kind in bad]
    rows += [{"id": "by-path", "prompt": SHARED + "Hi.", "adapter": str(bad["dora"][0])},
             {"id": "unknown", "prompt": SHARED + "Hi.", "adapter": "nobody"},
             {"id": "empty", "prompt": SHARED + "Hi.", "adapter": ""}]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    flags = [f for kind, (path, _) in bad.items() for f in ("--adapter", f"{kind}={path}")]
    checked = run(["validate", str(src), *flags], model_dir, ok=False)
    assert checked.exit_code == 1
    lines = _lines(checked)
    assert len(lines) == len(rows) - 1  # every row but the base model's
    for line_no, row in enumerate(rows, start=1):
        if row["id"] == "base":
            continue
        [line] = [x for x in lines if x.startswith(f"{src}:{line_no}: ")]
        if row["id"] in bad:
            path, message = bad[row["id"]]
            assert f"field 'adapter': " in line and str(path.absolute()) in line and message in line, line
    assert "'nobody' is neither a registered adapter name (registered: " in " ".join(lines)
    assert "field 'adapter' must be a non-empty string" in " ".join(lines)
    # process: the same rows refused with the same reasons, the other job run
    out = tmp_path / "out.parquet"
    run(["process", str(src), "-o", str(out), "--max-new-tokens", "3", *flags], model_dir)
    assert [r["id"] for r in pq.read_table(out).to_pylist()] == ["base"]
    errors = pq.read_table(str(out) + ".errors.parquet").to_pylist()
    assert sorted(f"{e['location']}: {e['reason']}" for e in errors) == lines
    assert "adapter" not in pq.read_schema(out).names  # no job that ran named one


def test_a_bad_default_adapter_or_option_is_a_usage_error(tmp_path, model_dir, bad):
    src = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "Hi"}])
    for cmd in (["validate", str(src)], ["plan", str(src)], ["process", str(src), "-o", str(tmp_path / "o.parquet")]):
        result = run([*cmd, "--adapter", str(bad["truncated"][0])], model_dir, ok=False)
        assert result.exit_code == 2 and "is truncated" in result.output, result.output
        assert not (tmp_path / "o.parquet").exists()
    twice = run(["validate", str(src), "--adapter", "a=x", "--adapter", "a=y"], model_dir, ok=False)
    assert twice.exit_code == 2 and "registers the name 'a' twice" in twice.output
    two = run(["validate", str(src), "--adapter", str(tmp_path), "--adapter", str(tmp_path / "b")], model_dir, ok=False)
    assert two.exit_code == 2 and "is a second default adapter" in two.output


def test_plan_shows_groups_per_adapter(tmp_path, model_dir):
    llama = make_model("llama")
    a = make_adapter(llama, tmp_path / "a", rank=2)
    b = make_adapter(llama, tmp_path / "b", rank=4, targets=("q_proj",))
    rows = [{"id": f"{who}-{i}", "prompt": SHARED + f"Question {i}?", **({"adapter": who} if who else {})}
            for who in ("", "a", "b") for i in range(3)]
    src = write_jsonl(tmp_path / "jobs.jsonl", rows)
    flags = ["--adapter", f"a={a}", "--adapter", f"b={b}", "--min-shared-tokens", "4"]
    report = json.loads(run(["plan", str(src), "--json", *flags], model_dir).output)
    # one group per adapter (the same prompts do not share across adapters), each of 3 jobs
    assert report["groups"] == 3
    assert report["adapters"] == [{"adapter": x, "jobs": 3, "groups": 1, "prompt_tokens": report["prompt_tokens"] // 3}
                                  for x in (None, "a", "b")]
    assert sorted(g["adapter"] or "" for g in report["top_groups"]) == ["", "a", "b"]
    # without adapters the same prompts are one group
    plain = [{"id": r["id"], "prompt": r["prompt"]} for r in rows]
    alone = json.loads(run(["plan", str(write_jsonl(tmp_path / "plain.jsonl", plain)), "--json",
                            "--min-shared-tokens", "4"], model_dir).output)
    assert alone["groups"] == 1 and "adapters" not in alone
    assert alone["prefill_tokens"] < report["prefill_tokens"]
    text = run(["plan", str(src), *flags], model_dir).output
    assert "adapter a: 3 jobs" in text and "adapter (base model): 3 jobs" in text
