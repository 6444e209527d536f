"""One `batchgen process` run: check, tokenize, run the engine, commit parts, write the output.

Dicts exist only at the edges (job rows in, result rows out); everything between is dataclasses.
Every input row ends exactly once in the output or in the errors file, also across crashes and
reruns (parts.py), shards (sharding.py) and signals (signals.py: exit code 75, rerun to resume).

Memory does not grow with the input: jobs wait as arrays, in the sorted prefix index and on disk
(preflight.py), and the engine gets one window of whole prefix groups at a time (windows.py), so
only that window's requests are Python objects. Finished jobs go to parts as they finish; the
output is the parts' rows put back in input order by Arrow (ordered.py).
"""
from __future__ import annotations

import errno
import gc
import os
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from batchgen.jobs import Job, JobError, errors_path, open_result_writer, summary_path, write_summary
from batchgen.jobs.columns import ORDER
from batchgen.jobs.openai_batch import request_key, whole_requests
from batchgen.jobs.writers import open_error_writer
from batchgen.jobs.atomic import remove_stale_temps
from batchgen.pipeline.run.preflight import Checked, check_inputs, check_options, check_output, job_seed
from batchgen.pipeline.run.progress import Progress
from batchgen.pipeline.text.results import add_openai_fields
from batchgen.pipeline.run.signals import Preempted, StopOnSignal
from batchgen.pipeline.run.summary import JobCounts, ThisRun, run_summary
from batchgen.pipeline.text.tokenize import Tokenizer
from batchgen.pipeline.text.expand import (JobCompletions, JobTokens, completions_expected, job_requests, tokenize_jobs,
                                  whole_key)
from batchgen.pipeline.engine.types import Request
from batchgen.pipeline.run.options import RunOptions, run_settings
from batchgen.pipeline.run.windows import COLLECT_JOBS
from batchgen.pipeline.run.committer import Committer, fault
from batchgen.pipeline.run.executors import Executor, LocalExecutor, fingerprint  # noqa: F401 (the API's)
from batchgen.pipeline.serve.errors import ServerUnreachable

def process(inputs: Sequence[str], output: str, options: RunOptions,
            progress: Callable[[Progress], None] | None = None) -> dict[str, Any]:
    """Run every valid job of `inputs`; write `output`, its errors file and its summary."""
    if options.served:  # completions servers compute (--server, --engine vllm): no model here
        from batchgen.pipeline.run.served import process_served

        return process_served(inputs, output, options, progress, mine_of=_mine, run_jobs=run_jobs)
    from batchgen.pipeline.model.prepack import Prepack

    started = time.monotonic()
    # first, before torch's import: the float32 layers pack on a thread under it (prepack.py)
    prepack = Prepack(options.model, options.device, options.dtype)
    try:
        from batchgen.pipeline.model.ahead import ModelAhead
        from batchgen.pipeline.model.hf import as_forward
        from batchgen.pipeline.model.identity import model_identity
        from batchgen.pipeline.model.kernels import set_threads
        from batchgen.pipeline.model.load import DEFAULT_MODEL, resolve_precision
        from batchgen.pipeline.run.parts import job_set_key, may_resume, read_manifest
        from batchgen.pipeline.run.sharding import parse_shard
    except BaseException:
        prepack.discard()
        raise

    # from here on a SIGTERM exits 75: at once while nothing is written, between steps after
    with StopOnSignal() as stop:
        try:
            shard = parse_shard(options.shard)
            check_options(options)
            check_output(output, options.output_format, options.overwrite, inputs)
            set_threads(options.threads)
        except BaseException:
            prepack.discard()
            raise
        bound_kernel_caches()
        # the weights load on a worker thread while the jobs are read and tokenized (ahead.py)
        model_ahead = ModelAhead(options.model, options.device, options.dtype, options.trust_remote_code, prepack)
        try:
            checked = check_inputs(list(inputs), options)
        except BaseException:
            model_ahead.discard()
            raise
        try:
            mine = _mine(checked, options, shard)
            report_invalid = shard is None or shard[0] == 0  # rows that cannot run: shard 0 reports them
            model_name = options.model or DEFAULT_MODEL
            precision = resolve_precision(options.device, options.dtype, options.model)

            def keyed(files: str | None) -> tuple[dict[str, Any], str, str]:
                settings = run_settings(options, model_name, precision, checked.adapters.digests(), files)
                job_set = job_set_key(checked.digest, settings)
                return settings, job_set, f"{job_set}:{options.shard}"

            files = model_identity(options.model)
            settings, job_set, key = keyed(files)
            if files is not None:  # (a hub model not in the local cache yet is checked once loaded)
                # refused before the run takes the model; checked again under the output's lock
                may_resume(output + ".parts", read_manifest(output + ".parts"), key, options.overwrite, settings)
            model = as_forward(model_ahead.result()[0])
            # a hub id's snapshot the load downloaded or moved on to is what ran; a local directory's
            # files were read before the load (its content sampled), and are not read a second time
            if files is None or files.startswith("revision "):
                loaded = model_identity(options.model)
                if loaded != files:
                    settings, job_set, key = keyed(loaded)
            if checked.adapters.infos:  # every adapter the jobs use, loaded once (index i + 1: infos[i])
                model.set_adapters(checked.adapters.infos)

            stop.defer()  # writing starts: a signal now stops between steps, after committing
            executor = LocalExecutor(model, model_name, checked.tokenizer.eos_token_ids, options)
            return run_jobs(output, options, checked, executor, settings, key, job_set, shard, mine, report_invalid,
                            started, stop, progress)
        finally:
            model_ahead.discard()  # a run refused before it took the model: no loading thread left
            checked.close()


