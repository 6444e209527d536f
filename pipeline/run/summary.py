"""The run summary (OUTPUT.summary.json, and the Ray and merged ones).

Job-level counts are computed from the committed output itself, so a run that was killed and
resumed reports exactly what an uninterrupted run reports. Engine work counters are the work
done by all runs that committed parts, including work redone after an interruption: they say
what the runs cost, not what the output holds.

This run's share is counted apart (`ThisRun`): the jobs it completed, their tokens, and the work
the earlier runs had committed (`resumed_work`). `prefill_saving` and the token rate are this
run's work over this run's jobs: all runs' work over all the output's prompts mixed the two, and
after a resume that had redone work it read "prefill 257 of 134 prompt tokens (-92% saved)".
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.pipeline.engine.types import RunStats

# summary name -> RunStats field
WORK_COUNTERS = {"prefill_tokens": "prefill_tokens", "decode_steps": "decode_steps", "batches": "batches",
                 "shared_prefixes": "prefix_nodes", "oom_splits": "oom_splits",
                 "cascade_batches": "cascade_batches", "admitted_rows": "admitted_rows",
                 # conversations: turns after the first, prompt tokens kept in rows across turns, turns rerun
                 "turns": "turns", "carried_tokens": "carried_tokens", "turn_reruns": "turn_reruns"}


@dataclass
class JobCounts:
    """What the output holds: every job once, whichever run finished it. Token counts are of
    the completed jobs (prompt and cached tokens once per job, completion tokens per sample)."""

    jobs: int = 0  # completed + failed: every input row this output accounts for
    completed: int = 0
    failed: int = 0  # rows in the errors file
    rows: int = 0  # output rows: completed jobs x samples
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # completed jobs per LoRA adapter (the output's `adapter` column; "" the base model), when
    # some job of the output ran one
    adapter_jobs: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, results: pa.Table, failed: int) -> "JobCounts":
        """From the committed result rows (one per sample) and the number of error rows."""
        counts = cls()
        counts.add(results)
        counts.add_failed(failed)
        return counts

    def add(self, results: pa.Table) -> None:
        """More committed result rows: the output is counted as it is written, a batch at a time."""
        first = results.filter(pc.equal(results["sample_index"], 0))

        def total(table: pa.Table, column: str) -> int:
            return int(pc.sum(table[column]).as_py() or 0)

        self.jobs += first.num_rows
        self.completed += first.num_rows
        self.rows += results.num_rows
        self.prompt_tokens += total(first, "prompt_tokens")
        self.cached_tokens += total(first, "cached_tokens")
        if "turn_completion_tokens" in results.column_names:  # a conversation's row: every turn's tokens
            self.completion_tokens += int(pc.sum(pc.list_flatten(results["turn_completion_tokens"])).as_py() or 0)
            results = results.filter(pc.is_null(results["turn_completion_tokens"]))
        self.completion_tokens += total(results, "completion_tokens")
        if "adapter" in results.column_names and first.num_rows:
            for label, n in zip(*_value_counts(first["adapter"])):
                self.adapter_jobs[label] = self.adapter_jobs.get(label, 0) + n

    def add_failed(self, failed: int) -> None:
        self.jobs += failed
        self.failed += failed


def _value_counts(column: pa.ChunkedArray) -> tuple[list[str], list[int]]:
    counts = pc.value_counts(pc.fill_null(column, ""))
    return counts.field("values").to_pylist(), counts.field("counts").to_pylist()


def add_adapter_jobs(*counts: Mapping[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for label, n in (c or {}).items():
            out[label] = out.get(label, 0) + int(n)
    return dict(sorted(out.items()))


COUNTERS = tuple(f.name for f in fields(JobCounts) if f.name != "adapter_jobs") + tuple(WORK_COUNTERS)


def work_of(stats: RunStats) -> dict[str, int]:
    return {name: getattr(stats, attr) for name, attr in WORK_COUNTERS.items()}


def add_work(*works: Mapping[str, int]) -> dict[str, int]:
    return {name: sum(int(w.get(name, 0) or 0) for w in works) for name in WORK_COUNTERS}


@dataclass
class ThisRun:
    """This run's share of a summary: the jobs it completed (their prompt tokens once per job, their
    completion tokens per sample, as `JobCounts` counts them) and the work counters of the earlier
    runs whose committed jobs it resumed."""

    jobs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    resumed_work: dict[str, int] = field(default_factory=dict)

    def add_rows(self, rows: list[dict[str, Any]]) -> None:
        """Result rows of jobs this run completed (one per sample)."""
        for r in rows:
            if r["sample_index"] == 0:
                self.jobs += 1
                self.prompt_tokens += int(r["prompt_tokens"] or 0)
            turns = r.get("turn_completion_tokens")  # a conversation's row: every turn's tokens, as JobCounts
            self.completion_tokens += sum(int(t or 0) for t in turns) if turns else int(r["completion_tokens"] or 0)

    @classmethod
    def of(cls, summary: Mapping[str, Any]) -> "ThisRun":
        """A summary's share (one written before batchgen counted it apart: all of it)."""
        if "run_jobs" not in summary:
            return cls(int(summary.get("completed", 0) or 0), int(summary.get("prompt_tokens", 0) or 0),
                       int(summary.get("completion_tokens", 0) or 0))
        return cls(int(summary["run_jobs"]), int(summary["run_prompt_tokens"]),
                   int(summary["run_completion_tokens"]), add_work(summary.get("resumed_work") or {}))


