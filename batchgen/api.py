"""`batchgen.generate` and `batchgen.Engine`: the CLI's validation, engine and result rows, called
from Python with jobs and results in the caller's type (batchgen/convert.py).

Results come back in input order: each job's rows (one per sample), exactly the rows the CLI's
output holds, plus an ``error`` column; a job that cannot run, or fails while generating, is one
row in its place with its ``id``, the ``error`` ("location: reason", as in the CLI's errors file)
and nulls elsewhere. Nothing is written unless ``output`` is given: then the output and its errors
file are written as the CLI writes them (for resumable runs, use the CLI).

On servers (`engine="vllm"`, `servers=[url]`; `Engine.serve`, `Engine.connect`) the same call
runs through the CLI's executor seam: `ServedExecutor` in place of batchgen's engine, the
requests in prefix order, the servers started and found by pipeline/run/served.py's functions.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
from typing import Any, Callable, TypeVar

import pyarrow as pa

from batchgen.convert import ERROR, Source, results_as, source_of
from batchgen.jobs import GenerationDefaults, InvalidRow, Job, JobError, Location
from batchgen.jobs.checks import Checker
from batchgen.jobs.errors import BatchgenError, OptionError, keyword_option, option, option_names
from batchgen.jobs.params import CONSTRAINTS, PARAMS, constraint, split_fields
from batchgen.jobs.columns import CREATED, ORDER

# keyword options besides the generation parameters (jobs/params.py: PARAMS, CONSTRAINTS, aliases)
RUN_OPTIONS = ("prompt_template", "system", "min_shared_tokens", "max_batch_tokens", "output_format", "overwrite",
               "on_error", "adapters")
LOAD_OPTIONS = ("device", "dtype", "trust_remote_code", "threads")
# what a served call takes besides (`Engine.serve`, `Engine.connect`; `verify` is each call's)
SERVE_OPTIONS = ("vllm", "vllm_args", "concurrency", "retry_seconds")
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
             engine: str = "local", servers: Any = None, verify: int = 0, **options: Any) -> Any:
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

    On servers, as `batchgen process --engine vllm` / `--server URL` (docs/vllm.md): `engine="vllm"`
    starts `vllm serve` for this call (`vllm`: its executable, `vllm_args`: more arguments; `dtype`
    becomes its `--dtype`) and stops it when the call returns or raises; `servers=[url, ...]` uses
    running ones. `concurrency`, `retry_seconds` as the CLI's; `verify=K`: K greedy jobs run again
    on batchgen's own engine (the report is logged on the "batchgen" logger; `Engine.serve(...)`
    keeps it as `.verified`). No model loads here, only its tokenizer.
    """
    load = {k: options.pop(k) for k in LOAD_OPTIONS if k in options}
    serve = {k: options.pop(k) for k in SERVE_OPTIONS if k in options}
    if engine == "local" and servers is None:
        for name, given in (*serve.items(), ("verify", verify)):
            if name != "verify" or given:
                raise OptionError(name, "is an option of served runs: it needs engine='vllm' or servers=")
        return Engine.load(model, **load).generate(jobs, output=output, progress=progress, **options)
    opts = _served_call(options, verify)  # a bad option, or output, fails before a server starts
    if output is not None:
        from batchgen.pipeline.run.preflight import check_output

        check_output(output, opts.output_format, opts.overwrite, source_of(jobs).paths or ())
    for name in ("device", "threads"):  # what a server loads, and on what, is its own
        if name in load:
            raise OptionError(name, "means nothing to a server, which loads the model itself; drop it (for "
                                    "engine='vllm', pass vLLM's own flags in vllm_args=)")
    if servers is not None:
        if engine != "local":
            raise OptionError("servers", f"uses running servers, {option('engine', engine)} starts one; pick one")
        for name in ("vllm", "vllm_args"):
            if name in serve:
                raise OptionError(name, "is an option of the vLLM batchgen starts (engine='vllm'), not of servers=")
        if "dtype" in load:
            raise OptionError("dtype", "is the precision of a server batchgen starts (engine='vllm'); a running "
                                       "server's is its own: drop it")
        with Engine.connect(model, servers=servers, **load, **serve) as served:
            return served.generate(jobs, output=output, progress=progress, verify=verify, **options)
    with Engine.serve(model, engine=engine, **load, **serve) as served:
        return served.generate(jobs, output=output, progress=progress, verify=verify, **options)


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

    @classmethod
    @_keywords
    def serve(cls, model: str | None = None, *, engine: str = "vllm", vllm: str | None = None,
              vllm_args: Any = (), concurrency: int | None = None, retry_seconds: float = 120.0, dtype: str = "auto",
              trust_remote_code: bool = False) -> "ServedEngine":
        """Start `vllm serve` for `model` (as `batchgen process --engine vllm`) and keep it for
        repeated `generate` calls: a `ServedEngine`, whose `close()` (or the end of its `with`
        block) stops the server; the server never outlives this process."""
        from batchgen.pipeline.run.served import start_vllm

        if engine != "vllm":
            raise OptionError("engine", "must be 'local' (batchgen's own, in this process) or 'vllm' (a `vllm "
                                        "serve` batchgen starts)", engine)
        options = _served_options(model, engine="vllm", vllm=vllm, vllm_args=_vllm_args(vllm_args),
                                  concurrency=concurrency, retry_seconds=retry_seconds, dtype=dtype,
                                  trust_remote_code=trust_remote_code)
        label, source = _model_source(model)
        # no output file to sit next to: the log goes to a directory of its own (`log_path`; see close)
        logs = tempfile.mkdtemp(prefix="batchgen-vllm-")
        try:
            server = start_vllm(options, label, source, os.path.join(logs, "server"))
        except BaseException:  # nothing started (no executable, say): nothing to keep
            shutil.rmtree(logs, ignore_errors=True)
            raise
        try:
            return ServedEngine(options, server)  # the tokenizer loads while the server starts
        except BaseException:
            server.stop()
            raise

    @classmethod
    @_keywords
    def connect(cls, model: str | None = None, *, servers: Any, concurrency: int | None = None,
                retry_seconds: float = 120.0, trust_remote_code: bool = False) -> "ServedEngine":
        """Running OpenAI-compatible completions servers of `model` (vLLM, SGLang: as `batchgen
        process --server URL`), for repeated `generate` calls; `model` names their tokenizer."""
        urls = [servers] if isinstance(servers, str) else servers
        if not isinstance(urls, (list, tuple)) or not urls or not all(isinstance(u, str) and u for u in urls):
            raise OptionError("servers", "must be a list of server URLs, e.g. ['http://gpu1:8000']", servers)
        return ServedEngine(_served_options(model, servers=tuple(urls), concurrency=concurrency,
                                            retry_seconds=retry_seconds, trust_remote_code=trust_remote_code), None)

    @_keywords
    def generate(self, jobs: Any, *, output: str | None = None, progress: bool = False, **options: Any) -> Any:
        """As `batchgen.generate`, with this engine's model (loading options do not apply)."""
        return _generate(self, jobs, run_options(options), output, progress)

    @property
    def config(self) -> Any:
        return self.model.config

    def _executor(self, checked: Any, opts: Any, adapters: Any) -> tuple[Any, list[Any]]:
        """What computes this call's requests, and the requests in the order it takes them."""
        from batchgen.pipeline.run.executors import LocalExecutor

        if adapters.infos:  # the adapters this call's jobs use (index i + 1: infos[i])
            self.model.set_adapters(adapters.infos)
        return LocalExecutor(self.model, self.name, self.tokenizer.eos_token_ids, opts), checked.requests

    def _after(self, executor: Any, opts: Any) -> None:
        pass


