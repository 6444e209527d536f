"""What every Python API call shares, on batchgen's engine (`batchgen.Engine`, api.py) as on
servers (`batchgen.ServedEngine`, served.py): keyword options as RunOptions (checked as a job's
fields are), and one call: read and check the jobs, tokenize them, run them on the face's
executor (the CLI's seam: pipeline/run/executors.py), rows back in input order.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

import pyarrow as pa

from batchgen.convert import ERROR, Source, results_as, source_of
from batchgen.jobs import GenerationDefaults, InvalidRow, Job, JobError, Location
from batchgen.jobs.checks import Checker
from batchgen.jobs.errors import keyword_option, option_names
from batchgen.jobs.params import CONSTRAINTS, PARAMS, constraint, split_fields
from batchgen.jobs.columns import CREATED, ORDER

RUN_OPTIONS = ("prompt_template", "system", "min_shared_tokens", "max_batch_tokens", "output_format", "overwrite",
               "on_error", "adapters")
LOAD_OPTIONS = ("device", "dtype", "trust_remote_code", "threads")
# what a served call takes besides (`Engine.serve`, `Engine.connect`; `verify` is each call's)
SERVE_OPTIONS = ("vllm", "vllm_args", "concurrency", "retry_seconds")
_F = TypeVar("_F", bound=Callable[..., Any])


def keywords(fn: _F) -> _F:
    """Errors raised inside name options as this face takes them (`output=`, `overwrite=True`),
    not as the CLI's flags (jobs/errors.py: `option`)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with option_names(keyword_option):
            return fn(*args, **kwargs)
    return call  # type: ignore[return-value]


class NeverStop:
    """An API call is not stopped by signals (the CLI's StopOnSignal): KeyboardInterrupt ends it."""

    @staticmethod
    def requested() -> bool:
        return False


def generate_on(face: Any, jobs: Any, opts: Any, output: str | None, progress: bool) -> Any:
    """One call on either face (`Engine`: batchgen's engine here; `ServedEngine`: servers): read
    and check the jobs, tokenize them, run them on the face's executor, rows in input order."""
    from batchgen.pipeline.run.adapters import Adapters
    from batchgen.pipeline.run.inmemory import tokenized
    from batchgen.pipeline.run.preflight import check_options, check_output
    from batchgen.pipeline.run.runner import write_results

    check_options(opts)
    source = source_of(jobs)
    if output is not None:  # a bad path, or one that is an input, fails before any work, as in the CLI
        check_output(output, opts.output_format, opts.overwrite, source.paths or ())
    adapters = Adapters.of(opts.adapters, face.config, refuse_directory=getattr(face, "refuse_directory", None))
    checked = tokenized(*_read(source, opts, adapters), face.tokenizer, face.config, opts, adapters)
    if opts.on_error == "fail" and checked.invalid:
        listing = "\n".join(str(v) for v in list(checked.invalid.values())[:50])
        raise JobError(f"{len(checked.invalid)} job(s) cannot run (on_error='fail'); nothing was generated:\n"
                       f"{listing}")
    executor, requests = face._executor(checked, opts, adapters)
    rows, errors = _run(executor, checked, requests, progress)
    if output is not None:
        write_results(output, opts.output_format, checked.schema, [dict(r) for r in rows],
                      [dict(e) for e in errors], checked.jobs, face.name, executor.fingerprint(), face.tokenizer)
    face._after(executor, opts)
    schema = pa.schema([f for f in checked.schema if f.name != CREATED])
    return results_as(source, _in_order(rows, errors, checked, schema), schema)


def _read(source: Source, opts: Any, adapters: Any) -> tuple[dict[int, Job], dict[int, InvalidRow], pa.Schema]:
    from batchgen.jobs.readers import jobs_of_records
    from batchgen.pipeline.run.inmemory import checked_rows
    from batchgen.pipeline.run.inputrows import read_checked

    if source.kind == "files":
        return read_checked(source.paths, opts, adapters)
    jobs: dict[int, Job] = {}
    invalid: dict[int, InvalidRow] = {}
    for order, item in enumerate(jobs_of_records(source.records, opts.defaults, opts.prompt_template, opts.system)):
        (jobs if isinstance(item, Job) else invalid)[order] = item
    return checked_rows(jobs, invalid, source.hint, opts, adapters)


