"""The Python API on servers: `batchgen.ServedEngine`, what `Engine.serve` (a `vllm serve` that
batchgen starts) and `Engine.connect` (running OpenAI-compatible servers) return, and what
`batchgen.generate(engine="vllm")` / `generate(servers=[...])` use for one call. A call runs as on
batchgen's own engine (calls.py), with `ServedExecutor` in place of the engine; the servers are
started and reached by pipeline/run/served.py's functions, as the CLI's are.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Mapping

from batchgen.calls import (SERVE_OPTIONS, NeverStop, adapter_specs, generate_on, keywords, model_source_of,
                            run_options)
from batchgen.jobs import GenerationDefaults
from batchgen.jobs.errors import BatchgenError, OptionError

class ServedEngine:
    """Completions servers kept for repeated `generate` calls (`Engine.serve`, `Engine.connect`):
    the model's tokenizer and config here (batchgen tokenizes and sends token ids), the model on
    the servers. `close()`, or the end of a `with` block, stops a server `Engine.serve` started."""

    def __init__(self, options: Any, server: Any, modules: Any = ()) -> None:
        from batchgen.pipeline.model.load import load_config
        from batchgen.pipeline.run.adapters import Adapters
        from batchgen.pipeline.run.served import connect
        from batchgen.pipeline.text.tokenize import Tokenizer

        self.options, self._server, self.modules = options, server, list(modules)
        self.name, source = model_source_of(options.model)
        self.config = load_config(options.model, options.trust_remote_code, runs_here=False)
        self.tokenizer = Tokenizer.load(source, trust_remote_code=options.trust_remote_code)
        if server is not None:
            server.wait()
        # every adapter given, resolved now, so that a running server is checked for all of them
        given = Adapters.of(options.adapters, self.config, refuse_directory=self.refuse_directory)
        for name in given.names:
            given.index(name)
        self._servers, self.served_models, _, self._about = connect(options, self.name, server, lambda: False,
                                                                    given, self.modules)
        self.urls = list(self._servers.urls)
        self.log_path = server.log_path if server is not None else None  # the started vLLM's log
        self.verified: dict[str, Any] | None = None  # the last call's verify report (verify=K)

    @keywords
    def generate(self, jobs: Any, *, output: str | None = None, progress: bool = False, verify: int = 0,
                 **options: Any) -> Any:
        """As `batchgen.generate`, on these servers; `verify=K`: K greedy jobs also run on
        batchgen's own engine here (it loads the model), the report in `.verified`."""
        from dataclasses import replace

        if self._servers is None:
            raise BatchgenError("this served engine is closed; start another with Engine.serve() or Engine.connect()")
        opts = served_call(options, verify)
        served = {k: getattr(self.options, k) for k in ("model", "dtype", "trust_remote_code", *SERVED_FIELDS)}
        return generate_on(self, jobs, replace(opts, **served, verify=verify), output, progress)

    def refuse_directory(self, label: str) -> str | None:
        """A job's adapter given as a directory: one this engine serves (`Engine.serve`'s
        adapters; a running server knows adapters by name only), else why it cannot run."""
        from batchgen.pipeline.run.served_adapters import directory_refusal

        if self._server is None:
            from batchgen.pipeline.run.adapters import parse_specs

            return directory_refusal(parse_specs(self.options.adapters)[0])(label)
        if os.path.abspath(label) in {m.path for m in self.modules}:
            return None
        return (f"{label!r} is not an adapter this served engine serves; give it to Engine.serve(adapters=...) "
                "to serve it")

    def _executor(self, checked: Any, opts: Any, adapters: Any) -> tuple[Any, list[Any]]:
        from batchgen.pipeline.run.executors import ServedExecutor, groups_to_servers
        from batchgen.pipeline.run.inmemory import in_prefix_order
        from batchgen.pipeline.run.verify import Sample

        requests, server_of = [], lambda order: 0
        if checked.requests:
            requests, index, orders = in_prefix_order(checked)
            server_of = groups_to_servers(index, orders, len(self.urls), opts.min_shared_tokens)
        from batchgen.pipeline.run.served_adapters import registered_names, served_names

        names = served_names(self.modules, adapters.infos) if self._server is not None else registered_names(adapters)
        executor = ServedExecutor("vllm" if self._server is not None else "server", self._servers,
                                  self.served_models, server_of, dict(self._about), self.name, names,
                                  sample=Sample(opts.verify) if opts.verify else None)
        return executor, requests

    def _after(self, executor: Any, opts: Any) -> None:
        """`verify=K`: the sampled jobs on batchgen's own engine, agreement as the CLI's summary has it."""
        import logging

        from batchgen.pipeline.run.verify import verify

        if not opts.verify:
            return
        self.verified = v = verify(executor.sample, opts, self.tokenizer.eos_token_ids, NeverStop)
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


def served_call(options: dict[str, Any], verify: Any) -> Any:
    """A served call's RunOptions from its keywords, with what servers cannot honour refused."""
    if not isinstance(verify, int) or isinstance(verify, bool) or verify < 0:
        raise OptionError("verify", "must be a whole number of jobs, 0 or more", verify)
    opts = run_options(options)
    if opts.adapters:
        raise OptionError("adapters", "of a served engine are those it serves: give them to Engine.serve() or "
                                      "Engine.connect()")
    return opts


# the RunOptions fields a served face keeps
SERVED_FIELDS = ("engine", "servers", "adapters", *SERVE_OPTIONS)


def served_options(model: str | None, **given: Any) -> Any:
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


def vllm_args_of(args: Any) -> tuple[str, ...]:
    """`vllm_args=["--max-model-len 4096", ...]`: each split as a shell would, as the CLI's --vllm-arg."""
    import shlex

    if isinstance(args, str):
        args = [args]
    if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        raise OptionError("vllm_args", "must be a list of `vllm serve` arguments, e.g. ['--max-model-len', '4096']",
                          args)
    return tuple(a for arg in args for a in shlex.split(arg))


def generate_served(jobs: Any, model: str | None, output: str | None, progress: bool, engine: str, servers: Any,
                    verify: Any, load: dict[str, Any], serve: dict[str, Any], options: dict[str, Any]) -> Any:
    """`batchgen.generate(engine="vllm")` or `generate(servers=[...])`: a `ServedEngine` for this
    call, closed when it returns or raises; `adapters` are the engine's, served for the call."""
    from batchgen.convert import source_of
    from batchgen.jobs.errors import option

    adapters = options.pop("adapters", None)
    opts = served_call(options, verify)  # a bad option, or output, fails before a server starts
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
        served = connect(model, servers, serve.get("concurrency"), serve.get("retry_seconds", 120.0),
                         load.get("trust_remote_code", False), adapters)
    else:
        served = start(model, engine, serve.get("vllm"), serve.get("vllm_args", ()), serve.get("concurrency"),
                       serve.get("retry_seconds", 120.0), load.get("dtype", "auto"),
                       load.get("trust_remote_code", False), adapters)
    with served:
        return served.generate(jobs, output=output, progress=progress, verify=verify, **options)


def start(model: str | None, engine: str, vllm: Any, vllm_args: Any, concurrency: Any, retry_seconds: Any,
          dtype: str, trust_remote_code: bool, adapters: Mapping[str, str] | None) -> ServedEngine:
    """`Engine.serve`: `vllm serve` started for `model`, with `adapters` as its LoRA modules."""
    from batchgen.pipeline.model.load import load_config
    from batchgen.pipeline.run.served import start_vllm
    from batchgen.pipeline.run.served_adapters import option_modules

    if engine != "vllm":
        raise OptionError("engine", "must be 'local' (batchgen's own, in this process) or 'vllm' (a `vllm "
                                    "serve` batchgen starts)", engine)
    specs = adapter_specs(adapters) if adapters else ()
    options = served_options(model, engine="vllm", vllm=vllm, vllm_args=vllm_args_of(vllm_args),
                             concurrency=concurrency, retry_seconds=retry_seconds, dtype=dtype,
                             trust_remote_code=trust_remote_code, adapters=specs)
    label, source = model_source_of(model)
    modules = option_modules(specs, load_config(model, trust_remote_code, runs_here=False), taken=[label]) \
        if specs else []
    # no output file to sit next to: the log goes to a directory of its own (`log_path`; see close)
    logs = tempfile.mkdtemp(prefix="batchgen-vllm-")
    try:
        server = start_vllm(options, label, source, os.path.join(logs, "server"), modules)
    except BaseException:  # nothing started (no executable, say): nothing to keep
        shutil.rmtree(logs, ignore_errors=True)
        raise
    try:
        return ServedEngine(options, server, modules)  # the tokenizer loads while the server starts
    except BaseException:
        server.stop()
        raise


def connect(model: str | None, servers: Any, concurrency: Any, retry_seconds: Any, trust_remote_code: bool,
            adapters: Mapping[str, str] | None) -> ServedEngine:
    """`Engine.connect`: running servers of `model`; `adapters` the LoRA modules they serve by name."""
    urls = [servers] if isinstance(servers, str) else servers
    if not isinstance(urls, (list, tuple)) or not urls or not all(isinstance(u, str) and u for u in urls):
        raise OptionError("servers", "must be a list of server URLs, e.g. ['http://gpu1:8000']", servers)
    specs = adapter_specs(adapters) if adapters else ()
    return ServedEngine(served_options(model, servers=tuple(urls), concurrency=concurrency,
                                       retry_seconds=retry_seconds, trust_remote_code=trust_remote_code,
                                       adapters=specs), None)
