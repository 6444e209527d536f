"""The Python API's served options, checked before any server work: each bad one is one
OptionError naming the keyword (never the CLI's flag), nothing dropped; a vLLM that cannot start
is one BatchgenError and leaves no process; the prefix order a served call sends its requests in.
The real-vLLM runs are in test_api_served.py."""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest

import batchgen
from batchgen.jobs.errors import BatchgenError, OptionError
from batchgen.pipeline.engine.types import Request, SamplingParams
from batchgen.pipeline.run.executors import groups_to_servers
from batchgen.pipeline.run.inmemory import Loaded, in_prefix_order
from batchgen.pipeline.text.tokenize import Tokenizer
from tests.helpers.tiny_tokenizer import make_tokenizer

JOBS = [{"id": 1, "prompt": "hello"}]


@pytest.mark.parametrize("options, named", [
    ({"engine": "ray"}, "engine='ray'"),
    ({"engine": "vllm", "device": "cpu"}, "device= means nothing to a server"),
    ({"engine": "vllm", "threads": 2}, "threads= means nothing to a server"),
    ({"servers": ["http://127.0.0.1:9"], "device": "cpu"}, "device="),
    ({"servers": ["http://127.0.0.1:9"], "dtype": "float32"}, "dtype= is the precision of a server batchgen starts"),
    ({"servers": ["http://127.0.0.1:9"], "engine": "vllm"}, "servers= uses running servers, engine='vllm'"),
    ({"servers": ["http://127.0.0.1:9"], "vllm_args": ["--enforce-eager"]}, "vllm_args= is an option of the vLLM"),
    ({"servers": []}, "servers=[]: must be a list of server URLs"),
    ({"verify": 2}, "verify= is an option of served runs"),
    ({"vllm_args": ["--enforce-eager"]}, "vllm_args= is an option of served runs"),
    ({"concurrency": 4}, "concurrency= is an option of served runs"),
    ({"engine": "vllm", "concurrency": 0}, "concurrency=0: must be a whole number of requests, 1 or more"),
    ({"engine": "vllm", "concurrency": 2.5}, "concurrency=2.5: must be a whole number"),
    ({"engine": "vllm", "retry_seconds": -1}, "retry_seconds=-1: must be a number of seconds, 0 or more"),
    ({"engine": "vllm", "dtype": "float8"}, "dtype='float8': must be one of auto"),
    ({"engine": "vllm", "vllm_args": [3]}, "vllm_args=[3]: must be a list"),
    ({"engine": "vllm", "verify": -1}, "verify=-1: must be a whole number"),
    ({"engine": "vllm", "adapters": ["a"]}, "adapters= must be a dict"),
])
def test_a_bad_served_option_is_one_option_error_named_as_a_keyword(model_dir, options, named):
    with pytest.raises(OptionError) as info:
        batchgen.generate(JOBS, str(model_dir), **options)
    assert named in str(info.value)
    for flag in ("--engine", "--server", "--device", "--threads", "--dtype", "--verify", "--vllm", "--concurrency"):
        assert flag not in str(info.value)  # the keyword, never the CLI's flag


def test_a_bad_output_fails_before_a_server_starts(model_dir, tmp_path):
    (tmp_path / "out.parquet").write_text("taken")
    with pytest.raises(BatchgenError, match="pass overwrite=True to replace it"):
        batchgen.generate(JOBS, str(model_dir), engine="vllm", vllm="/nonexistent/vllm",
                          output=str(tmp_path / "out.parquet"))


def test_a_vllm_that_does_not_start_is_one_error_and_leaves_nothing(model_dir, tmp_path):
    """A real executable that exits at once: the start fails with the log's end, the watchdog is gone."""
    fake = tmp_path / "vllm"
    fake.write_text("#!/bin/sh\necho 'no GPU here' >&2\nexit 3\n")
    fake.chmod(0o755)
    before = _children()
    with pytest.raises(BatchgenError, match=r"(?s)vLLM did not start \(it exited with code 3\).*no GPU here") as info:
        batchgen.generate(JOBS, str(model_dir), engine="vllm", vllm=str(fake))
    assert _children() == before
    log = str(info.value).split("; log ", 1)[1].split(" ends:", 1)[0]
    assert os.path.isfile(log)  # a failed start keeps its log, which the message names
    shutil.rmtree(os.path.dirname(log))


