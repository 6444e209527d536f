"""One `batchgen process` run: read jobs, tokenize, run the engine, commit parts, write the output.

Dicts exist only at the edges (job rows in, result rows out); everything between is dataclasses.
Every input row ends exactly once in the output or in the errors file, also across crashes and
reruns (parts.py), shards (sharding.py) and signals (exit code 75: rerun to resume).
"""
from __future__ import annotations

import glob
import hashlib
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from jobs import (ErrorWriter, GenerationDefaults, InvalidRow, Job, JobError, errors_path, id_type_for,
                  infer_extra_schema, input_schema, open_result_writer, read_jobs, result_schema,
                  summary_path, write_summary)
from pipeline.tokenize import Tokenizer, TokenizerError
from pipeline.types import Completion, Request, RunStats, SamplingParams

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: a scheduler may requeue the same command


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


class Preempted(Exception):
    """SIGTERM/SIGINT: finished work is committed; rerun the same command to resume."""


def job_seed(run_seed: int | None, job_id: str | int) -> int:
    """A job without a seed gets one from the run's seed and its id: stable across reruns and
    batches, and different for two jobs with the same prompt."""
    digest = hashlib.blake2b(f"{run_seed or 0}:{job_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def context_window(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def to_requests(jobs: Mapping[int, Job], tokenizer: Tokenizer, window: int | None,
                run_seed: int | None) -> tuple[list[Request], dict[int, InvalidRow]]:
    """Tokenize each job whole (keyed by its input position); a job that cannot run becomes an
    error row, never a crash."""
    requests, invalid = [], {}
    for order, job in jobs.items():
        try:
            ids = tokenizer.encode_messages(job.messages) if job.is_chat else tokenizer.encode_prompt(job.prompt)
        except TokenizerError as e:
            invalid[order] = InvalidRow(job.location, job.id, str(e))
            continue
        made = make_request(order, job, ids, tokenizer, window, run_seed)
        if isinstance(made, InvalidRow):
            invalid[order] = made
        else:
            requests.append(made)
    return requests, invalid


def make_request(order: int, job: Job, ids: list[int], tokenizer: Tokenizer, window: int | None,
                 run_seed: int | None) -> Request | InvalidRow:
    if not ids:
        return InvalidRow(job.location, job.id, "the prompt tokenizes to no tokens")
    too_long = length_error(job, len(ids), window)
    if too_long is not None:
        return too_long
    params = SamplingParams(
        max_new_tokens=job.max_new_tokens, temperature=job.temperature, top_p=job.top_p,
        top_k=job.top_k, seed=job.seed if job.seed is not None else job_seed(run_seed, job.id), n=job.n,
    )
    return Request(order, ids, params, tokenizer.stop_check(job.stop))


def length_error(job: Job, n_prompt: int, window: int | None) -> InvalidRow | None:
    if window is not None and n_prompt + job.max_new_tokens > window:
        return InvalidRow(job.location, job.id,
                          f"prompt of {n_prompt} tokens + max_new_tokens {job.max_new_tokens} exceeds the model's "
                          f"context window of {window}; shorten the prompt or lower max_new_tokens")
    return None


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
        reason = f"generation failed: {failed.error if failed else 'no output'}"
        return [], [{**InvalidRow(job.location, job.id, reason).to_row(), ORDER: order}]
    return [{**r, ORDER: order} for r in result_rows(job, completions, tokenizer)], []


def read_all(inputs: Sequence[str], options: RunOptions) -> tuple[dict[int, Job], dict[int, InvalidRow]]:
    """Every input row by its position: a valid job or the reason it is not one."""
    jobs: dict[int, Job] = {}
    invalid: dict[int, InvalidRow] = {}
    for order, item in enumerate(read_jobs(inputs, options.defaults, dataset=options.dataset, split=options.split,
                                           prompt_template=options.prompt_template, system=options.system)):
        (jobs if isinstance(item, Job) else invalid)[order] = item
    return jobs, invalid


