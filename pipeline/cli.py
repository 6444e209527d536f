"""The `batchgen` command line. Library code raises its own errors; only this module turns them
into click errors with a non-zero exit."""
from __future__ import annotations

import json
import os
import shlex
import sys

import click

from batchgen.pipeline import __version__
from batchgen.pipeline.engine.schedule import MAX_BATCH_TOKENS, MIN_SHARED_TOKENS
from batchgen.pipeline.batchapi.batches import MAX_FILE_BYTES, MAX_REQUESTS

EXAMPLES = """
\b
Examples:
  batchgen process data/system_prompt.jsonl -o out/results.parquet
  batchgen process reviews.parquet --prompt-template "Rewrite politely: {text}" -o out.parquet
  batchgen process batch_input.jsonl -o batch_output.jsonl --output-format openai
"""


def _model_options(f):
    f = click.option("--model", envvar="BATCHGEN_MODEL", default=None, metavar="NAME_OR_PATH",
                     help="Hugging Face model id or local directory [default: embedded SmolLM2-135M-Instruct]")(f)
    f = click.option("--trust-remote-code", is_flag=True, envvar="BATCHGEN_TRUST_REMOTE_CODE",
                     help="Run the Python code that comes with the model (off unless asked; "
                          "BATCHGEN_TRUST_REMOTE_CODE=1 turns it on too): only for models you trust.")(f)
    f = click.option("--adapter", "adapters", multiple=True, envvar="BATCHGEN_ADAPTER", metavar="NAME=PATH|PATH",
                     help="A PEFT LoRA adapter directory: NAME=PATH registers a name that jobs select (their "
                          "adapter field, or an OpenAI body.model); PATH alone is the default of every job "
                          "(repeatable; BATCHGEN_ADAPTER holds them space-separated, each then without spaces). "
                          "A NAME is any text without '=', '/' or '\\'.")(f)
    return f


def _input_options(f):
    f = click.argument("inputs", nargs=-1, type=click.Path())(f)
    f = click.option("--dataset", default=None, help="A `datasets` dataset name to read (from the local cache).")(f)
    f = click.option("--split", default="train", show_default=True, help="Split of --dataset or a saved DatasetDict.")(f)
    f = click.option("--prompt-template", default=None, envvar="BATCHGEN_PROMPT_TEMPLATE",
                     help='Build prompts from columns, e.g. "Summarize: {text}".')(f)
    f = click.option("--system", default=None, envvar="BATCHGEN_SYSTEM",
                     help="System prompt: jobs become chat messages with it.")(f)
    return f


def _window_options(f):
    f = click.option("--window-jobs", type=click.IntRange(min=1), default=65536, show_default=True,
                     envvar="BATCHGEN_WINDOW_JOBS",
                     help="Jobs the engine holds at once (whole prefix groups; a larger group is cut).")(f)
    f = click.option("--window-tokens", type=click.IntRange(min=1), default=16_000_000, show_default=True,
                     envvar="BATCHGEN_WINDOW_TOKENS", help="Prompt tokens the engine holds at once.")(f)
    return f


# options of `process` that `validate` takes too: each changes which jobs a run refuses
_output_format_option = click.option("--output-format", type=click.Choice(["parquet", "jsonl", "openai"]),
                                     default="parquet", show_default=True, envvar="BATCHGEN_OUTPUT_FORMAT")
_engine_option = click.option("--engine", type=click.Choice(["local", "ray", "vllm"]), default="local",
                              show_default=True, envvar="BATCHGEN_ENGINE",
                              help="ray: spread prefix groups over a Ray cluster; OUTPUT is a directory. vllm: start "
                                   "`vllm serve` (see --vllm) and run the jobs on it.")


