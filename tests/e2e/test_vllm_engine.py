"""batchgen on a real vLLM (the CPU build, `make vllm-env`): `--server URL` and `--engine vllm`.

One server for the module (started with batchgen's own VllmServer) runs a tiny random Llama; the
`--engine vllm` runs start their own. Checked: completions equal vLLM's own `LLM.generate` on the
same token ids; resume after SIGKILL of batchgen and after SIGKILL of the server; SIGTERM exits 75;
a server answering 500 then recovering; one that stays down (exit 75, resumable); a 400 on one
request becomes that job's error row; `--verify`; and no server process left after any of these
(every process of a run carries a marker in its environment, found in /proc).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import transformers

from tests.helpers.tiny_models import model_from_config
from tests.helpers.tiny_tokenizer import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "bench" / "vllm_cpu_serve.sh"
VENV = Path(os.environ.get("BATCHGEN_VLLM_VENV", ROOT / ".venv-vllm"))
MARK = "BATCHGEN_TEST_VLLM_MARK"
MAX_MODEL_LEN = 512  # the server's; the model's own window is 1024, so batchgen lets longer prompts through
# eager: no torch.compile at each start (1-2 min cold on 2 cores); the tiny model gains nothing from it
SERVER_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--max-num-seqs", "32"]
NEW = 12

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (VENV / "bin" / "vllm").exists(), reason="vLLM's venv: run `make vllm-env`")]


def _processes(mark: str) -> list[int]:
    """Processes whose environment carries `mark` (a run's server, its engine processes, its watchdog)."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _none_left(mark: str, within: float = 30.0) -> None:
    end = time.monotonic() + within
    while _processes(mark) and time.monotonic() < end:
        time.sleep(0.25)
    left = _processes(mark)
    cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for p in left
                if Path(f"/proc/{p}/cmdline").exists()]
    assert not left, f"server processes left running: {cmdlines}"