def process(inputs: Sequence[str], output: str, options: RunOptions,
            progress: Callable[[Completion, RunStats], None] | None = None) -> dict[str, Any]:
    """Run every valid job of `inputs`; write `output`, its errors file and its summary."""
    from pipeline.engine import Engine
    from pipeline.model import DEFAULT_MODEL, load_model
    from pipeline.parts import ORDER, PartStore, fingerprint
    from pipeline.sharding import assign, parse_shard

    started = time.monotonic()
    shard = parse_shard(options.shard)
    if shard is not None and options.output_format != "parquet":
        raise JobError("--shard writes Parquet shard outputs for `batchgen merge`; drop --output-format")
    jobs, invalid = read_all(inputs, options)
    total = len(jobs) + len(invalid)
    # a bad output path or a column clash fails here, before any model work
    schema = result_schema(infer_extra_schema((j.extra for j in jobs.values()), input_schema(inputs)),
                           id_type_for(j.id for j in jobs.values()))
    if os.path.exists(output) and not options.overwrite and not os.path.exists(output + ".parts"):
        raise JobError(f"{output} already exists; pass --overwrite to replace it")

    model, tokenizer_source = load_model(options.model, options.device, options.dtype, options.trust_remote_code)
    tokenizer = Tokenizer.load(tokenizer_source, trust_remote_code=options.trust_remote_code)
    requests, bad = to_requests(jobs, tokenizer, context_window(model.config), options.defaults.seed)
    invalid.update(bad)
    if shard is not None:
        mine = assign({r.key: r.prompt_ids for r in requests}, shard[1], options.min_shared_tokens)
        requests = [r for r in requests if mine[r.key] == shard[0]]
        invalid = invalid if shard[0] == 0 else {}  # rows that cannot run: shard 0 reports them
    if options.on_error == "fail" and invalid:
        listing = "\n".join(str(v) for _, v in sorted(invalid.items())[:50])
        more = f"\n... and {len(invalid) - 50} more" if len(invalid) > 50 else ""
        raise JobError(f"{len(invalid)} job(s) cannot run (--on-error fail); nothing was generated:\n{listing}{more}")

    model_name = options.model or DEFAULT_MODEL
    settings = _settings(options, model_name)
    # the same for every shard of one command line, so `merge` can check they belong together
    job_set = fingerprint(([o, j.id, j.prompt, j.messages, j.extra, j.max_new_tokens, j.temperature, j.top_p,
                            j.top_k, j.seed, list(j.stop), j.n] for o, j in sorted(jobs.items())),
                          {k: v for k, v in settings.items() if k != "shard"})
    store = PartStore(output, f"{job_set}:{options.shard}", settings, schema, discard_mismatch=options.overwrite)
    _clean_stale_temps(output)
    done = store.done()
    committer = _Committer(store, options, tokenizer)
    committer.errors = [{**inv.to_row(), ORDER: o} for o, inv in sorted(invalid.items()) if o not in done]
    todo = [r for r in requests if r.key not in done]

    engine = Engine(model, eos_token_ids=_eos_ids(model, tokenizer), min_shared_tokens=options.min_shared_tokens,
                    max_batch_tokens=options.max_batch_tokens)
    committer.engine = engine
    with _StopOnSignal() as stop:
        samples: dict[int, list[Completion]] = {}
        for c in engine.run(todo, should_stop=stop.requested):
            samples.setdefault(c.key, []).append(c)
            if len(samples[c.key]) == jobs[c.key].n:
                committer.add(c.key, jobs[c.key], samples.pop(c.key))
            if progress is not None:
                progress(c, engine.stats)
        committer.flush()
        if stop.requested():
            raise Preempted(f"stopped by a signal; finished jobs are committed in {store.dir}; "
                            "rerun the same command to resume")

    table = store.results()
    rows = table.to_pylist()
    for r in rows:
        r["endpoint"] = jobs[r[ORDER]].openai_endpoint
        if shard is None:
            del r[ORDER]  # kept in shard outputs: `batchgen merge` restores input order with it
    out_schema = table.schema if shard is not None else schema
    with open_result_writer(output, out_schema, options.output_format, overwrite=True, model=model_name) as w:
        w.write(rows)
        _fault("final-write")
    errors = store.errors()
    with ErrorWriter(errors_path(output), overwrite=True) as ew:
        ew.write(errors)
    stats = committer.total()
    summary = _summary(stats, len(requests) + len(invalid), len(set(table.column("id").to_pylist())), len(errors),
                       len(rows), model_name, options, started)
    summary.update(attention_path=engine.attention_path, output=output,
                   errors_file=errors_path(output) if errors else None, resumed_jobs=len(done),
                   jobs_total=total, job_set=job_set, shard=list(shard) if shard else None)
    write_summary(summary_path(output), summary)
    store.remove()
    return summary


