"""One `batchgen process` run: check, tokenize, run the engine, commit parts, write the output.

Dicts exist only at the edges (job rows in, result rows out); everything between is dataclasses.
Every input row ends exactly once in the output or in the errors file, also across crashes and
reruns (parts.py), shards (sharding.py) and signals (signals.py: exit code 75, rerun to resume).
"""
from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

from jobs import (GenerationDefaults, InvalidRow, Job, JobError, errors_path, open_result_writer, summary_path,
                  write_summary)
from jobs.openai_batch import GENERATION_FAILED, openai_fields, whole_requests
from jobs.writers import CREATED, open_error_writer
from jobs.atomic import remove_stale_temps
from pipeline.preflight import Checked, check_inputs, check_output
from pipeline.preflight import to_requests  # noqa: F401  (planning.py imports it from here)
from pipeline.progress import Progress
from pipeline.signals import Preempted, StopOnSignal
from pipeline.summary import JobCounts, add_work, run_summary, work_of
from pipeline.tokenize import Tokenizer
from pipeline.types import Completion, Request


@dataclass
class RunOptions:
    model: str | None = None  # None: the embedded default model
    device: str = "auto"
    dtype: str = "auto"
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    max_batch_tokens: int = 65536
    min_shared_tokens: int = 16
    output_format: str = "parquet"
    overwrite: bool = False
    prompt_template: str | None = None
    system: str | None = None
    dataset: str | None = None
    split: str = "train"
    trust_remote_code: bool = False
    on_error: str = "skip"  # or "fail": stop before any generation if a job cannot run
    shard: str | None = None  # "I/N"
    commit_every: int = 256  # jobs per committed part ...
    commit_seconds: float = 60.0  # ... or this long since the last commit, whichever first
    threads: int | None = None  # torch threads; None: one per core this process may use


def result_rows(job: Job, completions: list[Completion], tokenizer: Tokenizer) -> list[dict[str, Any]]:
    rows = []
    for c in sorted(completions, key=lambda c: c.sample_index):
        text, stopped = tokenizer.completion_text(c.token_ids, job.stop)
        rows.append({
            **job.extra,
            "id": job.id,
            "sample_index": c.sample_index,
            "completion": text,
            "finish_reason": "stop" if stopped else c.finish_reason,
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "completion_tokens": len(c.token_ids),
        })
    return rows


def job_rows(order: int, job: Job, completions: list[Completion],
             tokenizer: Tokenizer) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A finished job's result rows, or its one error row: a job fails alone and whole, never
    with partial samples in the output. Rows carry the job's input position."""
    from pipeline.parts import ORDER

    failed = next((c for c in completions if c.error), None)
    if failed is not None or not completions:
        reason = f"{GENERATION_FAILED}{failed.error if failed else 'no output'}"
        return [], [{**InvalidRow(job.location, job.id, reason).to_row(), ORDER: order}]
    created = int(time.time())  # the job's completion time (OpenAI output reports it)
    return [{**r, ORDER: order, CREATED: created} for r in result_rows(job, completions, tokenizer)], []


def run_settings(options: RunOptions, model_name: str, precision: dict[str, str]) -> dict[str, Any]:
    """What decides the outputs' content: finished work is resumed only under the same settings.
    `precision` is the resolved device type and dtype (`auto` means float32 on a CPU and bfloat16
    on CUDA, so resumed work must not be judged by the option). Batch sizes do not count."""
    return {"model": model_name, **precision, "defaults": asdict(options.defaults),
            "prompt_template": options.prompt_template, "system": options.system, "shard": options.shard,
            "output_format": options.output_format}