def test_a_vllm_that_is_not_there_is_one_error_and_leaves_nothing(model_dir):
    import glob
    import tempfile

    pattern = os.path.join(tempfile.gettempdir(), "batchgen-vllm-*")
    before = set(glob.glob(pattern))
    with pytest.raises(BatchgenError, match="vLLM executable '/nonexistent/vllm' not found"):
        batchgen.generate(JOBS, str(model_dir), engine="vllm", vllm="/nonexistent/vllm")
    assert set(glob.glob(pattern)) == before


def test_a_server_that_stays_unreachable_is_one_error(model_dir):
    with pytest.raises(BatchgenError, match="127.0.0.1:9: cannot list its models"):
        batchgen.generate(JOBS, str(model_dir), servers=["http://127.0.0.1:9"], retry_seconds=0)


def _children() -> set[int]:
    """This process's living children (the watchdog a start spawns)."""
    me = str(os.getpid())
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            found.add(int(pid))
    return found


def test_requests_go_out_in_prefix_order_whole_groups_to_one_server():
    """Jobs of three shared headers, shuffled in input order (one with n=2, one scoring job of two
    requests): each job's requests together, jobs in sorted token order (the reference: Python's
    sort of the prompts), and with two servers each header's jobs all on one."""
    hf = make_tokenizer()
    tok = Tokenizer(hf)
    rng = random.Random(5)
    prompts = [f"Header {h} " * 12 + f"question {q}" for h in "abc" for q in range(6)]
    rng.shuffle(prompts)
    requests = []
    for order, text in enumerate(prompts):
        ids = hf(text).input_ids
        if order == 3:  # a scoring job: two requests, keyed (order, i), sharing its prompt
            requests += [Request((order, i), ids + [40 + i], SamplingParams(max_new_tokens=0), score_from=len(ids))
                         for i in range(2)]
        else:
            requests.append(Request(order, ids, SamplingParams(max_new_tokens=4, n=2 if order == 5 else 1)))
    loaded = Loaded({}, {}, list(reversed(requests)), {}, None, tok)
    sent, index, orders = in_prefix_order(loaded)
    assert sorted(map(id, sent)) == sorted(map(id, requests))  # every request once
    jobs_sent = [r.key[0] if isinstance(r.key, tuple) else r.key for r in sent]
    firsts = list(dict.fromkeys(jobs_sent))
    assert jobs_sent == [o for o in firsts for _ in range(jobs_sent.count(o))]  # a job's requests together
    assert [prompts[o] for o in firsts] == sorted(prompts, key=lambda p: hf(p).input_ids)
    server_of = groups_to_servers(index, orders, 2, 8)
    for h in "abc":
        assert len({server_of(o) for o, p in enumerate(prompts) if p.startswith(f"Header {h}")}) == 1
    assert len({server_of(o) for o in range(len(prompts))}) == 2
    assert list(orders) == sorted(range(len(prompts)))
    assert isinstance(orders, np.ndarray)


def test_the_cli_on_a_server_unreachable_from_the_start_exits_75(model_dir, tmp_path):
    """The model-name discovery both faces share (served.connect): the CLI still stops resumable."""
    import subprocess
    import sys

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": 1, "prompt": "hello"}\n')
    r = subprocess.run([sys.executable, "-m", "batchgen", "process", str(jobs), "-o", str(tmp_path / "out.parquet"),
                        "--model", str(model_dir), "--server", "http://127.0.0.1:9", "--retry-seconds", "0"],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 75, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "127.0.0.1:9: cannot list its models" in last and "nothing was generated; rerun the same command" in last