def _served_options(f):
    opts = [
        click.option("--server", "servers", multiple=True, metavar="URL",
                     help="A running OpenAI-compatible completions server that returns token ids (vLLM) to run the "
                          "jobs on, e.g. http://gpu1:8000 (repeatable: whole prefix groups go to one server each)."),
        click.option("--vllm", "vllm", default=None, metavar="PATH",
                     help="The vllm executable --engine vllm starts [default: BATCHGEN_VLLM, else `vllm` on PATH]."),
        click.option("--vllm-arg", "vllm_args", multiple=True, metavar="ARGS",
                     help="More `vllm serve` arguments, split as a shell would (repeatable), e.g. "
                          "--vllm-arg='--max-model-len 4096'."),
        click.option("--concurrency", type=click.IntRange(min=1), default=None,
                     help="Requests in flight per server, sent in prefix order [default: twice the max-num-seqs of "
                          "the vLLM that --engine vllm starts; 256 per --server]."),
        click.option("--retry-seconds", type=click.FloatRange(min=0), default=120.0, show_default=True,
                     help="How long a server may stay unreachable (connection errors, 429, 5xx, timeouts; retried "
                          "with backoff) before the run stops, resumable (exit 75)."),
        click.option("--verify", type=click.IntRange(min=0), default=0, show_default=True, metavar="K",
                     help="Run K greedy jobs again on batchgen's own engine and report token agreement."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


# options of `process` that `serve` takes too, as the defaults of the batches it runs
_device_option = click.option("--device", default="auto", show_default=True, envvar="BATCHGEN_DEVICE",
                              help="auto, cpu, cuda, cuda:N")
_dtype_option = click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
                             show_default=True, envvar="BATCHGEN_DTYPE",
                             help="auto: the checkpoint's own dtype where this device computes it natively, else "
                                  "float32")
_max_batch_tokens_option = click.option(
    "--max-batch-tokens", type=click.IntRange(min=1), default=MAX_BATCH_TOKENS, show_default=True,
    envvar="BATCHGEN_MAX_BATCH_TOKENS", help="KV-cache token budget of one batch (rows x longest row).")
_min_shared_tokens_option = click.option(
    "--min-shared-tokens", type=click.IntRange(min=1), default=MIN_SHARED_TOKENS, show_default=True,
    envvar="BATCHGEN_MIN_SHARED_TOKENS", help="Shorter shared prefixes are not cached separately.")
_commit_every_option = click.option(
    "--commit-every", type=click.IntRange(min=1), default=256, show_default=True, envvar="BATCHGEN_COMMIT_EVERY",
    help="Commit finished jobs in parts of this many (or every 60 s).")
_threads_option = click.option(
    "--threads", type=click.IntRange(min=1), default=None, envvar="BATCHGEN_THREADS",
    help="CPU threads [default: OMP_NUM_THREADS, else the cores this process may use (affinity and cgroup quota)].")


def _generation_options(f):
    opts = [
        click.option("--max-new-tokens", type=click.IntRange(min=0), default=256, show_default=True,
                     envvar="BATCHGEN_MAX_NEW_TOKENS",
                     help="Default for jobs without max_new_tokens (0: score the prompt only, with --prompt-logprobs)."),
        click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
                     envvar="BATCHGEN_TEMPERATURE", help="0 is greedy."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
                     envvar="BATCHGEN_TOP_P"),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, envvar="BATCHGEN_TOP_K"),
        click.option("--seed", type=int, default=0, show_default=True, envvar="BATCHGEN_SEED",
                     help="Run seed: jobs without a seed derive theirs from it and their id."),
        click.option("--n", "n", type=click.IntRange(min=1), default=1, show_default=True, envvar="BATCHGEN_N",
                     help="Samples per job."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--stop-token-id", "stop_token_ids", type=click.IntRange(min=0), multiple=True,
                     help="Token id that ends a sample, like EOS (repeatable)."),
        click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
                     envvar="BATCHGEN_REPETITION_PENALTY",
                     help="transformers' repetition penalty over prompt and output tokens; 1 is off."),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True,
                     envvar="BATCHGEN_PRESENCE_PENALTY", help="OpenAI's, in [-2, 2]; 0 is off."),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
                     envvar="BATCHGEN_FREQUENCY_PENALTY", help="OpenAI's, in [-2, 2]; 0 is off."),
        click.option("--min-tokens", type=click.IntRange(min=0), default=0, show_default=True,
                     envvar="BATCHGEN_MIN_TOKENS", help="New tokens before EOS or a stop token may end a sample."),
        click.option("--logprobs/--no-logprobs", default=False, show_default=True, envvar="BATCHGEN_LOGPROBS",
                     help="Default: each generated token's logprob (the model's raw distribution) in a logprobs column."),
        click.option("--top-logprobs", type=click.IntRange(0, 20), default=0, show_default=True,
                     envvar="BATCHGEN_TOP_LOGPROBS", metavar="K",
                     help="Default: the K most likely alternatives of each generated token (needs --logprobs)."),
        click.option("--prompt-logprobs/--no-prompt-logprobs", default=False, show_default=True,
                     envvar="BATCHGEN_PROMPT_LOGPROBS",
                     help="Default: each prompt token's logprob after the first, in a prompt_logprobs column."),
        click.option("--logit-bias", default=None, envvar="BATCHGEN_LOGIT_BIAS", metavar="JSON",
                     help='Added to token logits, OpenAI\'s shape: \'{"50256": -100}\'.'),
        click.option("--json-schema", default=None, envvar="BATCHGEN_JSON_SCHEMA", metavar="JSON_OR_FILE",
                     help="Default constraint: output is JSON of this schema (a JSON object, or a file holding one)."),
        click.option("--regex", default=None, envvar="BATCHGEN_REGEX",
                     help="Default constraint: output matches this regular expression."),
        click.option("--choice", "choices", multiple=True,
                     help="Default constraint: output is one of these strings (repeatable)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _defaults(kw):
    """The generation flags as the jobs' defaults, checked as a job's fields are: a bad value is a
    usage error of its flag (exit code 2), like the values click checks itself."""
    from batchgen.jobs import GenerationDefaults, JobValidationError

    schema = kw["json_schema"]
    if schema is not None and not schema.lstrip().startswith("{"):
        try:
            with open(schema, encoding="utf-8") as fh:  # a file holding the schema
                schema = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            raise _usage_error("json_schema", f"cannot read the file {schema}: {getattr(e, 'strerror', None) or e}")
    try:
        constraint = GenerationDefaults.constraint_of(json_schema=schema, regex=kw["regex"],
                                                      choice=list(kw["choices"]) or None)
        return GenerationDefaults(max_new_tokens=kw["max_new_tokens"], temperature=kw["temperature"],
                                  top_p=kw["top_p"], top_k=kw["top_k"], seed=kw["seed"], stop=tuple(kw["stop"]),
                                  n=kw["n"], repetition_penalty=kw["repetition_penalty"],
                                  presence_penalty=kw["presence_penalty"], frequency_penalty=kw["frequency_penalty"],
                                  min_tokens=kw["min_tokens"], logit_bias=kw["logit_bias"] or (),
                                  stop_token_ids=tuple(kw["stop_token_ids"]), logprobs=kw["logprobs"],
                                  top_logprobs=kw["top_logprobs"], prompt_logprobs=kw["prompt_logprobs"],
                                  constraint=constraint)
    except JobValidationError as e:  # field 'logit_bias.5' -> --logit-bias
        raise _usage_error((e.field or "").split(".")[0].split("[")[0], f"'{e.field}' {e.reason}") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchgen")
def main() -> None:
    """batchgen: batch LLM generation that prefills each shared token prefix once.

    \b
    Example:
      batchgen process data/system_prompt.jsonl -o out/results.parquet
    """


@main.command(epilog=EXAMPLES)
@_input_options
@click.option("-o", "--output", required=True, type=click.Path(), envvar="BATCHGEN_OUTPUT",
              help="Output file (.parquet, or .jsonl with --output-format jsonl/openai).")
@_model_options
@_device_option
@_dtype_option
@_generation_options
@_max_batch_tokens_option
@_min_shared_tokens_option
@_output_format_option
@click.option("--overwrite", is_flag=True,
              help="Replace an existing output, and discard unfinished work of a run with other options.")
@click.option("--on-error", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
              envvar="BATCHGEN_ON_ERROR",
              help="skip: run every valid job, bad ones go to OUTPUT.errors.parquet; fail: stop before any "
                   "generation and list the problems.")
@click.option("--shard", default=None, metavar="I/N", envvar="BATCHGEN_SHARD",
              help="Process shard I of N (prefix-aware: jobs sharing a prefix share a shard); "
                   "join the outputs with `batchgen merge`.")
@_commit_every_option
@_engine_option
@_served_options
@click.option("--address", default=None, envvar="BATCHGEN_RAY_ADDRESS",
              help="Ray cluster address (auto, ray://host:10001); default: start a local Ray for this run.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, envvar="BATCHGEN_WORKERS",
              help="Ray actors, one model each.")
@click.option("--gpus-per-worker", type=click.FloatRange(min=0), default=0.0, show_default=True,
              envvar="BATCHGEN_GPUS_PER_WORKER")
@click.option("--progress-every", type=click.FloatRange(min=0), default=30.0, show_default=True,
              envvar="BATCHGEN_PROGRESS_EVERY", metavar="SECONDS",
              help="When stderr is not a terminal (logs), print a progress line this often.")
@_threads_option
@_window_options
def process(inputs, output, model, trust_remote_code, adapters, device, dtype, max_batch_tokens, min_shared_tokens,
            output_format, overwrite, on_error, shard, commit_every, engine, servers, vllm, vllm_args, concurrency,
            retry_seconds, verify, address, workers, gpus_per_worker, progress_every, threads, window_jobs, window_tokens, dataset,
            split, prompt_template, system, **gen):
    """Generate completions for every job in INPUTS and write them to OUTPUT in input order.

    INPUTS are JSONL (optionally .gz/.zst), Parquet, directories of part files, `datasets`
    save_to_disk directories, or OpenAI Batch API files (auto-detected).

    Finished jobs are committed in OUTPUT.parts/ as they complete: after a crash, rerun the same
    command to resume. On SIGTERM/SIGINT the run commits what is finished and exits with code 75.
    """
    from batchgen.pipeline.run.progress import ProgressReport
    from batchgen.pipeline.run.options import RunOptions
    from batchgen.pipeline.run.runner import process as run_process
    from batchgen.pipeline.run.signals import PREEMPTED_EXIT_CODE, Preempted

    _quiet_hub_progress()

    options = RunOptions(model=model, device=device, dtype=dtype, defaults=_guard(_defaults, gen),
                         max_batch_tokens=max_batch_tokens, min_shared_tokens=min_shared_tokens,
                         output_format=output_format, overwrite=overwrite, prompt_template=prompt_template,
                         system=system, dataset=dataset, split=split, trust_remote_code=trust_remote_code,
                         on_error=on_error, shard=shard, commit_every=commit_every, threads=threads,
                         window_jobs=window_jobs, window_tokens=window_tokens, engine=engine,
                         adapters=tuple(adapters), servers=tuple(servers), vllm=vllm,
                         vllm_args=tuple(a for arg in vllm_args for a in shlex.split(arg)), concurrency=concurrency,
                         retry_seconds=retry_seconds, verify=verify)
    if engine == "ray":
        from batchgen.pipeline.run.ray_runner import process_ray

        summary = _guard(process_ray, list(inputs), output, options, address=address, workers=workers,
                         gpus_per_worker=gpus_per_worker)
        click.echo(f"{summary['completed']}/{summary['jobs']} jobs done on Ray ({workers} workers){_resumed(summary)}, "
                   f"{summary['failed']} failed; {_prefill(summary)} in "
                   f"{summary['wall_seconds']:.1f}s -> {output}/", err=True)
        return
    report = ProgressReport(every=progress_every, stream=click.get_text_stream("stderr"))
    try:
        summary = _guard(run_process, list(inputs), output, options, progress=report.update)
    except Preempted as e:
        report.close()
        click.echo(f"batchgen: {e}", err=True)
        sys.exit(PREEMPTED_EXIT_CODE)
    report.close()
    click.echo(
        f"{summary['completed']}/{summary['jobs']} jobs done{_resumed(summary)}, {summary['failed']} failed; "
        f"{_prefill(summary)} ({summary['prefill_saving']:.0%} saved); {summary['run_completion_tokens']} new "
        f"tokens in {summary['wall_seconds']:.1f}s -> {output}", err=True)
    if summary["failed"]:
        click.echo(f"errors: {summary['errors_file']}", err=True)
    if summary.get("verify"):
        v = summary["verify"]
        firsts = ", ".join(str(d["first_difference"]) for d in v["differ"][:10])
        click.echo(f"verify: {v['agree']}/{v['jobs']} greedy jobs agree token for token with batchgen's own engine"
                   + (f"; the others first differ at token {firsts}" if v["differ"] else ""), err=True)
    if summary.get("kernels_build_error"):
        why = summary["kernels_build_error"].splitlines()[0][:200]  # its first line (stripped: never empty)
        click.echo(f"batchgen: note: the compiled CPU kernels could not be built ({why}); the work ran on "
                   "PyTorch's kernels instead, with the same results but slower. A C compiler (`cc`, or the one "
                   "$CC names) gives the fast path.", err=True)


def _resumed(summary: dict) -> str:
    """The rows earlier runs finished, where this run resumed some."""
    return f" ({summary['resumed_jobs']} by earlier runs)" if summary.get("resumed_jobs") else ""


def _prefill(summary: dict) -> str:
    """This run's prefill over its own jobs' prompt tokens: after a resume, all runs' work (redone
    work included) over all the output's prompts mixed two things and could read as a negative saving."""
    prefilled = summary["prefill_tokens"] - summary["resumed_work"]["prefill_tokens"]
    ran = f"{prefilled} of {summary['run_prompt_tokens']} prompt tokens"
    return f"this run: prefill {ran}" if summary.get("resumed_jobs") else f"prefill {ran}"


@main.command(epilog="\b\nExample:\n  batchgen plan data/fewshot.jsonl --min-shared-tokens 8")
@_input_options
@_model_options
@_generation_options
@click.option("--min-shared-tokens", type=click.IntRange(min=1), default=MIN_SHARED_TOKENS, show_default=True,
              envvar="BATCHGEN_MIN_SHARED_TOKENS")
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=MAX_BATCH_TOKENS, show_default=True,
              envvar="BATCHGEN_MAX_BATCH_TOKENS")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True, help="How many groups to list.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@_window_options
