"""No traceback for any model: every model batchgen does not run is refused by the CLI in one
line naming the model, by `validate` (from the config, no weights) as by `process` (issue 48).

Before issue 48 stablelm, falcon and nemotron passed `validate`, loaded, and `process` died with
`KeyError: 'batchgen_step'` from the first forward: those cases fail on that code.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from batchgen.pipeline.cli import main
from tests.helpers import hf_families
from tests.helpers.tiny_models import model_from_config
from tests.helpers.tiny_tokenizer import make_tokenizer

# (name, family, config edits, what the line says)
MODELS = [
    ("stablelm", "stablelm", {}, "model type 'stablelm' is not supported"),
    ("falcon", "falcon", {}, "model type 'falcon' is not supported"),
    ("falcon-alibi", "falcon", {"alibi": True, "new_decoder_architecture": False}, "model type 'falcon'"),
    ("nemotron", "nemotron", {}, "model type 'nemotron' is not supported"),
    ("lfm2", "lfm2", {}, "model type 'lfm2' is not supported"),
    ("phi3-longrope", "phi3", {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}, "partial_rotary_factor": 1.0}, "longrope"),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    out = {}
    for name, family, edits, _ in MODELS:
        d = tmp_path_factory.mktemp(name)
        config = hf_families.config(family, 0)
        if family == "phi3":
            config.num_attention_heads, config.hidden_size = 4, 64  # head size 16: 8 rope factors
        for key, value in edits.items():
            setattr(config, key, value)
        model_from_config(config).save_pretrained(d)
        make_tokenizer().save_pretrained(d)
        out[name] = d
    return out


@pytest.mark.parametrize("name,family,edits,says", MODELS, ids=[m[0] for m in MODELS])
@pytest.mark.parametrize("command", ["validate", "plan", "process"])
def test_a_model_batchgen_does_not_run_is_one_line(command, name, family, edits, says, model_dirs, tmp_path):
    src = tmp_path / "jobs.jsonl"
    src.write_text('{"prompt": "hello there"}\n')
    args = [command, str(src), "--model", str(model_dirs[name])]
    if command == "process":
        args += ["-o", str(tmp_path / "out.parquet"), "--max-new-tokens", "2"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and says in lines[0] and str(model_dirs[name]) in lines[0], res.output
    assert "Traceback" not in res.output


@pytest.mark.slow
def test_the_installed_cli_refuses_stablelm_in_one_line(model_dirs, tmp_path):
    src = tmp_path / "jobs.jsonl"
    src.write_text('{"prompt": "hello there"}\n')
    res = subprocess.run([sys.executable, "-m", "batchgen", "process", str(src), "-o", str(tmp_path / "o.parquet"),
                          "--model", str(model_dirs["stablelm"]), "--max-new-tokens", "2"],
                         capture_output=True, text=True, timeout=300)
    lines = [x for x in res.stderr.splitlines() + res.stdout.splitlines() if x.strip()]
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert len(lines) == 1 and "model type 'stablelm' is not supported" in lines[0], lines


@pytest.mark.parametrize("edit", [{"n_head": 5}, {"n_embd": 60}, {"activation_function": "no_such_act"}])
def test_a_config_transformers_cannot_build_is_one_line(edit, tmp_path):
    """A listed model type whose config.json transformers' model code fails on, whatever it raises."""
    import json

    d = tmp_path / "model"
    model_from_config(hf_families.config("gpt2", 0)).save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    path = d / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    src = tmp_path / "jobs.jsonl"
    src.write_text('{"prompt": "hello there"}\n')
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(tmp_path / "out.parquet"), "--model", str(d),
                                    "--max-new-tokens", "2"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and f"model '{d}'" in lines[0] and "Traceback" not in res.output, res.output
