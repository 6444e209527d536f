"""The cores this process may run on, without importing torch: torch's threads
(`kernels.set_threads`) and the worker processes of `validate` and `plan` (pipeline/run/workers.py)
are both sized by it."""
from __future__ import annotations

import math
import os


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
