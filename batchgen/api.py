"""`batchgen.generate` and `batchgen.Engine`: the CLI's validation, engine and result rows, called
from Python with jobs and results in the caller's type (batchgen/convert.py).

Results come back in input order: each job's rows (one per sample), exactly the rows the CLI's
output holds, plus an ``error`` column; a job that cannot run, or fails while generating, is one
row in its place with its ``id``, the ``error`` ("location: reason", as in the CLI's errors file)
and nulls elsewhere. Nothing is written unless ``output`` is given: then the output and its errors
file are written as the CLI writes them (for resumable runs, use the CLI).
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

# keyword options besides the generation parameters (jobs/params.py: PARAMS, CONSTRAINTS, aliases)
RUN_OPTIONS = ("prompt_template", "system", "min_shared_tokens", "max_batch_tokens", "output_format", "overwrite",
               "on_error", "adapters")
LOAD_OPTIONS = ("device", "dtype", "trust_remote_code", "threads")
_F = TypeVar("_F", bound=Callable[..., Any])


def _keywords(fn: _F) -> _F:
    """Errors raised inside name options as this face takes them (`output=`, `overwrite=True`),
    not as the CLI's flags (jobs/errors.py: `option`)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with option_names(keyword_option):
            return fn(*args, **kwargs)
    return call  # type: ignore[return-value]


@_keywords
def generate(jobs: Any, model: str | None = None, *, output: str | None = None, progress: bool = False,
             **options: Any) -> Any:
    """Generate for every job; results in input order, in the type of `jobs`.

    `jobs`: a list of dicts, a pandas DataFrame, a `datasets.Dataset`, or file paths (JSONL,
    Parquet, directories, OpenAI Batch files; results then come back as a list of dicts). `model`:
    a Hugging Face id or local directory (None: the embedded default model), loaded for this call;
    keep one loaded with `Engine`. `options`: generation defaults by their job-field names
    (max_new_tokens, temperature, top_p, top_k, seed, stop, n, repetition_penalty,
    presence_penalty, frequency_penalty, min_tokens, logit_bias, stop_token_ids, logprobs,
    top_logprobs, prompt_logprobs, json_schema, regex, choice, response_format), run options (prompt_template, system, min_shared_tokens,
    max_batch_tokens, output_format, overwrite, on_error, adapters) and loading options (device, dtype,
    trust_remote_code, threads). `output`: also write the results and errors file there.
    `adapters`: {name: PEFT LoRA adapter directory}; a job's `adapter` field names one (or gives
    a directory), an OpenAI request's `body.model` may name one; jobs without run the base model.
    """
    load = {k: options.pop(k) for k in LOAD_OPTIONS if k in options}
    return Engine.load(model, **load).generate(jobs, output=output, progress=progress, **options)