def plan(inputs, model, trust_remote_code, adapters, dataset, split, prompt_template, system, min_shared_tokens,
         max_batch_tokens, top, as_json, window_jobs, window_tokens, **gen):
    """Show how INPUTS share prefixes and the predicted prefill saving (tokenizer only, no model)."""
    from batchgen.pipeline.run.planning import describe
    from batchgen.pipeline.run.workers import worker_count

    report = _guard(describe, list(inputs), _guard(_defaults, gen), model=model, dataset=dataset, split=split,
                    prompt_template=prompt_template, system=system, min_shared_tokens=min_shared_tokens,
                    max_batch_tokens=max_batch_tokens, top=top, trust_remote_code=trust_remote_code,
                    window_jobs=window_jobs, window_tokens=window_tokens, adapters=tuple(adapters),
                    workers=worker_count())
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"jobs: {report['jobs']} ({report['invalid']} invalid)   groups: {report['groups']}   "
               f"shared prefixes: {report['shared_prefixes']}   batches: {report['batches']}   "
               f"windows: {report['windows']}" + (f" ({report['split_groups']} groups cut)" if report['split_groups'] else ""))
    click.echo(f"prompt tokens: {report['prompt_tokens']}   prefill tokens: {report['prefill_tokens']}   "
               f"cached tokens: {report['cached_tokens']}   saving: {report['prefill_saving']:.1%}   "
               f"(radix-tree bound: {report['lower_bound']})")
    if report.get("conversations"):
        click.echo(f"conversations: {report['conversations']}   turns: {report['turns']}   later turns prefill at "
                   f"least: {report['later_turn_prefill_tokens']}   expected prefill tokens: "
                   f"{report['expected_prefill_tokens']} (the first turns' above, plus that; replies are decoded, "
                   "never prefilled again)")
    for a in report.get("adapters", []):  # groups never span adapters: each has its own
        click.echo(f"adapter {a['adapter'] if a['adapter'] is not None else '(base model)'}: {a['jobs']} jobs   "
                   f"groups: {a['groups']}   prompt tokens: {a['prompt_tokens']}")
    if report["top_groups"]:
        click.echo("top groups (jobs x shared prefix tokens):")
        for g in report["top_groups"]:
            where = f"   adapter: {g['adapter'] if g['adapter'] is not None else '(base model)'}" \
                if "adapter" in g else ""
            click.echo(f"  {g['jobs']:>7} jobs x {g['prefix_tokens']:>6} tokens   nested prefixes: {g['nested']}"
                       f"{where}   e.g. {g['example']!r}")


