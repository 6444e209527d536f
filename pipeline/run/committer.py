"""Finished jobs committed as parts: buffered, and committed every `commit_every` jobs or
`commit_seconds`, each part with the engine work done by every run so far (the summary's counts
survive a crash with the rows they belong to); the rows that cannot run, and the jobs a run ended
before, as error parts.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pyarrow as pa

from batchgen.jobs import InvalidRow, Job
from batchgen.jobs.columns import ORDER
from batchgen.pipeline.engine.types import Completion, RunStats
from batchgen.pipeline.run.options import RunOptions
from batchgen.pipeline.run.preflight import Checked
from batchgen.pipeline.run.summary import ThisRun, add_work, work_of
from batchgen.pipeline.text.results import job_rows
from batchgen.pipeline.text.tokenize import Tokenizer


class Committer:
    """Buffers finished jobs and commits them as a part every `commit_every` jobs or seconds,
    with the engine work done by all runs so far."""

    def __init__(self, store, options: RunOptions, tokenizer: Tokenizer) -> None:
        self.store, self.options, self.tokenizer = store, options, tokenizer
        self.base = add_work(store.stats)  # the work of the earlier runs, as they committed it
        self.finished = RunStats()  # the work of this run's finished windows
        self.run = ThisRun()  # the jobs this run completed
        self.engine = None  # the window's engine, while it runs
        self.results: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.jobs = 0
        self.last = time.monotonic()

    def add(self, order: int, job: Job, completions: list[Completion]) -> None:
        results, errors = job_rows(order, job, completions, self.tokenizer)
        self.run.add_rows(results)
        self.results += results
        self.errors += errors
        self.jobs += 1
        if self.jobs >= self.options.commit_every or time.monotonic() - self.last >= self.options.commit_seconds:
            self.flush()

    def commit_invalid(self, invalid, done: np.ndarray, chunk: int = 65536) -> None:
        """The rows that cannot run and are not committed yet, as error parts, before generating."""
        if invalid.num_rows:
            invalid = invalid.filter(pa.array(~done[invalid.column("order").to_numpy()]))
        for start in range(0, invalid.num_rows, chunk):
            rows = invalid.slice(start, chunk).rename_columns([ORDER, "id", "location", "reason"]).to_pylist()
            self.store.commit([], rows, self.work())
            fault("after-commit")

    def commit_not_run(self, numbers: np.ndarray, checked: Checked, reason: str, chunk: int = 4096) -> None:
        """Jobs `numbers` (job numbers) as error rows with `reason`, committed: a run ended before
        they ran (RunOptions.finish_now), so each still lands exactly once."""
        for start in range(0, len(numbers), chunk):
            jobs = checked.spool.get(numbers[start:start + chunk].tolist())
            rows = [{**InvalidRow(job.location, job.id, reason).to_row(), ORDER: int(checked.orders[n])}
                    for n, job in jobs.items()]
            self.store.commit([], rows, self.work())

    def work(self) -> dict[str, int]:
        current = work_of(self.engine.stats) if self.engine is not None else {}
        return add_work(self.base, work_of(self.finished), current)

    def flush(self) -> None:
        if self.results or self.errors:
            self.store.commit(self.results, self.errors, self.work())
            fault("after-commit")
        self.results, self.errors, self.jobs, self.last = [], [], 0, time.monotonic()


def fault(point: str) -> None:
    """Fault injection for the crash tests: BATCHGEN_FAULT=<point> kills the process there."""
    if os.environ.get("BATCHGEN_FAULT") == point:
        os.kill(os.getpid(), signal.SIGKILL)
