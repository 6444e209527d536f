"""CPU kernel choices, measured on the project machine (2-core AMD EPYC, AVX-512 BF16):

- Threads: torch's default is the host's core count, and under foreign load oversubscription
  made runs up to 9x slower. batchgen uses the cores this process may actually run on: its CPU
  affinity, capped by a cgroup CPU quota (containers, SLURM, Kubernetes).
- Freed memory stays with the process: glibc serves allocations above 128 KiB-32 MiB with mmap
  and returns them on free, so every forward's activations (12 MB for a 2048-token MLP) were
  fresh pages, faulted in and zeroed by the kernel: a 2048-token SiLU*mul took 9.0 ms instead
  of 1.9, rotary embeddings 6.1 instead of 2.2. With glibc's mmap and trim thresholds raised,
  the same memory is reused forward after forward (as jemalloc/tcmalloc would).
- float32 linear layers: torch 2.13 sends float32 `F.linear` to MKL's sgemm, which on this AMD
  CPU ran 20-50% slower than oneDNN's kernel on the same weights (bfloat16 already goes to
  oneDNN). For batchgen's own forwards only, the model's `nn.Linear` layers call oneDNN, where
  a one-time probe finds it present and in agreement with `F.linear`.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F


def available_cpus() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup v2/v1 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else max(1, cpus)


def _cgroup_quota(root: str = "/sys/fs/cgroup") -> float | None:
    try:
        with open(f"{root}/cpu.max") as f:  # v2: "max 100000" or "200000 100000"
            limit, period = f.read().split()[:2]
            return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(f"{root}/cpu/cpu.cfs_quota_us") as q, open(f"{root}/cpu/cpu.cfs_period_us") as p:
            limit, period = int(q.read()), int(p.read())
            return None if limit <= 0 else limit / period
    except (OSError, ValueError):
        return None


def set_threads(threads: int | None = None) -> int:
    """Use `threads` intra-op threads, else one per available core (unless OMP_NUM_THREADS says)."""
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(env) if env.isdigit() and int(env) > 0 else available_cpus()
    torch.set_num_threads(threads)
    return threads


_MALLOC_TUNED = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (1 GiB) for this process; False where that is not glibc."""
    global _MALLOC_TUNED
    if not _MALLOC_TUNED:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
            _MALLOC_TUNED = bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30))
        except (OSError, AttributeError):
            _MALLOC_TUNED = False
    return _MALLOC_TUNED


def _onednn_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


_ONEDNN_OK: bool | None = None


def onednn_ok() -> bool:
    global _ONEDNN_OK
    if _ONEDNN_OK is None:
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = torch.randn(37, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
            lin = torch.nn.Linear(96, 80)
            lin.weight.data, lin.bias.data = w, b
            _ONEDNN_OK = bool(torch.allclose(_onednn_linear(lin, x[None])[0], F.linear(x, w, b), atol=1e-4))
        except (RuntimeError, AttributeError, NotImplementedError):
            _ONEDNN_OK = False
    return _ONEDNN_OK


def fast_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's linear layers that should call oneDNN in batchgen's forwards (none off CPU or
    off float32, or where the probe failed)."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32 or not onednn_ok():
        return []
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@contextmanager
def linears_on_onednn(layers: list[torch.nn.Linear]) -> Iterator[None]:
    """For one forward: the layers' `forward` calls oneDNN (an instance attribute over the class's)."""
    for m in layers:
        m.forward = _onednn_linear.__get__(m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward
