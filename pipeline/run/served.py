"""`batchgen process` on completions servers: `--server URL` (running servers: vLLM, or any
OpenAI-compatible server that returns token ids) or `--engine vllm` (a `vllm serve` that the run
starts, on a free loopback port, and stops when it ends, on an error and on SIGTERM/SIGINT).

Everything around the engine is the runner's, as on batchgen's own engine: reading and checks,
tokenization (the server gets token ids), prefix-sorted windows, committed parts and exactly-once
resume, shards, every output format and the summary (which names the engine and holds the cached
tokens the server reports). No model loads here; `--verify K` loads batchgen's own afterwards.

A server that stays unreachable ends the run with exit 75, finished jobs committed (rerun the same
command to resume); a server that refuses one request (4xx) fails that job alone.

The Python API's served calls (batchgen/api.py: `Engine.serve`, `Engine.connect`) start and reach
their servers with the same functions (`start_vllm`, `connect`).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from typing import Any, Callable, Sequence

from batchgen.jobs import summary_path, write_summary
from batchgen.jobs.errors import BatchgenError, option
from batchgen.pipeline.run.executors import ServedExecutor, groups_to_servers
from batchgen.pipeline.run.options import RunOptions, run_settings
from batchgen.pipeline.run.preflight import check_inputs, check_options, check_output
from batchgen.pipeline.run.progress import Progress
from batchgen.pipeline.run.served_adapters import (Module, check_served, lora_arguments, missing, option_modules,
                                                    registered_names, served_names)
from batchgen.pipeline.run.signals import Preempted, StopOnSignal
from batchgen.pipeline.run.verify import Sample, verify
from batchgen.pipeline.serve.batching import SERVERS_IN_FLIGHT, given, in_flight
from batchgen.pipeline.serve.client import Servers, ServerUnreachable, served_models


def process_served(inputs: Sequence[str], output: str, options: RunOptions,
                   progress: Callable[[Progress], None] | None, *, mine_of: Callable, run_jobs: Callable
                   ) -> dict[str, Any]:
    """`runner.process` on servers; the runner hands its own pieces: which jobs this run generates
    (`mine_of`) and its writing half (`run_jobs`), the same as on batchgen's engine."""
    from batchgen.pipeline.model.load import load_config, model_source
    from batchgen.pipeline.run.parts import job_set_key, may_resume, read_manifest
    from batchgen.pipeline.run.sharding import parse_shard

    started = time.monotonic()
    with StopOnSignal() as stop, ExitStack() as cleanup:
        shard = parse_shard(options.shard)
        check_options(options)
        check_output(output, options.output_format, options.overwrite, inputs)
        label, source = model_source(options.model)
        if options.verify:  # batchgen's engine reruns a sample: a model it does not reproduce is refused now
            load_config(options.model, options.trust_remote_code)
        server, modules = None, []
        if options.engine == "vllm":  # it starts while the jobs are read and tokenized
            if options.adapters:  # with the adapters the options name (served_adapters.py)
                modules = option_modules(options.adapters, load_config(options.model, options.trust_remote_code,
                                                                       runs_here=False), taken=[label])
            server = cleanup.enter_context(start_vllm(options, label, source, output, modules))
        checked = check_inputs(list(inputs), options)
        cleanup.callback(checked.close)
        infos = checked.adapters.infos  # every adapter the jobs run with (index i + 1: infos[i])
        if server is not None and len(wanted := missing(modules, infos, taken=[label])) > len(modules):
            # jobs name adapter directories the options do not: the server starts again serving them
            # all (why not vLLM's runtime loading: served_adapters.py)
            server.stop()
            modules = wanted
            server = cleanup.enter_context(start_vllm(options, label, source, output, modules))
        mine = mine_of(checked, options, shard)
        report_invalid = shard is None or shard[0] == 0  # rows that cannot run: shard 0 reports them
        # the served model is its name: a run started with --engine vllm resumes on a --server
        # running the same model (whose files batchgen cannot see)
        settings = run_settings(options, label, {"device_type": "served", "dtype": options.dtype},
                                checked.adapters.digests())
        job_set = job_set_key(checked.digest, settings)
        key = f"{job_set}:{options.shard}"
        may_resume(output + ".parts", read_manifest(output + ".parts"), key, options.overwrite)
        if server is not None:
            server.wait(stop.requested)
            if stop.requested():
                raise Preempted("stopped by a signal before generation started; nothing was written; rerun the "
                                "same command")
        try:
            servers, names, adapter_names, about = connect(options, label, server, stop.requested, checked.adapters,
                                                           modules)
        except ServerUnreachable as e:
            raise Preempted(f"{e}; nothing was generated; rerun the same command") from None
        cleanup.callback(servers.close)
        server_of = groups_to_servers(checked.index, checked.orders, len(servers.urls), options.min_shared_tokens)
        executor = ServedExecutor("vllm" if server is not None else "server", servers, names, server_of, about, label,
                                  adapter_names, sample=Sample(options.verify) if options.verify else None)
        stop.defer()  # writing starts: a signal now stops between steps, after committing
        summary = run_jobs(output, options, checked, executor, settings, key, job_set, shard, mine, report_invalid,
                           started, stop, progress)
        if options.verify:  # the server is no longer needed: its memory goes before batchgen's model loads
            servers.close()
            if server is not None:
                server.stop()
            summary["verify"] = verify(executor.sample, options, checked.tokenizer.eos_token_ids, stop, infos)
            write_summary(summary_path(output), summary)
        return summary