@main.command(epilog="\b\nExample:\n  batchgen validate data/*.jsonl")
@_input_options
@_model_options
@_generation_options
@_output_format_option
@_engine_option
@click.option("--server", "servers", multiple=True, metavar="URL",
              help="The running server(s) `process --server` will use: the adapters the jobs name must be "
                   "among the models it lists.")
def validate(inputs, model, trust_remote_code, adapters, dataset, split, prompt_template, system, output_format,
             engine, servers, **gen):
    """Check every job in INPUTS exactly as `process` does before it generates (rows, carried
    columns, tokenization and the model's context window, LoRA adapters; the tokenizer, the
    config and the adapters' headers only, no weights) and report every problem with its file:line. Pass the --output-format, --engine
    and --server that `process` will run with: they refuse jobs of their own (a scoring job under openai or ray;
    on a --server, an adapter it does not serve)."""
    from batchgen.pipeline.run.preflight import check_inputs
    from batchgen.pipeline.run.options import RunOptions
    from batchgen.pipeline.run.workers import worker_count

    options = RunOptions(model=model, defaults=_guard(_defaults, gen), prompt_template=prompt_template, system=system,
                         dataset=dataset, split=split, trust_remote_code=trust_remote_code,
                         output_format=output_format, engine=engine, adapters=tuple(adapters),
                         servers=tuple(servers), workers=worker_count())
    checked = _guard(check_inputs, list(inputs), options, purpose="validate")
    if servers:  # as `process --server` does at its start
        from batchgen.pipeline.run.served_adapters import check_servers

        _guard(check_servers, servers, checked.adapters)
    for line in checked.invalid.lines():
        click.echo(line)
    click.echo(f"{checked.total} jobs checked, {len(checked.invalid)} with problems", err=True)
    if checked.invalid:
        sys.exit(1)