class ServedEngine:
    """Completions servers kept for repeated `generate` calls (`Engine.serve`, `Engine.connect`):
    the model's tokenizer and config here (batchgen tokenizes and sends token ids), the model on
    the servers. `close()`, or the end of a `with` block, stops a server `Engine.serve` started."""

    def __init__(self, options: Any, server: Any) -> None:
        from batchgen.pipeline.model.load import load_config
        from batchgen.pipeline.run.adapters import Adapters
        from batchgen.pipeline.run.served import connect
        from batchgen.pipeline.text.tokenize import Tokenizer

        self.options, self._server = options, server
        self.name, source = _model_source(options.model)
        self.config = load_config(options.model, options.trust_remote_code, runs_here=False)
        self.tokenizer = Tokenizer.load(source, trust_remote_code=options.trust_remote_code)
        if server is not None:
            server.wait()
        self._servers, self.served_models, _, self._about = connect(options, self.name, server, lambda: False,
                                                                    Adapters.of((), self.config))
        self.urls = list(self._servers.urls)
        self.log_path = server.log_path if server is not None else None  # the started vLLM's log
        self.verified: dict[str, Any] | None = None  # the last call's verify report (verify=K)

    @_keywords
    def generate(self, jobs: Any, *, output: str | None = None, progress: bool = False, verify: int = 0,
                 **options: Any) -> Any:
        """As `batchgen.generate`, on these servers; `verify=K`: K greedy jobs also run on
        batchgen's own engine here (it loads the model), the report in `.verified`."""
        from dataclasses import replace

        if self._servers is None:
            raise BatchgenError("this served engine is closed; start another with Engine.serve() or Engine.connect()")
        opts = _served_call(options, verify)
        served = {k: getattr(self.options, k) for k in ("model", "dtype", "trust_remote_code", *_SERVED_FIELDS)}
        return _generate(self, jobs, replace(opts, **served, verify=verify), output, progress)

    @staticmethod
    def refuse_directory(label: str) -> str:
        """A job's adapter directory: a served engine here runs the base model only (for now)."""
        return ("adapters do not run on a served engine from the Python API yet; run them on batchgen's own "
                "engine, or with the CLI's vLLM engine, which serves them")

    def _executor(self, checked: Any, opts: Any, adapters: Any) -> tuple[Any, list[Any]]:
        from batchgen.pipeline.run.executors import ServedExecutor, groups_to_servers
        from batchgen.pipeline.run.inmemory import in_prefix_order
        from batchgen.pipeline.run.verify import Sample

        requests, server_of = [], lambda order: 0
        if checked.requests:
            requests, index, orders = in_prefix_order(checked)
            server_of = groups_to_servers(index, orders, len(self.urls), opts.min_shared_tokens)
        executor = ServedExecutor("vllm" if self._server is not None else "server", self._servers,
                                  self.served_models, server_of, dict(self._about), self.name,
                                  sample=Sample(opts.verify) if opts.verify else None)
        return executor, requests

    def _after(self, executor: Any, opts: Any) -> None:
        """`verify=K`: the sampled jobs on batchgen's own engine, agreement as the CLI's summary has it."""
        import logging

        from batchgen.pipeline.run.verify import verify

        if not opts.verify:
            return
        self.verified = v = verify(executor.sample, opts, self.tokenizer.eos_token_ids, _NeverStop)
        firsts = ", ".join(str(d["first_difference"]) for d in v["differ"][:10])
        logging.getLogger("batchgen").log(
            logging.WARNING if v["differ"] else logging.INFO,
            f"verify: {v['agree']}/{v['jobs']} greedy jobs agree token for token with batchgen's own engine"
            + (f"; the others first differ at token {firsts}" if v["differ"] else ""))

    def close(self, keep_log: bool = False) -> None:
        """Stop the server `Engine.serve` started (a connection's servers keep running), and remove
        its log unless `keep_log` (a `with` block that raised keeps it)."""
        servers, self._servers = self._servers, None
        if servers is not None:
            servers.close()
        if self._server is not None:
            self._server.stop()
            if not keep_log:
                shutil.rmtree(os.path.dirname(self._server.log_path), ignore_errors=True)

    def __enter__(self) -> "ServedEngine":
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.close(keep_log=kind is not None)


