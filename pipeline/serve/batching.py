"""How big the batches of a `vllm serve` that batchgen starts are: vLLM's offline defaults.

vLLM picks its scheduler's batch limits by who starts it (`EngineArgs.get_batch_defaults`): its
offline `LLM` class gets throughput limits, `vllm serve` smaller, latency-minded ones. On the CPU
backend `vllm serve` runs 128 sequences and 2,048 tokens a step where `LLM.generate` runs 256 and
4,096; on a GPU under 70 GiB, 2,048 tokens against 8,192; on an H100, 8,192 against 16,384. A batch
job is `LLM.generate`'s workload, so batchgen starts the server with `LLM`'s limits, as vLLM 0.32
sets them (the table below), unless the user's `--vllm-arg` sets them. They are read from the
device without touching it: `nvidia-smi` for a GPU (no CUDA context is made in batchgen's process,
which would take GPU memory from the server). A machine whose accelerator batchgen cannot name (a
GPU that nvidia-smi does not list: ROCm, TPU, XPU) keeps vLLM's own choice.

The requests batchgen keeps in flight follow (`in_flight`): twice the server's sequences, so the
server's waiting queue refills a finished sequence's place at once while the requests still go in
prefix order.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Sequence

GIB = 1 << 30
SERVER_DEFAULT_SEQS = 256  # vLLM's server default on a GPU, for `in_flight` when batchgen sets nothing
SERVERS_IN_FLIGHT = 256  # per running server (`--server`), whose batch limits batchgen does not know


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda", "cpu", or "unknown"
    name: str = ""
    memory: int = 0  # bytes


def offline_limits(device: Device, world_size: int = 1) -> tuple[int, int] | None:
    """(max_num_batched_tokens, max_num_seqs) of vLLM 0.32's `LLM` class on `device`, or None."""
    if device.kind == "cpu":
        return 4096 * world_size, 256 * world_size
    if device.kind != "cuda":
        return None
    if device.memory >= 70 * GIB and ("a100" not in device.name.lower() or device.memory >= 160 * GIB):
        return 16384, 1024
    return 8192, 256


def _flag(args: Sequence[str], *names: str) -> str | None:
    """The value `args` give one of the flags `names` (`--x V` or `--x=V`), else None."""
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
    return None


def given(args: Sequence[str], flag: str) -> bool:
    """Whether `args` give `flag` (`--x`, `--x V` or `--x=V`): the user's flag wins over batchgen's."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def world_size(args: Sequence[str]) -> int:
    sizes = [_flag(args, "--tensor-parallel-size", "-tp"), _flag(args, "--pipeline-parallel-size", "-pp")]
    n = 1
    for s in sizes:
        n *= int(s) if s and s.isdigit() else 1
    return n


def batch_args(args: Sequence[str], device: Device) -> list[str]:
    """The flags that give the server `LLM`'s batch limits: none the user's `args` set already."""
    limits = offline_limits(device, world_size(args))
    if limits is None:
        return []
    tokens, seqs = limits
    out: list[str] = []
    if _flag(args, "--max-num-batched-tokens") is None:
        out += ["--max-num-batched-tokens", str(tokens)]
    if _flag(args, "--max-num-seqs") is None:
        out += ["--max-num-seqs", str(seqs)]
    return out


def in_flight(args: Sequence[str]) -> int:
    """Requests to keep in flight on a started server whose whole command line is `args`."""
    seqs = _flag(args, "--max-num-seqs")
    return 2 * (int(seqs) if seqs and seqs.isdigit() else SERVER_DEFAULT_SEQS)


def detect(env: dict[str, str] | None = None) -> Device:
    """The device a vLLM started from this process would compute on (its first visible GPU)."""
    env = os.environ if env is None else env
    smi = shutil.which("nvidia-smi")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if smi is not None and visible != "":
        first = (visible or "0").split(",")[0].strip()
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits", "-i", first],
                                 capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return Device("unknown")
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        name, _, mib = line.rpartition(",")
        if mib.strip().isdigit():
            return Device("cuda", name.strip(), int(mib.strip()) << 20)
        return Device("unknown")
    if any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/kfd", "/dev/accel")) \
            and visible != "":
        return Device("unknown")  # an accelerator batchgen cannot size: vLLM's own defaults
    return Device("cpu")