class Engine:
    """A loaded model and its tokenizer, for repeated `generate` calls."""

    def __init__(self, model: Any, tokenizer: Any, *, name: str | None = None) -> None:
        from batchgen.pipeline.model.hf import as_forward
        from batchgen.pipeline.text.tokenize import Tokenizer

        self.model = as_forward(model)  # a transformers model, or one `Engine.load` loaded
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
        # what OpenAI output reports as the model: the name it was loaded by
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__

    @classmethod
    @_keywords
    def load(cls, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
             trust_remote_code: bool = False, threads: int | None = None) -> "Engine":
        """Load a model (a Hugging Face id or local directory; None: the embedded default model)."""
        from batchgen.pipeline.model.load import DEFAULT_MODEL, load_model
        from batchgen.pipeline.text.tokenize import Tokenizer

        if threads is not None:  # torch's threads are the process's: changed only when asked
            from batchgen.pipeline.model.kernels import set_threads

            set_threads(threads)
        loaded, source = load_model(model, device, dtype, trust_remote_code)
        return cls(loaded, Tokenizer.load(source, trust_remote_code=trust_remote_code), name=model or DEFAULT_MODEL)

    @_keywords
    def generate(self, jobs: Any, *, output: str | None = None, progress: bool = False, **options: Any) -> Any:
        """As `batchgen.generate`, with this engine's model (loading options do not apply)."""
        from batchgen.pipeline.run.inmemory import tokenized
        from batchgen.pipeline.run.preflight import check_output
        from batchgen.pipeline.run.runner import fingerprint, write_results

        from batchgen.pipeline.run.adapters import Adapters

        opts = run_options(options)
        source = source_of(jobs)
        if output is not None:  # a bad path, or one that is an input, fails before any work, as in the CLI
            check_output(output, opts.output_format, opts.overwrite, source.paths or ())
        adapters = Adapters.of(opts.adapters, self.model.config)
        checked = tokenized(*self._read(source, opts, adapters), self.tokenizer, self.model.config, opts, adapters)
        if opts.on_error == "fail" and checked.invalid:
            listing = "\n".join(str(v) for v in list(checked.invalid.values())[:50])
            raise JobError(f"{len(checked.invalid)} job(s) cannot run (on_error='fail'); nothing was generated:\n"
                           f"{listing}")
        if adapters.infos:  # the adapters this call's jobs use (index i + 1: infos[i])
            self.model.set_adapters(adapters.infos)
        rows, errors = self._run(checked, opts, progress)
        if output is not None:
            write_results(output, opts.output_format, checked.schema, [dict(r) for r in rows],
                          [dict(e) for e in errors], checked.jobs, self.name, fingerprint(self.model, self.name),
                          self.tokenizer)
        schema = pa.schema([f for f in checked.schema if f.name != CREATED])
        return results_as(source, _in_order(rows, errors, checked, schema), schema)

    def _read(self, source: Source, opts: Any, adapters: Any) -> tuple[dict[int, Job], dict[int, InvalidRow], pa.Schema]:
        from batchgen.jobs.readers import jobs_of_records
        from batchgen.pipeline.run.inmemory import checked_rows
        from batchgen.pipeline.run.inputrows import read_checked

        if source.kind == "files":
            return read_checked(source.paths, opts, adapters)
        jobs: dict[int, Job] = {}
        invalid: dict[int, InvalidRow] = {}
        for order, item in enumerate(jobs_of_records(source.records, opts.defaults, opts.prompt_template,
                                                     opts.system)):
            (jobs if isinstance(item, Job) else invalid)[order] = item
        return checked_rows(jobs, invalid, source.hint, opts, adapters)

    def _run(self, checked: Any, opts: Any, progress: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Result rows and error rows, each with its input position, as the CLI's runner makes them."""
        from tqdm.auto import tqdm

        from batchgen.pipeline.engine.engine import Engine as Core
        from batchgen.pipeline.text.expand import finished_jobs
        from batchgen.pipeline.text.results import job_rows

        jobs = checked.jobs
        core = Core.for_model(self.model, self.tokenizer.eos_token_ids, min_shared_tokens=opts.min_shared_tokens,
                              max_batch_tokens=opts.max_batch_tokens)
        rows: list[dict[str, Any]] = []
        errors = [{**inv.to_row(), ORDER: o} for o, inv in checked.invalid.items()]
        with tqdm(total=len(checked.expected), disable=not progress, unit="job") as bar:
            for order, completions in finished_jobs(core.run(checked.requests), checked.expected):
                done, failed = job_rows(order, jobs[order], completions, self.tokenizer)
                rows += done
                errors += failed
                bar.update(1)
        # input order, as the runner's committed parts give them back (job_rows orders samples)
        return sorted(rows, key=lambda r: r[ORDER]), sorted(errors, key=lambda e: e[ORDER])


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
        run["adapters"] = _adapter_specs(run["adapters"])
    return RunOptions(defaults=defaults, **run)


def _adapter_specs(adapters: Any) -> tuple[str, ...]:
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