def run_jobs(output: str, options: RunOptions, checked: Checked, executor: Executor, settings: dict[str, Any],
             key: str, job_set: str, shard: tuple[int, int] | None, mine: np.ndarray, report_invalid: bool,
             started: float, stop: StopOnSignal, progress: Callable[[Progress], None] | None) -> dict[str, Any]:
    """The writing half of `process`, on any executor: the parts store under the output's lock,
    the jobs generated window by window, the output, errors file and summary written."""
    from batchgen.pipeline.run.parts import PartStore

    store = None
    try:
        store = PartStore(output, key, settings, checked.schema, discard_mismatch=options.overwrite)
        run = _Run(output, options, checked, store, executor, executor.model_name, stop)
        counts, work, about, share = run.generate(mine, report_invalid, progress)
        summary = run_summary(counts, work, started=started, model=executor.model_name, options=options, run=share)
        summary.update(about, job_set=job_set, model_files=settings.get("model_files"),
                       shard=list(shard) if shard else None, jobs_total=checked.total,
                       device_type=settings["device_type"], dtype=settings["dtype"])
        write_summary(summary_path(output), summary)
        store.remove()
        return summary
    except OSError as e:
        raise _write_error(e, output, store) from e
    finally:
        if store is not None:
            store.close()


def _mine(checked: Checked, options: RunOptions, shard: tuple[int, int] | None) -> np.ndarray:
    """Which jobs this run generates (by job number): all, or its shard's whole prefix groups.
    With --on-error fail, any row that cannot run stops the run here, before the model loads."""
    from batchgen.pipeline.run.windows import assign_shards

    if options.on_error == "fail" and len(checked.invalid):
        listing = "\n".join(checked.invalid.lines(limit=50))
        more = f"\n... and {len(checked.invalid) - 50} more" if len(checked.invalid) > 50 else ""
        raise JobError(f"{len(checked.invalid)} job(s) cannot run (--on-error fail); nothing was generated:\n"
                       f"{listing}{more}")
    if shard is None:
        return np.ones(len(checked.orders), dtype=bool)
    return assign_shards(checked.index, shard[1], options.min_shared_tokens) == shard[0]


