"""A fixed few seeds of the differential fuzz (tests/engine/fuzz_engine.py), in float32: the engine
on the in-memory transformers model, on `load_model`'s model (batchgen's own decoder for the Llama
family) and on `load_model`'s transformers model (BATCHGEN_DECODER=0), each with its own random
knobs, equals plain uncached `generate` one job at a time, sample for sample, finish reasons too.

The seeds were chosen so that together they cover the edge cases listed in REQUIRED (asserted
below, so a change to the generator that loses one fails here). More seeds:
`python -m tests.engine.fuzz_engine --seeds 0:200`.
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict

import pytest

from tests.engine import fuzz_engine
from tests.engine.fuzz_cases import LLAMA_FAMILY, OTHERS, PATHS, case_of_seed, features
from tests.engine.fuzz_engine import check_case

SEEDS = [
    2856,  # qwen3: two heads sharing one key/value head
    816,  # qwen2
    325,  # llama, heads of 64
    2533,  # qwen2, 14 jobs
    1277,  # mistral with layer_types
    2047,  # mistral with layer_types whose cached generate raises: the uncached reference
    2563,  # the same, 14 jobs, prompts to 272 tokens
    1735,  # phi3
    917,  # opt, a 246-token prompt
    2472,  # gemma2: sliding window, eager attention
    1380,  # gpt_neox
    1035,  # gpt2
]
SEED = 816  # the checker's own tests
KNOBS = [f"{k}={v}" for k in ("cascade", "join", "static_decode", "native") for v in ("on", "off")] + [
    "min_shared_tokens=1", "min_shared_tokens>1", "max_batch_tokens<=64", "max_batch_tokens>64",
    "step_tokens<=16", "step_tokens>16"]
REQUIRED = {f"arch:{a}" for a in LLAMA_FAMILY} | {
    "sliding window", "gqa", "layer_types", "n > 1", "nested prefixes", "prompt == shared prefix",
    "one-token prompt", "duplicate prompt", "stop ids", "14+ jobs", "200+ token prompt",
} | {f"{code}:{knob}" for code in ("decoder", "transformers") for knob in KNOBS}  # each knob on and off on both codes


@functools.cache
def _case(seed):
    return case_of_seed(seed, "float32")


def test_the_seeds_cover_the_edge_cases():
    covered = set().union(*(features(_case(s)) for s in SEEDS))
    assert REQUIRED <= covered, sorted(REQUIRED - covered)
    assert len({f"arch:{a}" for a in OTHERS} & covered) >= 4


@pytest.mark.parametrize("seed", SEEDS)
def test_the_engine_equals_uncached_generate_on_a_fuzz_case(seed, tmp_path):
    case = _case(seed)
    result = check_case(case, tmp_path)
    assert not result.findings, "\n".join(json.dumps(asdict(f))[:1500] for f in result.findings)
    # which model code ran each path: a loader that refused, or fell back to transformers, fails here
    own = "decoder" if case.model.family in LLAMA_FAMILY else "hf-packed"
    assert result.model_code == {"hf": "hf-unpacked", "load": own, "load_nodecoder": "hf-packed"}


def test_the_checker_reports_a_reference_with_other_weights(tmp_path):
    """Noise on the reference models' weights only: every path's samples part from it."""
    case = _case(SEED)
    result = check_case(case, tmp_path, perturb_reference=0.05)
    assert all(f.kind == "tokens" for f in result.findings)
    per_path = {p: sum(f.path == p for f in result.findings) for p in PATHS}
    assert per_path == dict.fromkeys(PATHS, sum(j.n for j in case.jobs))  # every sample, on every path


def test_the_command_line_prints_findings_and_fails_on_them(monkeypatch, capsys):
    assert fuzz_engine.main(["--seeds", str(SEED)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["fatal"] == 0 and summary["counts"] == {"cases float32": 1, "uncached references": 0}

    real = fuzz_engine.check_case
    monkeypatch.setattr(fuzz_engine, "check_case",
                        lambda case, workdir, **kw: real(case, workdir, perturb_reference=0.05, **kw))
    assert fuzz_engine.main(["--seeds", str(SEED)]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert lines[-1]["fatal"] == lines[-1]["counts"]["tokens"] == len(lines) - 1 > 0