class _Committer:
    """Buffers finished jobs and commits them as a part every `commit_every` jobs or seconds."""

    def __init__(self, store, options: RunOptions, tokenizer: Tokenizer) -> None:
        self.store, self.options, self.tokenizer = store, options, tokenizer
        self.base = RunStats(**{k: v for k, v in store.stats.items() if k in RunStats.__dataclass_fields__})
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

    def total(self) -> RunStats:
        total = RunStats(**asdict(self.base))
        if self.engine is not None:
            total.add(self.engine.stats)
        return total

    def flush(self) -> None:
        if self.results or self.errors:
            self.store.commit(self.results, self.errors, asdict(self.total()))
            _fault("after-commit")
        self.results, self.errors, self.jobs, self.last = [], [], 0, time.monotonic()


class _StopOnSignal:
    """SIGTERM/SIGINT ask the run to stop between steps; a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._old: dict[int, Any] = {}

    def requested(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum, frame) -> None:
        self._event.set()
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _fault(point: str) -> None:
    """Fault injection for the crash tests: BATCHGEN_FAULT=<point> kills the process there."""
    if os.environ.get("BATCHGEN_FAULT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _clean_stale_temps(output: str) -> None:
    """Temp files of writers whose process died (we hold the run's lock now)."""
    head, name = os.path.split(output)
    for path in glob.glob(os.path.join(head or ".", f".{glob.escape(name)}*.tmp-*")):
        try:
            os.unlink(path)
        except OSError:
            pass


def _settings(options: RunOptions, model_name: str) -> dict[str, Any]:
    """What decides the outputs' content; batch sizes and devices do not."""
    d = asdict(options.defaults)
    return {"model": model_name, "dtype": options.dtype, "defaults": d, "prompt_template": options.prompt_template,
            "system": options.system, "shard": options.shard, "output_format": options.output_format}


def _eos_ids(model: Any, tokenizer: Tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return tokenizer.eos_token_ids
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _summary(stats: RunStats, n_jobs: int, completed: int, failed: int, rows: int, model_name: str,
             options: RunOptions, started: float) -> dict[str, Any]:
    import torch
    import transformers

    from pipeline import __version__

    wall = time.monotonic() - started
    opts = asdict(options)
    opts["defaults"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts["defaults"].items()}
    return {
        "jobs": n_jobs,
        "completed": completed,
        "failed": failed,
        "rows": rows,
        "prompt_tokens": stats.prompt_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "cached_tokens": stats.cached_tokens,
        "completion_tokens": stats.completion_tokens,
        "decode_steps": stats.decode_steps,
        "batches": stats.batches,
        "shared_prefixes": stats.prefix_nodes,
        "oom_splits": stats.oom_splits,
        "cascade_batches": stats.cascade_batches,
        "admitted_rows": stats.admitted_rows,
        "prefill_saving": round(1 - stats.prefill_tokens / stats.prompt_tokens, 4) if stats.prompt_tokens else 0.0,
        "wall_seconds": round(wall, 3),
        "completion_tokens_per_second": round(stats.completion_tokens / wall, 2) if wall > 0 else None,
        "model": model_name,
        "versions": {"batchgen": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "options": opts,
    }
