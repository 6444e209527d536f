"""`vllm serve MODEL` started by batchgen for one run (`--engine vllm`), and stopped with it.

vLLM cannot share batchgen's virtualenv (its transformers and llguidance pins exclude batchgen's),
so it runs as the user's own install: `--vllm PATH`, else `BATCHGEN_VLLM`, else `vllm` on PATH.
It listens on a free loopback port with prefix caching on, per-request cached-token counts
(`--enable-prompt-tokens-details`) and the batch limits of vLLM's offline `LLM` (batching.py); its log goes to a side file next to the output, whose last
lines a failure quotes.

It never outlives batchgen: it runs under watchdog.py, which holds the read end of a pipe that
only batchgen writes to and stops the server's whole process group when the pipe closes, and the
watchdog itself gets SIGTERM when batchgen dies (PR_SET_PDEATHSIG). A normal stop closes the pipe
and waits for the watchdog.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from typing import Callable, Sequence

from batchgen.jobs.errors import BatchgenError
from batchgen.pipeline.serve.batching import batch_args, detect
from batchgen.pipeline.serve.client import health

START_SECONDS = 900.0  # a first start compiles the model (1-2 min on a CPU), a big model loads for minutes
_PR_SET_PDEATHSIG = 1


class ServerStartError(BatchgenError):
    """vLLM could not be started, or exited before it was healthy."""


def vllm_executable(given: str | None) -> str:
    """The vllm command: `--vllm PATH`, else BATCHGEN_VLLM, else `vllm` on PATH."""
    name = given or os.environ.get("BATCHGEN_VLLM") or "vllm"
    found = shutil.which(name) if os.sep not in name else (name if os.access(name, os.X_OK) else None)
    if found is None:
        raise ServerStartError(f"vLLM executable {name!r} not found or not executable; install vLLM in a "
                               "virtualenv of its own and pass --vllm /path/to/venv/bin/vllm (or set BATCHGEN_VLLM)")
    return os.path.abspath(found)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, lines)).rstrip()
    except OSError:
        return ""


def _die_with_parent() -> None:
    # in the watchdog, before exec: SIGTERM when batchgen's thread ends (SIGKILL included), which it
    # answers by stopping the server's group (a SIGKILL would leave the group running)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the pipe alone stops it
        pass


class VllmServer:
    """`with VllmServer(...) as server:` `spawn()`, then `wait()`: a healthy vLLM at `server.url`;
    it stops when the block ends, however it ends."""

    def __init__(self, executable: str, model: str, served_name: str, log_path: str,
                 args: Sequence[str] = (), lora_modules: Sequence[str] = (), seed: int = 0) -> None:
        self.executable, self.model, self.served_name, self.log_path = executable, model, served_name, log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [executable, "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
                        "--served-model-name", served_name, "--enable-prefix-caching",
                        "--enable-prompt-tokens-details", "--seed", str(seed), "--disable-uvicorn-access-log",
                        "--max-logprobs", "20"]
        if lora_modules:
            self.command += ["--enable-lora", "--lora-modules", *lora_modules]
        self.command += batch_args(args, detect()) + list(args)
        self.process: subprocess.Popen | None = None
        self.started_seconds: float | None = None
        self.began = 0.0

    def spawn(self) -> None:
        """Start the server (it loads while batchgen reads the jobs); `wait` for it to be healthy."""
        self.began = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"batchgen: {' '.join(self.command)}\n".encode())
        env = dict(os.environ, VLLM_NO_USAGE_STATS=os.environ.get("VLLM_NO_USAGE_STATS", "1"))
        watchdog = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py")
        self.process = subprocess.Popen([sys.executable, "-S", watchdog, self.log_path, *self.command],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=env, preexec_fn=_die_with_parent, close_fds=True)

    def wait(self, should_stop: Callable[[], bool] = lambda: False, timeout: float = START_SECONDS) -> None:
        """Until the server answers its health check (or `should_stop()`); raise ServerStartError
        with the log's end when it exits first or takes longer than `timeout`."""
        while not health(self.url, timeout=2.0):
            if self.down() is not None:
                raise ServerStartError(f"vLLM did not start (it exited with code {self.process.returncode}); "
                                       f"log {self.log_path} ends:\n{tail(self.log_path)}")
            if should_stop():
                return
            if time.monotonic() - self.began > timeout:
                raise ServerStartError(f"vLLM was not healthy after {timeout:.0f} s; log {self.log_path} ends:\n"
                                       f"{tail(self.log_path)}")
            time.sleep(0.25)
        self.started_seconds = round(time.monotonic() - self.began, 3)

    def down(self) -> str | None:
        """Why the server is not running (it exited), or None while it runs."""
        if self.process is None:
            return "not started"
        code = self.process.poll()
        if code is None:
            return None
        return f"the vLLM server exited with code {code}; its log {self.log_path} ends: " \
               f"{' | '.join(tail(self.log_path, 3).splitlines())}"

    def stop(self) -> None:
        """Stop the server and its engine processes, and wait for them (the watchdog does it)."""
        p, self.process = self.process, None
        if p is None:
            return
        try:
            p.stdin.close()  # the watchdog stops the server's process group
        except OSError:
            pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
