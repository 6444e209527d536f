"""`batchgen` exactly as its console script runs, with the engine's forwards timed, for
`bench_engine`'s start-up / engine / finish columns.

usage: python -m bench.timed_batchgen TIMES.json process JOBS ... (the `batchgen` arguments)

The phases are those of BENCHMARKS.md's "Start-up and finish" section. *Start-up*: exec to the start
of the first forward (jobs read, checked and tokenized, model loaded); *engine*: the first
forward's start to the last forward's end; *finish*: from there to the process's exit as its parent
sees it. This process writes the two forward times (`time.monotonic()`, which on Linux is
CLOCK_MONOTONIC, one clock for every process of the machine) to TIMES.json as it exits; the parent
holds the other two.

`Engine.forward` is wrapped when `batchgen.pipeline.engine.engine` is first imported, by a one-shot import
hook, so this wrapper imports nothing (torch included) before batchgen itself would, and a start
that overlaps its imports with reading the jobs is timed as it runs.
"""
from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import json
import sys
import time

ENGINE_MODULE = "batchgen.pipeline.engine.engine"


class _Times:
    def __init__(self, path: str) -> None:
        self.path = path
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.forwards = 0

    def wrap(self, forward):
        @functools.wraps(forward)
        def timed(*args, **kwargs):
            if self.first_start is None:
                self.first_start = time.monotonic()
            try:
                return forward(*args, **kwargs)  # the logits of a CPU forward are computed on return
            finally:
                self.last_end = time.monotonic()
                self.forwards += 1

        return timed

    def write(self) -> None:
        with open(self.path, "w") as f:
            json.dump({"first_forward_start": self.first_start, "last_forward_end": self.last_end,
                       "forwards": self.forwards}, f)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the engine module's import it lets the normal finders find it, then
    wraps `Engine.forward` once the module has run, and takes itself off `sys.meta_path`."""

    def __init__(self, times: _Times) -> None:
        self.times = times

    def find_spec(self, name, path=None, target=None):
        if name != ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            module.Engine.forward = self.times.wrap(module.Engine.forward)

        spec.loader.exec_module = exec_module
        return spec


def main() -> None:
    times = _Times(sys.argv[1])
    sys.meta_path.insert(0, _WrapOnImport(times))
    atexit.register(times.write)  # `batchgen`'s script runs the exit handlers before its os._exit
    sys.argv = ["batchgen"] + sys.argv[2:]
    from batchgen.pipeline.cli import script

    script()


if __name__ == "__main__":
    main()