def start_vllm(options: RunOptions, label: str, source: str, output: str, modules: Sequence[Module] = ()):
    """`vllm serve` for the run's options and LoRA `modules`, spawned (it loads while the caller
    reads the jobs; the caller `wait`s for it, and stops it: it is a context manager); its log is
    `output`.vllm.log."""
    server = _vllm_server(options, label, source, output, modules)
    server.spawn()
    return server


def connect(options: RunOptions, label: str, server: Any, should_stop: Callable[[], bool], adapters: Any,
            modules: Sequence[Module] = ()) -> tuple[Servers, list[str], list[str | None], dict[str, Any]]:
    """The client of the run's servers: the vLLM it started (`server`, healthy, serving `modules`)
    or the --server URLs; the name each serves the model under; the served name of each adapter
    the jobs use (`adapters`: the run's `Adapters`; a --server must list them); what the summary
    says of them. A --server that stays unreachable raises ServerUnreachable."""
    about: dict[str, Any] = {}
    if server is not None:
        urls, names, alive = [server.url], [server.served_name], server.down
        adapter_names = served_names(modules, adapters.infos)
        about.update(vllm_log=server.log_path, vllm_start_seconds=server.started_seconds)
    else:
        urls, alive = list(options.servers), None
        listed = [_listed(url, options.retry_seconds, should_stop) for url in urls]
        names = [_model_name(url, label, served) for url, served in zip(urls, listed)]
        adapter_names = registered_names(adapters)
        for url, name, served in zip(urls, names, listed):
            check_served(url, served, adapter_names, name)
    if adapter_names:
        about["served_adapters"] = adapter_names
    concurrency = options.concurrency or (in_flight(server.command) if server is not None else SERVERS_IN_FLIGHT)
    servers = Servers(urls, concurrency, retry_seconds=options.retry_seconds, alive=alive)
    about.update(servers=None if server is not None else urls, served_models=names, concurrency=concurrency)
    return servers, names, adapter_names, about


def _listed(url: str, retry_seconds: float, should_stop: Callable[[], bool]) -> dict[str, str | None]:
    """The model names a running server serves (`/v1/models`: its models, and its LoRA modules
    with their base model as parent). A server that stays unreachable for `retry_seconds` (or
    until `should_stop()`) raises ServerUnreachable: the CLI stops the run as when one goes away
    later, resumable (exit 75)."""
    began, delay = time.monotonic(), 0.5
    while True:
        try:
            return served_models(url)
        except ServerUnreachable:
            if time.monotonic() - began >= retry_seconds or should_stop():
                raise
            time.sleep(delay)
            delay = min(delay * 2, 8.0)


def _model_name(url: str, label: str, served: dict[str, str | None]) -> str:
    """The name a running server serves the model under: its only one, or the one named as --model
    (its LoRA modules are not models)."""
    names = [name for name, parent in served.items() if parent is None]
    if len(names) == 1:
        return names[0]
    if label in names:
        return label
    raise BatchgenError(f"{url} serves {names or 'no models'}; name the one to use with {option('model')} "
                        "(its tokenizer must be batchgen's too)")


def _vllm_server(options: RunOptions, label: str, source: str, output: str, modules: Sequence[Module] = ()):
    from batchgen.pipeline.serve.vllm_server import VllmServer, vllm_executable

    args = list(options.vllm_args)
    if options.dtype != "auto" and not given(args, "--dtype"):
        args += ["--dtype", options.dtype]
    if options.trust_remote_code:
        args.append("--trust-remote-code")
    # the user's own --vllm-arg come last in the command; lora_arguments leaves out the flags they give
    return VllmServer(vllm_executable(options.vllm), _vllm_model_dir(source), label, output + ".vllm.log",
                      lora_arguments(modules, options.vllm_args) + args, seed=options.defaults.seed)


def _vllm_model_dir(source: str) -> str:
    """The directory (or hub id) vLLM loads. A checkpoint converted from a GGUF keeps a
    `quantization_config` (quant_method gguf) over weights that are plain floats, which vLLM
    refuses ("Unknown quantization method"): it loads a twin directory of links without that key,
    in batchgen's cache (the default model is one)."""
    config_path = os.path.join(source, "config.json")
    if not os.path.isfile(config_path):
        return source  # a hub id: vLLM resolves it itself
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if (config.get("quantization_config") or {}).get("quant_method") != "gguf":
        return source
    from batchgen.pipeline.paths import cache_dir

    source = os.path.abspath(source)
    twin = os.path.join(cache_dir(), "vllm-models", source.strip(os.sep).replace(os.sep, "_"))
    os.makedirs(twin, exist_ok=True)
    for name in os.listdir(source):
        link = os.path.join(twin, name)
        if name != "config.json" and not os.path.lexists(link):
            os.symlink(os.path.join(source, name), link)
    config.pop("quantization_config")
    tmp = os.path.join(twin, f".config.json.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, os.path.join(twin, "config.json"))
    return twin