def _jobs() -> list[dict]:
    """Three subjects whose headers span more than two of vLLM's 128-token CPU blocks, and a few loners."""
    rows = []
    for s, subject in enumerate(["astronomy", "botany", "chemistry"]):
        header = f"The following are questions about {subject}. " * 7
        for q in range(10):
            rows.append({"id": f"{subject}-{q}", "prompt": f"{header}Question {q}: what is {q * 7 + s}? Answer:"})
    rows += [{"id": f"alone-{i}", "prompt": f"Tell me about the number {i}."} for i in range(4)]
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (heads of 64: a size vLLM's CPU attention takes) with its tokenizer. Its
    vocabulary is the tokenizer's: vLLM names every logprob's token, and an id the tokenizer lacks
    crashes its server (0.32: `convert_ids_list_to_tokens` on None)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    tok = make_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model_from_config(config, seed=3).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    """One vLLM server for the module's --server runs (batchgen's own launcher, so it is one test of it)."""
    from batchgen.pipeline.serve.vllm_server import VllmServer

    mark = f"fixture-{uuid.uuid4()}"
    log = tmp_path_factory.mktemp("server") / "vllm.log"
    os.environ[MARK] = mark
    try:
        s = VllmServer(str(WRAPPER), str(tiny), "tiny", str(log), ["--dtype", "float32", *SERVER_ARGS])
        began = time.monotonic()
        s.spawn()
        s.wait()
    finally:
        del os.environ[MARK]
    print(f"vLLM server started in {time.monotonic() - began:.1f} s")
    yield s
    s.stop()
    _none_left(mark)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """vLLM's own LLM.generate, greedy, on the same token ids, in its venv: {job id: token ids}."""
    d = tmp_path_factory.mktemp("reference")
    tok = make_tokenizer()
    jobs = _jobs()
    spec = {"model": str(tiny), "prompts": [tok(j["prompt"]).input_ids for j in jobs], "max_tokens": NEW,
            "dtype": "float32", "args": {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True}}
    (d / "spec.json").write_text(json.dumps(spec))
    subprocess.run([str(WRAPPER), "python", str(ROOT / "tests" / "helpers" / "vllm_reference.py"),
                    str(d / "spec.json"), str(d / "out.json")], check=True, capture_output=True, timeout=600)
    out = json.loads((d / "out.json").read_text())
    return {j["id"]: ids for j, ids in zip(jobs, out["token_ids"])}


def _batchgen(args, mark: str | None = None, wait: bool = True, **env) -> subprocess.CompletedProcess | subprocess.Popen:
    e = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    if mark:
        e[MARK] = mark
    cmd = [sys.executable, "-m", "batchgen", "process", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=600)


def _common(tiny, jobs_file, out):
    return [jobs_file, "-o", out, "--model", tiny, "--dtype", "float32", "--max-new-tokens", NEW, "--logprobs",
            "--commit-every", 1]


def _engine_args():
    return ["--engine", "vllm", "--vllm", WRAPPER, *(f"--vllm-arg={a}" for a in SERVER_ARGS)]


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ids(out: Path) -> dict[str, list[int]]:
    rows = pq.read_table(out).to_pylist()
    assert len({r["id"] for r in rows}) == len(rows)  # every job exactly once
    return {r["id"]: [t["id"] for t in r["logprobs"]] for r in rows}


def _last(stderr: str) -> str:
    """The one line a stopped run ends with (progress lines come before it)."""
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("batchgen: ") and all(l.startswith("batchgen: ") for l in lines), stderr
    return lines[-1]


def _parts(out: Path) -> int:
    d = Path(str(out) + ".parts")
    return len(list(d.glob("part-*"))) if d.is_dir() else 0


def test_served_completions_equal_llm_generate(tiny, server, reference, tmp_path):
    jobs = _write(tmp_path / "jobs.jsonl", _jobs())
    out = tmp_path / "out.parquet"
    r = _batchgen([*_common(tiny, jobs, out), "--server", server.url])
    assert r.returncode == 0, r.stderr
    assert _ids(out) == reference
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    assert summary["engine"] == "server" and summary["served_models"] == ["tiny"]
    # the server's own count: each subject's header is prefilled once, its other jobs reuse whole blocks
    assert summary["cached_tokens"] >= 27 * 128, summary["cached_tokens"]
    assert summary["prefill_tokens"] == summary["prompt_tokens"] - summary["cached_tokens"]
    rows = pq.read_table(out).to_pylist()
    tok = make_tokenizer()
    for row in rows[:5]:  # text through batchgen's own detokenizer, as on its own engine
        ids = [t["id"] for t in row["logprobs"]]
        assert row["completion"] == tok.decode(ids[: ids.index(2)] if 2 in ids else ids, skip_special_tokens=True)
    # greedy n = 2, which vLLM refuses as a request ("n must be 1 when using greedy sampling"): each
    # sample is the one greedy continuation
    first = _jobs()[0]
    twice = tmp_path / "twice.parquet"
    r = _batchgen([*_common(tiny, _write(tmp_path / "twice.jsonl", [{**first, "n": 2}]), twice), "--server", server.url])
    assert r.returncode == 0, r.stderr
    samples = pq.read_table(twice).to_pylist()
    assert [s["sample_index"] for s in samples] == [0, 1] and not any(s.get("error") for s in samples)
    assert all([t["id"] for t in s["logprobs"]] == reference[first["id"]] for s in samples)


def test_engine_vllm_killed_stopped_and_its_server_killed_then_resumed(tiny, server, reference, tmp_path):
    """--engine vllm: SIGKILL of batchgen, SIGTERM, SIGKILL of the server; each time no server is
    left; then the rest on the module's server: every job exactly once, equal to LLM.generate."""
    jobs = _write(tmp_path / "jobs.jsonl", _jobs())
    out = tmp_path / "out.parquet"
    args = [*_common(tiny, jobs, out), *_engine_args()]

    mark = str(uuid.uuid4())  # 1: batchgen SIGKILLed at its first commit
    began = time.monotonic()
    r = _batchgen(args, mark, BATCHGEN_FAULT="after-commit")
    print(f"--engine vllm run until its first commit: {time.monotonic() - began:.1f} s")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert _parts(out) >= 1
    _none_left(mark)
    assert Path(f"{out}.vllm.log").stat().st_size > 0

    mark = str(uuid.uuid4())  # 2: SIGTERM mid-run: exit 75, finished jobs committed
    p = _batchgen([*args, "--concurrency", 1], mark, wait=False)
    before = _parts(out)
    while _parts(out) <= before and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err
    assert "rerun the same command" in _last(err), err
    _none_left(mark)

    mark = str(uuid.uuid4())  # 3: the server SIGKILLed mid-run: exit 75 at once, its log quoted
    p = _batchgen([*args, "--concurrency", 1], mark, wait=False)
    before = _parts(out)
    while _parts(out) <= before and p.poll() is None:
        time.sleep(0.05)
    cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in _processes(mark)}
    api = [pid for pid, cmd in cmdlines.items() if b"/vllm serve " in cmd and b"watchdog.py" not in cmd]
    assert api, "the vLLM server was not found"
    for pid in api:
        os.kill(pid, signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err
    assert "the vLLM server exited" in _last(err) and "rerun the same command" in _last(err), err
    _none_left(mark)

    # 4: the rest, resumed on another server of the same model
    r = _batchgen([*_common(tiny, jobs, out), "--server", server.url])
    assert r.returncode == 0, r.stderr
    assert _ids(out) == reference
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    assert summary["resumed_jobs"] >= 3


class _Proxy:
    """A local HTTP proxy in front of the real server: the first `fail` POSTs answer `status`."""

    def __init__(self, target: str, fail: int, status: int = 500) -> None:
        proxy = self
        self.failed = 0
        self.prompts: list[list[int]] = []  # every completions request's prompt

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _relay(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if method == "POST":
                    proxy.prompts.append(json.loads(body)["prompt"])
                if method == "POST" and proxy.failed < fail:
                    proxy.failed += 1
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    payload = json.dumps({"error": {"message": "overloaded"}}).encode()
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                r = httpx.request(method, target + self.path, content=body or None,
                                  headers={"Content-Type": "application/json"}, timeout=300)
                self.send_response(r.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def do_POST(self):
                self._relay("POST")

            def do_GET(self):
                self._relay("GET")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_server_answering_500_then_recovering(tiny, server, reference, tmp_path):
    jobs = _write(tmp_path / "jobs.jsonl", _jobs())
    out = tmp_path / "out.parquet"
    proxy = _Proxy(server.url, fail=5)
    try:
        r = _batchgen([*_common(tiny, jobs, out), "--server", proxy.url, "--concurrency", 2])
    finally:
        proxy.close()
    assert r.returncode == 0, r.stderr
    assert proxy.failed == 5
    assert _ids(out) == reference


def test_several_servers_get_whole_prefix_groups(tiny, server, reference, tmp_path):
    """Two servers (two proxies in front of the module's one): each subject's jobs all go to one."""
    jobs = _write(tmp_path / "jobs.jsonl", _jobs())
    out = tmp_path / "out.parquet"
    proxies = [_Proxy(server.url, fail=0), _Proxy(server.url, fail=0)]
    try:
        r = _batchgen([*_common(tiny, jobs, out), "--server", proxies[0].url, "--server", proxies[1].url])
    finally:
        for p in proxies:
            p.close()
    assert r.returncode == 0, r.stderr
    assert _ids(out) == reference
    tok = make_tokenizer()
    for subject in ("astronomy", "botany", "chemistry"):
        header = tok(f"The following are questions about {subject}. " * 7).input_ids[:-3]
        counts = [sum(p[: len(header)] == header for p in proxy.prompts) for proxy in proxies]
        assert sorted(counts) == [0, 10], (subject, counts)
    assert all(proxy.prompts for proxy in proxies)


def test_a_server_that_stays_down_ends_the_run_resumable(tiny, server, reference, tmp_path):
    jobs = _write(tmp_path / "jobs.jsonl", _jobs())
    out = tmp_path / "out.parquet"
    proxy = _Proxy(server.url, fail=10_000, status=503)
    try:
        r = _batchgen([*_common(tiny, jobs, out), "--server", proxy.url, "--retry-seconds", 2])
    finally:
        proxy.close()
    assert r.returncode == 75, r.stderr
    assert "unreachable" in _last(r.stderr) and "HTTP 503" in _last(r.stderr), r.stderr
    r = _batchgen([*_common(tiny, jobs, out), "--server", server.url])  # the same command, a server back
    assert r.returncode == 0, r.stderr
    assert _ids(out) == reference


def test_a_400_fails_that_job_alone(tiny, server, tmp_path):
    """A prompt longer than the server's --max-model-len (but within the model's window, which is
    what batchgen checks): the server refuses it, that job becomes its located error row."""
    rows = _jobs()[:6] + [{"id": "too-long", "prompt": "x" * (MAX_MODEL_LEN + 50)}]
    jobs = _write(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    r = _batchgen([*_common(tiny, jobs, out), "--server", server.url])
    assert r.returncode == 0, r.stderr
    assert sorted(x["id"] for x in pq.read_table(out).to_pylist()) == sorted(x["id"] for x in rows[:6])
    errors = pq.read_table(f"{out}.errors.parquet").to_pylist()
    assert [e["id"] for e in errors] == ["too-long"]
    assert errors[0]["location"].endswith(":7") and "the server answered 400" in errors[0]["reason"], errors


def test_verify_compares_with_batchgens_own_engine(tiny, server, tmp_path):
    jobs = _write(tmp_path / "jobs.jsonl", _jobs())
    out = tmp_path / "out.parquet"
    r = _batchgen([*_common(tiny, jobs, out), "--server", server.url, "--verify", 6])
    assert r.returncode == 0, r.stderr
    v = json.loads(Path(f"{out}.summary.json").read_text())["verify"]
    assert v["jobs"] == 6 and v["agree"] + len(v["differ"]) == 6
    # float32 on a tiny model with wide weights: no near-ties; the two engines agree token for token
    assert v["agree"] == 6, v


def test_validate_refuses_what_a_server_cannot_run(tiny, tmp_path):
    jobs = _write(tmp_path / "jobs.jsonl", [{"id": 1, "prompt": "hi"}, {"id": 2, "prompt": "hi", "adapter": "x"}])
    r = subprocess.run([sys.executable, "-m", "batchgen", "validate", str(jobs), "--model", str(tiny), "--engine",
                        "vllm"], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    # (adapters run on servers now: tests/e2e/test_vllm_adapters.py; an unknown one is still a row error)
    assert "jobs.jsonl:2" in r.stdout + r.stderr and "field 'adapter': 'x' is neither" in r.stdout + r.stderr