def summarize(counts: JobCounts, work: Mapping[str, int], wall: float, run: ThisRun | None = None) -> dict[str, Any]:
    """The counters and the rates derived from them (also what `merge` recomputes). `run`: this
    run's share (None: a run that resumed nothing, all of it)."""
    out = asdict(counts)
    adapter_jobs = add_adapter_jobs(out.pop("adapter_jobs"))
    if adapter_jobs:  # (only where some job ran an adapter)
        out["adapter_jobs"] = adapter_jobs
    if run is None:
        run = ThisRun(counts.completed, counts.prompt_tokens, counts.completion_tokens)
    total, resumed = add_work(work), add_work(run.resumed_work)
    prefilled = total["prefill_tokens"] - resumed["prefill_tokens"]  # by this run
    return {
        **out,
        **total,  # all runs' work, redone work included: what the output cost
        "run_jobs": run.jobs,
        "run_prompt_tokens": run.prompt_tokens,
        "run_completion_tokens": run.completion_tokens,
        "resumed_work": resumed,
        # this run's prefill over its own jobs' prompts (an uninterrupted run: over the output's)
        "prefill_saving": round(1 - prefilled / run.prompt_tokens, 4) if run.prompt_tokens else 0.0,
        "wall_seconds": round(wall, 3),
        "completion_tokens_per_second": round(run.completion_tokens / wall, 2) if wall > 0 else None,
    }


def run_summary(counts: JobCounts, work: Mapping[str, int], *, started: float, model: str,
                options: Any, run: ThisRun | None = None) -> dict[str, Any]:
    import torch

    from batchgen.pipeline import __version__

    opts = asdict(options)
    opts["defaults"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts["defaults"].items()}
    return {
        **summarize(counts, work, time.monotonic() - started, run),
        "model": model,
        "versions": {"batchgen": __version__, "torch": torch.__version__, "transformers": _version("transformers"),
                     "python": sys.version.split()[0]},
        "options": opts,
    }


def _version(package: str) -> str | None:
    """An installed package's version without importing it (a run on batchgen's own decoder and
    tokenizer never imports transformers; importing it only to name its version took longer
    than writing the output)."""
    module = sys.modules.get(package)
    if module is not None:
        return getattr(module, "__version__", None)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def used(**counts: int) -> str | None:
    """Which of the named paths a run took (those with a count), for a summary field such as
    `attention_kernels` or `model_code`: "a", "a and b", or None."""
    return " and ".join(name for name, n in counts.items() if n) or None


def merged(summaries: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Shard summaries joined: counters summed, rates recomputed; every other field is the first
    shard's (model, versions, options and job set are the same for all shards of one command)."""
    counts = JobCounts(**{f.name: sum(int(s.get(f.name, 0) or 0) for s in summaries) for f in fields(JobCounts)
                          if f.name != "adapter_jobs"},
                       adapter_jobs=add_adapter_jobs(*(s.get("adapter_jobs") for s in summaries)))
    wall = max(float(s.get("wall_seconds", 0) or 0) for s in summaries)  # shards run side by side
    shares = [ThisRun.of(s) for s in summaries]
    run = ThisRun(sum(r.jobs for r in shares), sum(r.prompt_tokens for r in shares),
                  sum(r.completion_tokens for r in shares), add_work(*(r.resumed_work for r in shares)))
    out = dict(summaries[0])
    out.update(summarize(counts, add_work(*summaries), wall, run))
    out["resumed_jobs"] = sum(int(s.get("resumed_jobs", 0) or 0) for s in summaries)
    for key in ("attention_path", "attention_kernels", "model_code"):
        values = sorted({str(s.get(key)) for s in summaries if s.get(key)})
        out[key] = values[0] if len(values) == 1 else values or None
    return out
