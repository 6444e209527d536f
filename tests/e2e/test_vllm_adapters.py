"""LoRA adapters on a real vLLM (the CPU build, `make vllm-env`): `--server URL` and `--engine vllm`.

A mixed file: base-model jobs, jobs of two registered adapters (`--adapter NAME=PATH`) and, on
`--engine vllm`, jobs naming a third adapter's directory in their `adapter` field (the started
server is started again serving it: pipeline/run/served_adapters.py). Checked: each completion
equals vLLM's own `LLM.generate` with the matching `LoRARequest` on the same ids (greedy); the
adapters' outputs differ from the base model's (so the comparison can fail); the output's
`adapter` column; `--verify` agreeing on adapter jobs (batchgen's engine applies the same
adapters); a `--server` that does not serve an adapter is one line (exit 2, as option errors),
in `validate --server` too; a resume refuses an adapter changed in place.

One server for the module (with both registered adapters); the `--engine vllm` run starts its own.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import transformers

from tests.e2e.test_vllm_engine import (MARK, NEW, ROOT, SERVER_ARGS, VENV, WRAPPER, _batchgen, _common,
                                        _engine_args, _jobs, _none_left, _write, tiny)  # noqa: F401 (a fixture)
from tests.helpers.tiny_adapters import make_adapter
from tests.helpers.tiny_tokenizer import make_tokenizer

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (VENV / "bin" / "vllm").exists(), reason="vLLM's venv: run `make vllm-env`")]


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """Three random adapters of the tiny model: a1 (rank 8, every projection), a2 (rank 4, q and v),
    a3 (rank 16, every projection; named by directory in jobs)."""
    d = tmp_path_factory.mktemp("adapters")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    return {"a1": str(make_adapter(model, d / "a1", rank=8, seed=11)),
            "a2": str(make_adapter(model, d / "a2", rank=4, seed=12, targets=("q_proj", "v_proj"))),
            "a3": str(make_adapter(model, d / "a3", rank=16, seed=13))}


def _mixed(adapters, directory: bool) -> list[dict]:
    """The engine tests' jobs, a third of each subject on each of base, a1 and a2; the loners on
    a3's directory (`directory`), else on the base model."""
    rows = []
    for row in _jobs():
        if row["id"].startswith("alone"):
            label = adapters["a3"] if directory else None
        else:
            label = (None, "a1", "a2")[int(row["id"].rsplit("-", 1)[1]) % 3]
        rows.append({**row, **({"adapter": label} if label else {})})
    return rows