def _run(executor: Any, checked: Any, requests: list[Any], progress: bool
         ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Result rows and error rows, each with its input position, as the CLI's runner makes them."""
    from tqdm.auto import tqdm

    from batchgen.pipeline.text.expand import finished_jobs
    from batchgen.pipeline.text.results import job_rows

    jobs = checked.jobs
    rows: list[dict[str, Any]] = []
    errors = [{**inv.to_row(), ORDER: o} for o, inv in checked.invalid.items()]
    with tqdm(total=len(checked.expected), disable=not progress, unit="job") as bar:
        for order, completions in finished_jobs(executor.run(jobs, requests, NeverStop.requested),
                                                checked.expected):
            done, failed = job_rows(order, jobs[order], completions, checked.tokenizer)
            rows += done
            errors += failed
            bar.update(1)
    # input order, as the runner's committed parts give them back (job_rows orders samples)
    return sorted(rows, key=lambda r: r[ORDER]), sorted(errors, key=lambda e: e[ORDER])


def model_source_of(model: str | None) -> tuple[str, str]:
    from batchgen.pipeline.model.load import model_source

    return model_source(model)


def run_options(options: dict[str, Any]) -> Any:
    """RunOptions from keyword options: generation parameters are checked as a job's fields are
    (location "options"), so an unsupported one is refused, not ignored."""
    from batchgen.pipeline.run.options import RunOptions

    unknown = sorted(k for k in options if k not in RUN_OPTIONS and not _is_param(k))
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(unknown)}")
    check = Checker(Location("options"))
    params, spelled = split_fields(check, {k: v for k, v in options.items() if k not in RUN_OPTIONS})
    rule = constraint(check, params, spelled) if any(params.get(c) is not None for c in CONSTRAINTS) else None
    given = {k: params[k] for k in PARAMS if k in params}
    given.setdefault("seed", 0)  # the CLI's --seed default: the same jobs give the same samples
    defaults = GenerationDefaults(**given, constraint=rule)
    run = {k: options[k] for k in RUN_OPTIONS if k in options}
    if "adapters" in run:
        run["adapters"] = adapter_specs(run["adapters"])
    return RunOptions(defaults=defaults, **run)


def adapter_specs(adapters: Any) -> tuple[str, ...]:
    """`adapters={"name": path}` as the CLI's `--adapter NAME=PATH` values."""
    from batchgen.jobs.errors import OptionError
    from batchgen.pipeline.run.adapters import NAME_RULE

    if not isinstance(adapters, dict):
        raise OptionError("adapters", f"must be a dict of name -> adapter directory, got {type(adapters).__name__}")
    for name, path in adapters.items():
        if not isinstance(name, str) or not name.strip() or any(c in name for c in "=/\\"):
            raise OptionError("adapters", f"has the name {name!r}: {NAME_RULE}")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise OptionError("adapters", f"gives {name!r} no directory (got {path!r})")
    return tuple(f"{name}={os.fspath(path)}" for name, path in adapters.items())


def _is_param(name: str) -> bool:
    from batchgen.jobs.params import RESERVED

    return name in RESERVED


def _in_order(rows: list[dict[str, Any]], errors: list[dict[str, Any]], checked: Any,
              schema: pa.Schema) -> list[dict[str, Any]]:
    """Every input position's rows: its samples, or one row saying why it failed."""
    by_order: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_order.setdefault(r[ORDER], []).append({**r, ERROR: None})
    ints = pa.types.is_integer(schema.field("id").type)
    for e in errors:
        o = e[ORDER]
        job_id = checked.jobs[o].id if o in checked.jobs else checked.invalid[o].job_id
        if job_id is not None and ints != isinstance(job_id, int):
            job_id = None if ints else str(job_id)  # an id of the other type (its row is refused anyway)
        by_order.setdefault(o, [{"id": job_id, ERROR: f"{e['location']}: {e['reason']}"}])
    return [r for o in sorted(by_order) for r in by_order[o]]