class _Run:
    """The writing half of a run: generate the jobs not yet committed, window by window, commit
    them as they finish, then write the output, the errors file and the summary's counts."""

    def __init__(self, output: str, options: RunOptions, checked: Checked, store, executor: Executor,
                 model_name: str, stop: StopOnSignal) -> None:
        self.output, self.options, self.checked, self.store, self.stop = output, options, checked, store, stop
        self.executor, self.model_name = executor, model_name

    def generate(self, mine: np.ndarray, report_invalid: bool,
                 progress: Callable[[Progress], None] | None) -> tuple[JobCounts, dict[str, int], dict[str, Any],
                                                                       ThisRun]:
        """The output's job counts, the work of all runs, what else the summary reports, and this
        run's share of it."""
        checked, store, options = self.checked, self.store, self.options
        done = store.done(checked.total)
        fmt = options.output_format
        remove_stale_temps([self.output, errors_path(self.output, fmt), summary_path(self.output)])  # we hold the lock
        committer = Committer(store, options, checked.tokenizer)
        if report_invalid:
            committer.commit_invalid(checked.invalid.table(), done)
        todo = mine & ~done[checked.orders]
        if options.finish_now is not None:  # cancelled or expired: what is not committed is not run
            committer.commit_not_run(np.flatnonzero(todo), checked, options.finish_now)
            todo = np.zeros_like(todo)
        total = int(mine.sum())
        pace = Progress(total - int(todo.sum()), total, total - int(todo.sum()), 0, 0, 0, 0.0)
        began = time.monotonic()

        executor = self.executor
        try:
            for jobs, requests, want, reuse in self._windows(todo):
                committer.engine = executor
                samples = JobCompletions(want)
                # the window's requests live until it ends: collections need not walk them meanwhile
                gc.freeze()
                for c in executor.run(jobs, requests, self.stop.requested):
                    pace.completion_tokens += len(c.token_ids)
                    whole = samples.add(c)
                    if whole is not None:  # its samples, continuations or windows all in
                        order, completions = whole
                        # batchgen's engine: what it reuses in the tree of all jobs, not in this window's
                        # (see windows.reused); a server: what it reports it served from its cache
                        finished = completions if executor.reports_cached else \
                            [replace(s, cached_tokens=reuse[order]) for s in completions]
                        committer.add(order, jobs[order], finished)
                        pace.jobs_done += 1
                        pace.prompt_tokens += sum(s.prompt_tokens for s in finished if s.sample_index == 0)
                        pace.cached_tokens += sum(s.cached_tokens for s in finished if s.sample_index == 0)
                    if progress is not None:
                        pace.elapsed = time.monotonic() - began
                        progress(replace(pace))  # a snapshot: the reporter may keep it
                gc.unfreeze()
                committer.engine = None
                committer.finished.add(executor.stats)
                if len(requests) >= COLLECT_JOBS:
                    del jobs, requests, samples, want, reuse
                    gc.collect()  # the window's tree (its nodes point at each other) goes before the next is built
                if self.stop.requested():
                    break
        except ServerUnreachable as e:  # a server is gone: keep what is finished, stop resumable (exit 75)
            gc.unfreeze()
            committer.flush()
            raise Preempted(f"{e}; finished jobs are committed in {store.dir}; rerun the same command to "
                            "resume") from None
        committer.flush()
        if self.stop.requested():
            raise Preempted(f"stopped by a signal; finished jobs are committed in {store.dir}; "
                            "rerun the same command to resume")
        counts = self._write_output()
        about = {**executor.about(committer.finished),
                 "output": self.output,
                 "errors_file": errors_path(self.output, fmt) if counts.failed else None,
                 "resumed_jobs": int(done.sum())}
        committer.run.resumed_work = committer.base
        return counts, committer.work(), about, committer.run

    def _windows(self, todo: np.ndarray):
        """(jobs by input position, requests in sorted order, completions that finish each job, and
        the prompt tokens each job's requests reuse) per window of whole prefix groups."""
        from batchgen.pipeline.run.windows import reused, windows

        checked, options = self.checked, self.options
        index = checked.index
        everyone, whole = index.subset(np.arange(len(index)))
        reuse = np.zeros(len(index), dtype=np.int64)  # by job number: defined on the tree of all jobs
        reuse[everyone] = reused(whole, index.lengths[everyone], index.weights[everyone], options.min_shared_tokens)
        positions = np.flatnonzero(todo[index.order])
        numbers, held = index.subset(positions)
        cuts = windows(held, index.prompt_tokens(numbers), options.min_shared_tokens, options.window_jobs,
                       options.window_tokens)
        prompts = index.prompts(positions)
        for a, b in cuts:
            window = [next(prompts) for _ in range(b - a)]
            records = checked.spool.get(number for number, _ in window)
            # the index holds a generating job's prompt, and of the others what their requests share:
            # those are tokenized again, as preflight did
            again = [number for number, _ in window if not whole_key(records[number])]
            tokens = dict(zip(again, tokenize_jobs(checked.tokenizer, [records[n] for n in again])))
            jobs: dict[int, Job] = {}
            requests: list[Request] = []
            want: dict[int, int] = {}
            cached: dict[int, int] = {}
            for number, ids in window:
                order, job = int(checked.orders[number]), records[number]
                jobs[order] = job
                mine = job_requests(order, job, tokens.get(number) or JobTokens(ids), checked.tokenizer,
                                    checked.window, job_seed(options.defaults.seed, job),
                                    checked.adapters.index_of(job))
                want[order] = completions_expected(mine)
                cached[order] = int(reuse[number])
                requests += mine
            yield jobs, requests, want, cached
            del jobs, requests, records, window, want, cached

    def _write_output(self) -> JobCounts:
        """The committed parts in input order, streamed into the output and the errors file."""
        from batchgen.pipeline.run.ordered import in_order
        from batchgen.pipeline.run.parts import ERROR_PART_SCHEMA

        checked, store, fmt = self.checked, self.store, self.options.output_format
        sharded = self.options.shard is not None
        counts = JobCounts()
        errors = in_order(store.files("errors"), ERROR_PART_SCHEMA, checked.total, store.dir)
        failed: set[int] = set()
        if fmt == "openai":
            # a request whose list prompt had one element fail is an error line only (the Batch API
            # fails a request whole): the error lines first (they are few), and their requests
            errors = [self._openai_rows(t) for t in errors]
            failed = {r["request"] for rows in errors for r in rows}
        # shard outputs keep the input position: `batchgen merge` restores input order with it
        schema = store.schema if sharded else checked.schema
        with open_result_writer(self.output, schema, fmt, overwrite=True, model=self.model_name,
                                fingerprint=self.executor.fingerprint()) as w:
            for table in in_order(store.files("part"), store.schema, checked.total, store.dir):
                if fmt == "openai":  # counted as written: a failed request's answered elements failed too
                    rows = self._openai_rows(table)
                    kept = [r["request"] not in failed for r in rows]  # whole_requests, as a mask
                    counts.add(table.filter(pa.array(kept, pa.bool_())))
                    counts.add_failed(sum(r["sample_index"] == 0 and not k for r, k in zip(rows, kept)))
                    w.write([r for r, k in zip(rows, kept) if k])
                    continue
                counts.add(table)
                if fmt == "parquet":
                    w.write_table(table)  # the writer keeps its schema's columns (ORDER: shards only)
                else:
                    w.write(table.drop_columns([ORDER]).to_pylist())  # one bucket of rows, for the line writer
            fault("final-write")
        with open_error_writer(errors_path(self.output, fmt), fmt, overwrite=True) as ew:
            for part in errors:  # Arrow tables, or the OpenAI writer's rows
                if fmt == "openai":
                    counts.add_failed(len(part))
                    ew.write(part)
                else:
                    counts.add_failed(part.num_rows)
                    ew.write_table(part)
        return counts

    def _openai_rows(self, table: pa.Table) -> list[dict[str, Any]]:
        """A bucket's rows with what only the OpenAI writers read: the request each belongs to."""
        checked = self.checked
        orders = table.column(ORDER).to_numpy()
        numbers = np.minimum(np.searchsorted(checked.orders, orders), max(len(checked.orders) - 1, 0))
        ran = (checked.orders[numbers] == orders) if len(checked.orders) else np.zeros(len(orders), dtype=bool)
        jobs = checked.spool.get(sorted(set(numbers[ran].tolist())))
        out = []
        for r, n, o, is_job in zip(table.to_pylist(), numbers.tolist(), orders.tolist(), ran.tolist()):
            add_openai_fields(r, o, jobs[n] if is_job else None, checked.tokenizer)
            if not is_job and o in checked.custom_ids:  # a refused element of a list prompt: its request
                r["custom_id"], index = checked.custom_ids[o]
                r["request"] = request_key(o, index)
            out.append(r)
        return out


