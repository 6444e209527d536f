"""The Python API on a real vLLM (the CPU build, `make vllm-env`): `Engine.serve` keeps one server
for the module's calls; `servers=[url]` gives the rows `batchgen process --server url` writes (a
list of dicts, a DataFrame); `engine="vllm"` starts its own server for one call, whose completions
equal vLLM's own `LLM.generate` on the same ids, and leaves no process behind; bad options and
jobs a server cannot run are one error each. Fixtures and helpers are tests/e2e/test_vllm_engine.py's.
"""
from __future__ import annotations

import logging
import os
import uuid

import pandas as pd
import pyarrow.parquet as pq
import pytest

import batchgen
from batchgen.jobs.errors import OptionError
from tests.e2e.test_vllm_engine import (MARK, NEW, SERVER_ARGS, VENV, WRAPPER, _batchgen, _common, _jobs, _none_left,
                                        _processes, _write, reference, tiny)  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (VENV / "bin" / "vllm").exists(), reason="vLLM's venv: run `make vllm-env`")]
OPTIONS = {"max_new_tokens": NEW, "logprobs": True}


@pytest.fixture(scope="module")
def served(tiny):
    """One vLLM for the module, started and kept by the API; none of its processes left after close()."""
    mark = f"api-{uuid.uuid4()}"
    os.environ[MARK] = mark
    try:
        engine = batchgen.Engine.serve(str(tiny), vllm=WRAPPER, vllm_args=SERVER_ARGS, dtype="float32")
    finally:
        del os.environ[MARK]
    assert _processes(mark)
    yield engine
    log = engine.log_path
    engine.close()
    _none_left(mark)
    assert not os.path.exists(log)  # a clean close leaves no log behind


def _cli_rows(tiny, url, tmp_path) -> list[dict]:
    jobs = _write(tmp_path / "jobs.jsonl", _jobs())
    out = tmp_path / "out.parquet"
    r = _batchgen([*_common(tiny, jobs, out), "--server", url])
    assert r.returncode == 0, r.stderr
    return pq.read_table(out).to_pylist()


def _same_rows(api: list[dict], cli: list[dict]) -> None:
    """Row for row, column for column, but cached_tokens: the server's own count, which a warm
    prefix cache raises on a later run of the same jobs."""
    assert [r["error"] for r in api] == [None] * len(api)
    assert [set(r) - {"error"} for r in api] == [set(r) for r in cli]
    # logprob values to 1e-4: vLLM's own numbers move in their last digits with the batch a request
    # shares (the two runs batch differently); the tokens and everything else are equal
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("error", "cached_tokens", "logprobs")} for r in rows]
    assert strip(api) == strip(cli)
    for a, c in zip(api, cli):
        assert [t["id"] for t in a["logprobs"]] == [t["id"] for t in c["logprobs"]]
        assert [t["token"] for t in a["logprobs"]] == [t["token"] for t in c["logprobs"]]
        assert [t["logprob"] for t in a["logprobs"]] == pytest.approx([t["logprob"] for t in c["logprobs"]], abs=1e-4)
    assert all(0 <= r["cached_tokens"] <= r["prompt_tokens"] for r in api)


def test_servers_give_the_rows_the_cli_writes_as_list_and_dataframe(tiny, served, reference, tmp_path):
    url = served.urls[0]
    cli = _cli_rows(tiny, url, tmp_path)
    rows = batchgen.generate(_jobs(), str(tiny), servers=[url], **OPTIONS)
    _same_rows(rows, cli)
    assert {r["id"]: [t["id"] for t in r["logprobs"]] for r in rows} == reference
    # the kept engine: a DataFrame in, a DataFrame out, the same rows
    df = served.generate(pd.DataFrame(_jobs()), **OPTIONS)
    assert isinstance(df, pd.DataFrame)
    assert list(df.columns) == list(rows[0])
    assert df["id"].tolist() == [r["id"] for r in cli]
    assert df["completion"].tolist() == [r["completion"] for r in cli]
    assert df["completion_tokens"].tolist() == [r["completion_tokens"] for r in cli]
    assert served.served_models == [str(tiny)]


def test_what_a_server_cannot_run_is_one_error(tiny, served):
    """An option the served route cannot honour is one OptionError naming the keyword; a job it
    cannot run is that job's error row, the others run."""
    with pytest.raises(OptionError, match="adapters= of a served engine are those it serves"):
        served.generate(_jobs()[:2], adapters={"a": "/nowhere"}, **OPTIONS)
    with pytest.raises(OptionError, match="device= means nothing to a server"):
        batchgen.generate(_jobs()[:2], str(tiny), servers=served.urls, device="cpu")
    rows = served.generate([{"id": "a", "prompt": "Hello there."}, {"id": "b", "prompt": "Hi.", "adapter": "x"}],
                           **OPTIONS)
    assert [r["id"] for r in rows] == ["a", "b"]
    assert rows[0]["error"] is None and rows[0]["completion_tokens"] > 0
    # an adapter this served engine was not given (Engine.connect(adapters=...) names them)
    assert rows[1]["error"].startswith("jobs:row 1: field 'adapter'") and "'x'" in rows[1]["error"], rows[1]


def test_engine_vllm_equals_llm_generate_and_stops_its_server(tiny, reference, caplog):
    mark = f"api-once-{uuid.uuid4()}"
    os.environ[MARK] = mark
    try:
        with caplog.at_level(logging.INFO, logger="batchgen"):
            rows = batchgen.generate(_jobs(), str(tiny), engine="vllm", vllm=WRAPPER, vllm_args=SERVER_ARGS,
                                     dtype="float32", concurrency=8, verify=3, **OPTIONS)
    finally:
        del os.environ[MARK]
    _none_left(mark, within=5.0)  # stopped when the call returned
    assert [r["id"] for r in rows] == [j["id"] for j in _jobs()]
    assert {r["id"]: [t["id"] for t in r["logprobs"]] for r in rows} == reference
    # float32 on a tiny model with wide weights: batchgen's own engine agrees token for token
    assert "verify: 3/3 greedy jobs agree token for token" in caplog.text