@pytest.fixture(scope="module")
def reference(tiny, adapters, tmp_path_factory):
    """vLLM's own LLM.generate, greedy, each job with its LoRARequest, and each job on the base
    model too: ({job id: ids with its adapter}, {job id: ids on the base model})."""
    d = tmp_path_factory.mktemp("reference")
    tok = make_tokenizer()
    rows = _mixed(adapters, directory=True)
    prompts = [tok(r["prompt"]).input_ids for r in rows]
    loras = [adapters.get(r.get("adapter"), r.get("adapter")) for r in rows]
    spec = {"model": str(tiny), "prompts": prompts + prompts, "loras": loras + [None] * len(rows), "max_tokens": NEW,
            "dtype": "float32", "args": {"max_model_len": 512, "enforce_eager": True, "enable_lora": True,
                                         "max_lora_rank": 16, "max_loras": 4}}
    (d / "spec.json").write_text(json.dumps(spec))
    r = subprocess.run([str(WRAPPER), "python", str(ROOT / "tests" / "helpers" / "vllm_reference.py"),
                        str(d / "spec.json"), str(d / "out.json")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ids = json.loads((d / "out.json").read_text())["token_ids"]
    return ({row["id"]: i for row, i in zip(rows, ids)}, {row["id"]: i for row, i in zip(rows, ids[len(rows):])})


@pytest.fixture(scope="module")
def server(tiny, adapters, tmp_path_factory):
    """One vLLM serving the tiny model with a1 and a2 (the flags batchgen builds for --engine vllm)."""
    from batchgen.pipeline.run.served_adapters import Module, lora_arguments
    from batchgen.pipeline.serve.vllm_server import VllmServer

    mark = f"fixture-{uuid.uuid4()}"
    os.environ[MARK] = mark
    try:
        lora = lora_arguments([Module("a1", adapters["a1"], 8), Module("a2", adapters["a2"], 4)], [])
        s = VllmServer(str(WRAPPER), str(tiny), "tiny", str(tmp_path_factory.mktemp("server") / "vllm.log"),
                       [*lora, "--dtype", "float32", *SERVER_ARGS])
        s.spawn()
        s.wait()
    finally:
        del os.environ[MARK]
    yield s
    s.stop()
    _none_left(mark)


def _rows(out: Path) -> dict[str, dict]:
    rows = pq.read_table(out).to_pylist()
    assert len({r["id"] for r in rows}) == len(rows)  # every job exactly once
    return {r["id"]: r for r in rows}


def _registered(adapters) -> list[str]:
    return ["--adapter", f"a1={adapters['a1']}", "--adapter", f"a2={adapters['a2']}"]


def _check(out: Path, rows: list[dict], reference) -> None:
    ours, base = reference
    got = _rows(out)
    expected = {r["id"]: (ours if r.get("adapter") else base)[r["id"]] for r in rows}
    assert {i: [t["id"] for t in r["logprobs"]] for i, r in got.items()} == expected
    assert {i: r["adapter"] for i, r in got.items()} == {r["id"]: r.get("adapter") for r in rows}
    on_adapters = [r["id"] for r in rows if r.get("adapter")]
    assert len(on_adapters) >= 18
    # the adapters change the output (so the comparison above can fail): most jobs differ from the base
    assert sum(ours[i] != base[i] for i in on_adapters) >= len(on_adapters) * 3 // 4


def test_server_runs_registered_adapters_as_llm_generate_does(tiny, adapters, server, reference, tmp_path):
    rows = _mixed(adapters, directory=False)
    jobs = _write(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    # every job verified (the sample is all of them): the adapter jobs' agreement is measured for sure
    r = _batchgen([*_common(tiny, jobs, out), "--server", server.url, *_registered(adapters), "--verify", 100])
    assert r.returncode == 0, r.stderr
    _check(out, rows, reference)
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    assert summary["served_adapters"] == ["a1", "a2"] or summary["served_adapters"] == ["a2", "a1"]
    v = summary["verify"]  # batchgen's own engine with the same adapters, on the sampled jobs
    assert v["jobs"] == len(rows) and v["agree"] == len(rows), v


def test_engine_vllm_serves_every_adapter_the_jobs_name(tiny, adapters, reference, tmp_path):
    """Registered names and a directory met only in the jobs: the server is started again with all three."""
    rows = _mixed(adapters, directory=True)
    jobs = _write(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    mark = str(uuid.uuid4())
    began = time.monotonic()
    r = _batchgen([*_common(tiny, jobs, out), *_engine_args(), *_registered(adapters), "--verify", 6], mark)
    print(f"--engine vllm with adapters (two starts): {time.monotonic() - began:.1f} s")
    assert r.returncode == 0, r.stderr
    _none_left(mark)
    _check(out, rows, reference)
    log = Path(f"{out}.vllm.log").read_text()
    assert f"--lora-modules a1={adapters['a1']} a2={adapters['a2']} adapter-3={adapters['a3']}" in log
    assert "--max-lora-rank 16 --max-loras 4" in log
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    assert summary["verify"]["agree"] == summary["verify"]["jobs"] == 6, summary["verify"]


def test_a_server_that_does_not_serve_an_adapter_is_one_line(tiny, adapters, server, tmp_path):
    rows = [{"id": 1, "prompt": "hello"}, {"id": 2, "prompt": "hello", "adapter": "a3"}]
    jobs = _write(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    a3 = ["--adapter", f"a3={adapters['a3']}"]
    r = _batchgen([*_common(tiny, jobs, out), "--server", server.url, *a3])
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "a3" in errors[0] and "--lora-modules a3=PATH" in errors[0], r.stderr
    assert not out.exists()
    v = subprocess.run([sys.executable, "-m", "batchgen", "validate", str(jobs), "--model", str(tiny), "--server",
                        server.url, *a3], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert v.returncode == 2 and [line for line in v.stderr.splitlines() if line.startswith("Error")] == errors, \
        v.stderr


def test_a_resume_refuses_an_adapter_changed_in_place(tiny, adapters, server, tmp_path):
    a1 = tmp_path / "a1"
    shutil.copytree(adapters["a1"], a1)
    rows = [{**r, "adapter": "a1"} for r in _jobs()[:6]]
    jobs = _write(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    args = [*_common(tiny, jobs, out), "--server", server.url, "--adapter", f"a1={a1}"]
    r = _batchgen(args, BATCHGEN_FAULT="after-commit")  # killed at its first commit
    assert r.returncode < 0, r.stderr
    config = json.loads((a1 / "adapter_config.json").read_text())
    (a1 / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": config["lora_alpha"] * 2}))
    r = _batchgen(args)
    assert r.returncode != 0 and "holds work of a run with other jobs" in r.stderr, r.stderr


def test_the_python_api_runs_a_servers_adapters(tiny, adapters, server, reference):
    """`Engine.connect(adapters=...)`: the jobs' adapters by name, as `--server --adapter`; a
    directory the server cannot be asked for, and a per-call `adapters=`, are refused."""
    import batchgen
    from batchgen.jobs.errors import OptionError

    rows = _mixed(adapters, directory=False)
    registered = {"a1": adapters["a1"], "a2": adapters["a2"]}
    with batchgen.Engine.connect(str(tiny), servers=[server.url], adapters=registered) as served:
        got = served.generate(rows, max_new_tokens=NEW, logprobs=True)
        ours, base = reference
        assert all(r["error"] is None for r in got)
        assert {r["id"]: [t["id"] for t in r["logprobs"]] for r in got} == \
            {r["id"]: (ours if r.get("adapter") else base)[r["id"]] for r in rows}
        assert [r["adapter"] for r in got] == [r.get("adapter") for r in rows]
        (refused,) = served.generate([{"id": "d", "prompt": "x", "adapter": adapters["a3"]}], max_new_tokens=2)
        assert "a running server" in refused["error"] and "register it" in refused["error"]
        with pytest.raises(OptionError, match="adapters= of a served engine are those it serves"):
            served.generate(rows[:1], adapters=registered)
    with pytest.raises(OptionError, match="adapter"):  # a name the server does not serve: before any job
        batchgen.Engine.connect(str(tiny), servers=[server.url], adapters={"a3": adapters["a3"]})