def write_results(output: str, fmt: str, schema, rows: list[dict[str, Any]], errors: list[dict[str, Any]],
                  jobs: dict[int, Job], model_name: str, fingerprint: str, tokenizer: Tokenizer) -> None:
    """The output and its errors file from result rows and error rows held in memory (each with its
    input position, in input order): the Python API's writer (a run streams, `_Run._write_output`)."""
    if fmt == "openai":  # what only that writer reads: the request each row belongs to
        for r in rows + errors:
            add_openai_fields(r, r[ORDER], jobs.get(r[ORDER]), tokenizer)
        rows = whole_requests(rows, {e["request"] for e in errors})
    for r in rows:
        del r[ORDER]
    with open_result_writer(output, schema, fmt, overwrite=True, model=model_name, fingerprint=fingerprint) as w:
        w.write(rows)
    with open_error_writer(errors_path(output, fmt), fmt, overwrite=True) as ew:
        ew.write(errors)


def bound_kernel_caches(entries: int = 128) -> None:
    """torch's oneDNN kernels cache a primitive per distinct shape (and ideep its buffers), up to
    1,024 each, and the engine's forwards have a new token count nearly every step: over a long
    run those caches alone grow the process's memory steadily. 128 entries each keep memory flat
    at the same speed (BENCHMARKS.md). Read at oneDNN's first call, so set
    before the model runs; values in the environment win."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(entries))


def _write_error(e: OSError, output: str, store) -> JobError:
    """A file-system error while writing, as one line: what failed, where, and what to do."""
    where = e.filename or output
    kept = (f"finished jobs stay committed in {store.dir}; " if store is not None and store.manifest.get("parts")
            else "")
    fix = "free some space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else \
        "make it writable or choose another -o" if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else "fix it"
    return JobError(f"cannot write {where}: {e.strerror or e}; {kept}{fix}, then rerun the same command"
                    + (" to resume" if kept else ""))