def process(inputs: Sequence[str], output: str, options: RunOptions,
            progress: Callable[[Progress], None] | None = None) -> dict[str, Any]:
    """Run every valid job of `inputs`; write `output`, its errors file and its summary."""
    from pipeline.model import DEFAULT_MODEL, load_model, resolve_precision
    from pipeline.parts import PartStore, job_set_key, may_resume, read_manifest
    from pipeline.sharding import assign, parse_shard

    started = time.monotonic()
    # from here on a SIGTERM exits 75: at once while nothing is written, between steps after
    with StopOnSignal() as stop:
        shard = parse_shard(options.shard)
        if shard is not None and options.output_format != "parquet":
            raise JobError("--shard writes Parquet shard outputs for `batchgen merge`; drop --output-format")
        check_output(output, options.output_format, options.overwrite)
        checked = check_inputs(list(inputs), options)
        requests, invalid = checked.requests, checked.invalid
        if shard is not None:
            mine = assign({r.key: r.prompt_ids for r in requests}, shard[1], options.min_shared_tokens)
            requests = [r for r in requests if mine[r.key] == shard[0]]
            invalid = invalid if shard[0] == 0 else {}  # rows that cannot run: shard 0 reports them
        if options.on_error == "fail" and invalid:
            listing = "\n".join(str(v) for v in list(invalid.values())[:50])
            more = f"\n... and {len(invalid) - 50} more" if len(invalid) > 50 else ""
            raise JobError(f"{len(invalid)} job(s) cannot run (--on-error fail); nothing was generated:\n{listing}{more}")

        model_name = options.model or DEFAULT_MODEL
        settings = run_settings(options, model_name, resolve_precision(options.device, options.dtype))
        job_set = job_set_key(checked.jobs, settings)
        key = f"{job_set}:{options.shard}"
        # refused before the model loads; checked again under the output's lock
        may_resume(output + ".parts", read_manifest(output + ".parts"), key, options.overwrite)
        from pipeline.kernels import set_threads

        set_threads(options.threads)
        model, _ = load_model(options.model, options.device, options.dtype, options.trust_remote_code)

        stop.defer()  # writing starts: a signal now stops between steps, after committing
        store = None
        try:
            store = PartStore(output, key, settings, checked.schema, discard_mismatch=options.overwrite)
            run = _Run(output, options, checked, store, model, model_name, stop)
            counts, work, about = run.generate(requests, invalid, progress)
            summary = run_summary(counts, work, started=started, model=model_name, options=options)
            summary.update(about, job_set=job_set, shard=list(shard) if shard else None, jobs_total=checked.total,
                           device_type=settings["device_type"], dtype=settings["dtype"])
            write_summary(summary_path(output), summary)
            store.remove()
            return summary
        except OSError as e:
            raise _write_error(e, output, store) from e
        finally:
            if store is not None:
                store.close()


class _Run:
    """The writing half of a run: generate the jobs not yet committed, commit them as they
    finish, then write the output, the errors file and the summary's counts."""

    def __init__(self, output: str, options: RunOptions, checked: Checked, store, model, model_name: str,
                 stop: StopOnSignal) -> None:
        self.output, self.options, self.checked, self.store, self.stop = output, options, checked, store, stop
        self.model, self.model_name = model, model_name

    def generate(self, requests: list[Request], invalid: dict[int, InvalidRow],
                 progress: Callable[[Progress], None] | None) -> tuple[JobCounts, dict[str, int], dict[str, Any]]:
        """The output's job counts, the work of all runs, and what else the summary reports."""
        from pipeline.engine import Engine
        from pipeline.parts import ORDER

        jobs, tokenizer, store = self.checked.jobs, self.checked.tokenizer, self.store
        done = store.done()
        fmt = self.options.output_format
        remove_stale_temps([self.output, errors_path(self.output, fmt), summary_path(self.output)])  # we hold the lock
        committer = _Committer(store, self.options, tokenizer)
        committer.errors = [{**inv.to_row(), ORDER: o} for o, inv in invalid.items() if o not in done]
        todo = [r for r in requests if r.key not in done]
        engine = Engine(self.model, eos_token_ids=_eos_ids(self.model, tokenizer),
                        min_shared_tokens=self.options.min_shared_tokens, max_batch_tokens=self.options.max_batch_tokens)
        committer.engine = engine
        pace = Progress(len(requests) - len(todo), len(requests), len(requests) - len(todo), 0, 0, 0, 0.0)
        began = time.monotonic()
        samples: dict[int, list[Completion]] = {}
        for c in engine.run(todo, should_stop=self.stop.requested):
            samples.setdefault(c.key, []).append(c)
            pace.completion_tokens += len(c.token_ids)
            if len(samples[c.key]) == jobs[c.key].n:
                finished = samples.pop(c.key)
                committer.add(c.key, jobs[c.key], finished)
                first = next(s for s in finished if s.sample_index == 0)
                pace.jobs_done += 1
                pace.prompt_tokens += first.prompt_tokens
                pace.cached_tokens += first.cached_tokens
            if progress is not None:
                pace.elapsed = time.monotonic() - began
                progress(replace(pace))  # a snapshot: the reporter may keep it
        committer.flush()
        if self.stop.requested():
            raise Preempted(f"stopped by a signal; finished jobs are committed in {store.dir}; "
                            "rerun the same command to resume")

        table = store.results()
        errors = store.errors()
        sharded = self.options.shard is not None  # shard outputs keep the input position for `batchgen merge`
        write_results(self.output, fmt, table.schema if sharded else self.checked.schema, table.to_pylist(), errors,
                      jobs, self.model_name, fingerprint(self.model, self.model_name), keep_order=sharded)
        about = {"attention_path": engine.attention_path, "output": self.output,
                 "errors_file": errors_path(self.output, fmt) if errors else None, "resumed_jobs": len(done)}
        return JobCounts.of(table, len(errors)), committer.work(), about