@main.command(epilog="\b\nExample:\n  batchgen merge out/shard-*.parquet -o out/all.parquet")
@click.argument("shards", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(), help="The merged Parquet file.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output.")
def merge(shards, output, overwrite):
    """Join the outputs of `process --shard I/N` runs in input order, checking that every job of
    the input is present exactly once (in an output or an errors file)."""
    from batchgen.pipeline.run.sharding import merge as run_merge

    summary = _guard(run_merge, list(shards), output, overwrite)
    click.echo(f"merged {summary['shards']} shards: {summary['completed']} jobs done, {summary['failed']} failed "
               f"-> {output}", err=True)


@main.command(epilog="\b\nExample:\n  batchgen serve --data serve-data --model HuggingFaceTB/SmolLM2-135M-Instruct")
@click.option("--host", default="127.0.0.1", show_default=True, envvar="BATCHGEN_SERVE_HOST",
              help="Address to listen on; other than loopback only with an API key.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, envvar="BATCHGEN_SERVE_PORT")
@click.option("--data", required=True, type=click.Path(file_okay=False), envvar="BATCHGEN_SERVE_DATA",
              help="Directory of the service's state: SQLite, uploaded files, batches' runs and outputs.")
@click.option("--api-key", default=None, envvar="BATCHGEN_API_KEY",
              help="Every request must send Authorization: Bearer KEY (without a key: loopback only).")
@click.option("--max-file-bytes", type=click.IntRange(min=1), default=MAX_FILE_BYTES, show_default=True,
              envvar="BATCHGEN_SERVE_MAX_FILE_BYTES", help="Largest upload and batch input (the Batch API's 200 MB).")
@click.option("--max-requests", type=click.IntRange(min=1), default=MAX_REQUESTS, show_default=True,
              envvar="BATCHGEN_SERVE_MAX_REQUESTS", help="Most requests in one batch (the Batch API's).")
@_model_options
@_device_option
@_dtype_option
@_generation_options
@_max_batch_tokens_option
@_min_shared_tokens_option
@_commit_every_option
@_threads_option
@_window_options
def serve(host, port, data, api_key, max_file_bytes, max_requests, model, trust_remote_code, adapters, device, dtype,
          max_batch_tokens, min_shared_tokens, commit_every, threads, window_jobs, window_tokens, **gen):
    """Serve OpenAI's Batch and Files API on your own model: upload a JSONL file, create a batch,
    poll it, download its output and error files, with the `openai` client unchanged but for
    base_url. Batches run one at a time, in creation order, through `process` (its checks,
    committed parts and resume: kill the server at any moment and start it again on the same
    --data, and every batch continues). The run options are every batch's defaults."""
    from batchgen.pipeline.run.options import RunOptions
    from batchgen.pipeline.batchapi.app import serve as run_serve
    from batchgen.pipeline.batchapi.config import ServeConfig

    _quiet_hub_progress()
    options = RunOptions(model=model, device=device, dtype=dtype, defaults=_guard(_defaults, gen),
                         max_batch_tokens=max_batch_tokens, min_shared_tokens=min_shared_tokens,
                         trust_remote_code=trust_remote_code, commit_every=commit_every, threads=threads,
                         window_jobs=window_jobs, window_tokens=window_tokens, adapters=tuple(adapters),
                         output_format="openai")
    _guard(run_serve, ServeConfig(data=data, options=options, host=host, port=port, api_key=api_key,
                                  max_file_bytes=max_file_bytes, max_requests=max_requests))


def script() -> None:
    """The `batchgen` console script: `main`, then an exit that skips tearing the interpreter down.
    After the output is written and closed, freeing torch's and transformers' modules and every
    object one by one took about 1 s of a 22 s job here; the operating system reclaims the memory
    at once. Exit handlers (Ray's shutdown, logging's flush) still run."""
    import atexit

    _arrow_without_pandas(sys.argv[1:])
    try:
        main()  # click's standalone mode: always ends in SystemExit
        code = 0
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`batchgen plan ... | head`), a closed stream
            pass
    os._exit(code or 0)