def _served_call(options: dict[str, Any], verify: Any) -> Any:
    """A served call's RunOptions from its keywords, with what servers cannot honour refused."""
    if not isinstance(verify, int) or isinstance(verify, bool) or verify < 0:
        raise OptionError("verify", "must be a whole number of jobs, 0 or more", verify)
    opts = run_options(options)
    if opts.adapters:
        raise OptionError("adapters", "do not run on a served engine from the Python API yet; run them on "
                                      "batchgen's own engine, or with the CLI's vLLM engine, which serves them")
    return opts


_SERVED_FIELDS = ("engine", "servers", *SERVE_OPTIONS)  # the RunOptions fields a served face keeps


class _NeverStop:
    """An API call is not stopped by signals (the CLI's StopOnSignal): KeyboardInterrupt ends it."""

    @staticmethod
    def requested() -> bool:
        return False


def _generate(face: Any, jobs: Any, opts: Any, output: str | None, progress: bool) -> Any:
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
        for order, completions in finished_jobs(executor.run(jobs, requests, _NeverStop.requested),
                                                checked.expected):
            done, failed = job_rows(order, jobs[order], completions, checked.tokenizer)
            rows += done
            errors += failed
            bar.update(1)
    # input order, as the runner's committed parts give them back (job_rows orders samples)
    return sorted(rows, key=lambda r: r[ORDER]), sorted(errors, key=lambda e: e[ORDER])


def _model_source(model: str | None) -> tuple[str, str]:
    from batchgen.pipeline.model.load import model_source

    return model_source(model)


def _served_options(model: str | None, **given: Any) -> Any:
    """The RunOptions a served face keeps: which model, where it is served, how it is reached."""
    from batchgen.pipeline.run.options import RunOptions

    for name, kinds, least, what in (("concurrency", int, 1, "a whole number of requests, 1"),
                                     ("retry_seconds", (int, float), 0, "a number of seconds, 0")):
        value = given[name]
        if value is None and name == "concurrency":  # the CLI's default (pipeline/serve/batching.py)
            continue
        if isinstance(value, bool) or not isinstance(value, kinds) or value < least:
            raise OptionError(name, f"must be {what} or more", value)
    if given.get("dtype", "auto") not in ("auto", "float32", "bfloat16", "float16"):
        raise OptionError("dtype", "must be one of auto, float32, bfloat16, float16", given["dtype"])
    if given.get("vllm") is not None and not isinstance(given["vllm"], (str, os.PathLike)):
        raise OptionError("vllm", "must be the path of the vllm executable", given["vllm"])
    if given.get("vllm") is not None:
        given["vllm"] = os.fspath(given["vllm"])
    # the server's own seed: the CLI's --seed default (each request carries its job's seed)
    return RunOptions(model=model, defaults=GenerationDefaults(seed=0), **given)


def _vllm_args(args: Any) -> tuple[str, ...]:
    """`vllm_args=["--max-model-len 4096", ...]`: each split as a shell would, as the CLI's --vllm-arg."""
    import shlex

    if isinstance(args, str):
        args = [args]
    if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        raise OptionError("vllm_args", "must be a list of `vllm serve` arguments, e.g. ['--max-model-len', '4096']",
                          args)
    return tuple(a for arg in args for a in shlex.split(arg))


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
