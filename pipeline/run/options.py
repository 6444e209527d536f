"""A run's options (`RunOptions`): what `process`, `validate`, `plan`, the Ray runner and the
Python API are told, and of those what decides the outputs' content (`run_settings`).

Below the runner, so that the modules it calls (preflight, inputrows, inmemory) read the options
without importing it. Each default is defined where it is used: the engine's batch budget and
shared-prefix threshold in engine/schedule.py, the window sizes in windows.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from batchgen.jobs import GenerationDefaults
from batchgen.pipeline.engine.schedule import MAX_BATCH_TOKENS, MIN_SHARED_TOKENS
from batchgen.pipeline.run.windows import WINDOW_JOBS, WINDOW_TOKENS

COMMIT_EVERY = 256  # jobs per committed part ...
COMMIT_SECONDS = 60.0  # ... or this long since the last commit, whichever first


@dataclass
class RunOptions:
    model: str | None = None  # None: the embedded default model
    device: str = "auto"
    dtype: str = "auto"
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    max_batch_tokens: int = MAX_BATCH_TOKENS
    min_shared_tokens: int = MIN_SHARED_TOKENS
    output_format: str = "parquet"
    overwrite: bool = False
    prompt_template: str | None = None
    system: str | None = None
    dataset: str | None = None
    split: str = "train"
    trust_remote_code: bool = False
    on_error: str = "skip"  # or "fail": stop before any generation if a job cannot run
    # or "ray" (pipeline/run/ray_runner.py), which refuses some jobs (inputrows.refusal), or "vllm": a
    # `vllm serve` that the run starts (pipeline/run/served.py)
    engine: str = "local"
    shard: str | None = None  # "I/N"
    commit_every: int = COMMIT_EVERY
    commit_seconds: float = COMMIT_SECONDS
    threads: int | None = None  # torch threads; None: one per core this process may use
    window_jobs: int = WINDOW_JOBS  # jobs per engine call (whole prefix groups; see windows.py) ...
    window_tokens: int = WINDOW_TOKENS  # ... and their prompt tokens
    # LoRA adapters: `--adapter` values, NAME=PATH (a name jobs select) or PATH (every job's default);
    # resolved and checked by pipeline/run/adapters.py
    adapters: tuple[str, ...] = ()
    # worker processes for `validate`'s and `plan`'s Python work on a big input (tokenizing plain
    # rows, planning windows: pipeline/run/workers.py); 0: none. The CLI gives one per core.
    workers: int = 0
    # end the run now (`batchgen serve`'s cancel and expiry): nothing more is generated; each job not
    # yet committed becomes an error row with this reason (jobs/openai_batch.NOT_RUN: its code and
    # message), and the output is written from what is committed. Not a setting: the committed work
    # it finishes is the same run's
    finish_now: str | None = None
    # completions servers instead of batchgen's engine (pipeline/run/served.py): running servers' URLs
    # (--server), or the vLLM that --engine vllm starts: its executable (None: BATCHGEN_VLLM, else
    # `vllm` on PATH) and extra `vllm serve` arguments
    servers: tuple[str, ...] = ()
    vllm: str | None = None
    vllm_args: tuple[str, ...] = ()
    concurrency: int | None = None  # requests in flight per server; None: serve/batching.py's choice
    retry_seconds: float = 120.0  # a server unreachable this long ends the run, resumable (exit 75)
    verify: int = 0  # greedy jobs run again on batchgen's own engine, compared token for token

    @property
    def served(self) -> bool:
        """Whether completions servers compute the jobs (--server, --engine vllm)."""
        return self.engine == "vllm" or bool(self.servers)


def run_settings(options: RunOptions, model_name: str, precision: dict[str, str],
                 adapters: dict[str, str] | None = None, model_files: str | None = None) -> dict[str, Any]:
    """What decides the outputs' content: finished work is resumed only under the same settings.
    `precision` is the resolved device type and dtype (what `auto` means depends on the checkpoint
    and the machine, so resumed work must not be judged by the option). Batch sizes do not count.
    `adapters`: each adapter label the jobs use, with its adapter's content digest (a retrained
    checkpoint in the same place is another adapter); the jobs' digest holds which job runs which.
    `model_files`: the model's identity (`batchgen.pipeline.model.identity`): a checkpoint rewritten
    in place is another model."""
    settings = {"model": model_name, "model_files": model_files, **precision, "defaults": asdict(options.defaults),
                "prompt_template": options.prompt_template, "system": options.system, "shard": options.shard,
                "output_format": options.output_format}
    if adapters:  # (the settings of runs without adapters stay what they were)
        settings["adapters"] = dict(sorted(adapters.items()))
    if options.served:  # another engine's output (a vLLM's, wherever it runs); local runs' settings as before
        settings["engine"] = "served"
    return settings