def _arrow_without_pandas(argv: list[str]) -> None:
    """pyarrow imports pandas on its first conversion of a Python list, to ask whether the list is a
    pandas object: a cost paid before the first forward of every run, which hands pyarrow no
    pandas objects. In the `batchgen` process itself (`script`, never a caller's), pyarrow's
    one look for pandas is made to fail, so lists stay lists; and as soon as anything imports
    pandas (a `datasets` input, Ray Data), pyarrow is made to look again, so from then on it is
    the pyarrow of a process with pandas, as before."""
    if not argv or argv[0] not in ("process", "plan", "validate", "merge") or "pandas" in sys.modules:
        return
    import importlib.machinery

    import pyarrow as pa

    class NoPandas:  # a finder that says pandas is not installed
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "pandas":
                raise ImportError("pandas is not looked for here")

    class PandasWatch:  # a finder that, once pandas is imported, has pyarrow look again
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != "pandas":
                return None
            sys.meta_path.remove(PandasWatch)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module):
                    run(module)
                    pa.lib._pandas_api.pd  # noqa: B018 - the shim's `pd` imports pandas again, now found

                spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, NoPandas)
    try:
        pa.array([])
    finally:
        sys.meta_path.remove(NoPandas)
    sys.meta_path.insert(0, PandasWatch)