def write_results(output: str, fmt: str, schema, rows: list[dict[str, Any]], errors: list[dict[str, Any]],
                  jobs: dict[int, Job], model_name: str, fingerprint: str, keep_order: bool = False) -> None:
    """The output and its errors file from result rows and error rows (each with its input
    position, in input order); the CLI's runner and the Python API both write through here."""
    from pipeline.parts import ORDER

    if fmt == "openai":  # what only that writer reads: the request each row belongs to
        for r in rows + errors:
            if r.get(ORDER) in jobs:
                r.update(openai_fields(jobs[r[ORDER]]))
        rows = whole_requests(rows, errors)
    if not keep_order:
        for r in rows:
            del r[ORDER]
    with open_result_writer(output, schema, fmt, overwrite=True, model=model_name, fingerprint=fingerprint) as w:
        w.write(rows)
        _fault("final-write")
    with open_error_writer(errors_path(output, fmt), fmt, overwrite=True) as ew:
        ew.write(errors)


def fingerprint(model: Any, model_name: str) -> str:
    """OpenAI's system_fingerprint: what produced the output (engine version, model, precision)."""
    from pipeline import __version__

    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return f"batchgen-{__version__}:{model_name}:{dtype}"


class _Committer:
    """Buffers finished jobs and commits them as a part every `commit_every` jobs or seconds,
    with the engine work done by all runs so far."""

    def __init__(self, store, options: RunOptions, tokenizer: Tokenizer) -> None:
        self.store, self.options, self.tokenizer = store, options, tokenizer
        self.base = add_work(store.stats)
        self.engine = None
        self.results: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.jobs = 0
        self.last = time.monotonic()

    def add(self, order: int, job: Job, completions: list[Completion]) -> None:
        results, errors = job_rows(order, job, completions, self.tokenizer)
        self.results += results
        self.errors += errors
        self.jobs += 1
        if self.jobs >= self.options.commit_every or time.monotonic() - self.last >= self.options.commit_seconds:
            self.flush()

    def work(self) -> dict[str, int]:
        return add_work(self.base, work_of(self.engine.stats)) if self.engine is not None else dict(self.base)

    def flush(self) -> None:
        if self.results or self.errors:
            self.store.commit(self.results, self.errors, self.work())
            _fault("after-commit")
        self.results, self.errors, self.jobs, self.last = [], [], 0, time.monotonic()


def _write_error(e: OSError, output: str, store) -> JobError:
    """A file-system error while writing, as one line: what failed, where, and what to do."""
    where = e.filename or output
    kept = (f"finished jobs stay committed in {store.dir}; " if store is not None and store.manifest.get("parts")
            else "")
    fix = "free some space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else \
        "make it writable or choose another -o" if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else "fix it"
    return JobError(f"cannot write {where}: {e.strerror or e}; {kept}{fix}, then rerun the same command"
                    + (" to resume" if kept else ""))


def _fault(point: str) -> None:
    """Fault injection for the crash tests: BATCHGEN_FAULT=<point> kills the process there."""
    if os.environ.get("BATCHGEN_FAULT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _eos_ids(model: Any, tokenizer: Tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return tokenizer.eos_token_ids
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]
