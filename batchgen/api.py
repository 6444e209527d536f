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

from typing import TYPE_CHECKING, Any

from batchgen.calls import LOAD_OPTIONS, SERVE_OPTIONS, generate_on, keywords, run_options
from batchgen.jobs.errors import OptionError

if TYPE_CHECKING:
    from batchgen.served import ServedEngine


@keywords
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
    from batchgen.served import generate_served

    return generate_served(jobs, model, output, progress, engine, servers, verify, load, serve, options)


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
    @keywords
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
    @keywords
    def serve(cls, model: str | None = None, *, engine: str = "vllm", vllm: str | None = None,
              vllm_args: Any = (), concurrency: int | None = None, retry_seconds: float = 120.0, dtype: str = "auto",
              trust_remote_code: bool = False, adapters: dict[str, str] | None = None) -> "ServedEngine":
        """Start `vllm serve` for `model` (as `batchgen process --engine vllm`) and keep it for
        repeated `generate` calls: a `ServedEngine`, whose `close()` (or the end of its `with`
        block) stops the server; the server never outlives this process. `adapters`: {name: PEFT
        LoRA directory}, served as vLLM's LoRA modules; jobs name them in their `adapter` field."""
        from batchgen.served import start

        return start(model, engine, vllm, vllm_args, concurrency, retry_seconds, dtype, trust_remote_code, adapters)

    @classmethod
    @keywords
    def connect(cls, model: str | None = None, *, servers: Any, concurrency: int | None = None,
                retry_seconds: float = 120.0, trust_remote_code: bool = False,
                adapters: dict[str, str] | None = None) -> "ServedEngine":
        """Running OpenAI-compatible completions servers of `model` (vLLM, SGLang: as `batchgen
        process --server URL`), for repeated `generate` calls; `model` names their tokenizer.
        `adapters`: {name: directory} of the LoRA modules they serve under those names."""
        from batchgen.served import connect

        return connect(model, servers, concurrency, retry_seconds, trust_remote_code, adapters)

    @keywords
    def generate(self, jobs: Any, *, output: str | None = None, progress: bool = False, **options: Any) -> Any:
        """As `batchgen.generate`, with this engine's model (loading options do not apply)."""
        return generate_on(self, jobs, run_options(options), output, progress)

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