def _quiet_hub_progress() -> None:
    """Our own bar reports progress; logs stay quiet: transformers' and huggingface_hub's progress
    bars off. Said through huggingface_hub's environment variable (which transformers' bars follow
    when it is imported), so a run that never needs transformers never imports it."""
    if "huggingface_hub" in sys.modules or "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    else:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _guard(fn, *args, **kwargs):
    """Call library code; its own errors (BatchgenError, one base class) become a clean CLI error:
    a bad option value a usage error (exit code 2), any other one line (exit code 1). Anything
    else is a bug and shows its traceback."""
    from batchgen.pipeline.errors import BatchgenError, OptionError

    try:
        return fn(*args, **kwargs)
    except OptionError as e:
        value = "" if e.value is None else f"{e.value}: "
        raise _usage_error(e.name, value + e.reason) from e
    except BatchgenError as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:  # the file system's, not a bug: what the library did not word itself, still one line
        where = f"{e.filename}: " if e.filename else ""
        raise click.ClickException(f"{where}{e.strerror or e}; check that path and rerun") from e


def _usage_error(name: str, message: str) -> click.BadParameter:
    """A bad value of option `name` (its keyword spelling) as click words its own: exit code 2."""
    from batchgen.jobs.errors import cli_flag

    hint = "'-o' / '--output'" if name == "output" else f"'{cli_flag(name)}'"
    return click.BadParameter(message, ctx=click.get_current_context(silent=True), param_hint=hint)
