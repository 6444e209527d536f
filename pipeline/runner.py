"""One `batchgen process` run: read jobs, tokenize, run the engine, write results in input order.

Dicts exist only at the edges (job rows in, result rows out); everything between is dataclasses.
"""
from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from jobs import (ErrorWriter, GenerationDefaults, InvalidRow, Job, errors_path, id_type_for,
                  infer_extra_schema, input_schema, open_result_writer, read_jobs, result_schema,
                  summary_path, write_summary)
from pipeline.tokenize import Tokenizer, TokenizerError
from pipeline.types import Completion, Request, RunStats, SamplingParams


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


def to_requests(
    jobs: Sequence[Job], tokenizer: Tokenizer, window: int | None, run_seed: int | None
) -> tuple[list[Request], list[InvalidRow]]:
    """Tokenize each job whole; a job that cannot run becomes an error row, never a crash."""
    requests, invalid = [], []
    for index, job in enumerate(jobs):
        try:
            ids = tokenizer.encode_messages(job.messages) if job.is_chat else tokenizer.encode_prompt(job.prompt)
        except TokenizerError as e:
            invalid.append(InvalidRow(job.location, job.id, str(e)))
            continue
        if not ids:
            invalid.append(InvalidRow(job.location, job.id, "the prompt tokenizes to no tokens"))
            continue
        if window is not None and len(ids) + job.max_new_tokens > window:
            invalid.append(InvalidRow(
                job.location, job.id,
                f"prompt of {len(ids)} tokens + max_new_tokens {job.max_new_tokens} exceeds the model's "
                f"context window of {window}; shorten the prompt or lower max_new_tokens"))
            continue
        params = SamplingParams(
            max_new_tokens=job.max_new_tokens, temperature=job.temperature, top_p=job.top_p,
            top_k=job.top_k, seed=job.seed if job.seed is not None else job_seed(run_seed, job.id), n=job.n,
        )
        requests.append(Request(index, ids, params, tokenizer.stop_check(job.stop)))
    return requests, invalid


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
            "endpoint": job.openai_endpoint,
        })
    return rows


def process(inputs: Sequence[str], output: str, options: RunOptions,
            progress: Callable[[Completion, RunStats], None] | None = None) -> dict[str, Any]:
    """Run every valid job of `inputs` and write `output`, its errors file and its summary."""
    from pipeline.engine import Engine
    from pipeline.model import DEFAULT_MODEL, load_model

    started = time.monotonic()
    jobs: list[Job] = []
    invalid: list[InvalidRow] = []
    for item in read_jobs(inputs, options.defaults, dataset=options.dataset, split=options.split,
                          prompt_template=options.prompt_template, system=options.system):
        (jobs if isinstance(item, Job) else invalid).append(item)
    # fail on a bad output path or a column clash before any model work
    schema = result_schema(infer_extra_schema((j.extra for j in jobs), input_schema(inputs)),
                           id_type_for(j.id for j in jobs))
    _check_free(output, options.overwrite)

    model, tokenizer_source = load_model(options.model, options.device, options.dtype, options.trust_remote_code)
    tokenizer = Tokenizer.load(tokenizer_source, trust_remote_code=options.trust_remote_code)
    requests, bad = to_requests(jobs, tokenizer, context_window(model.config), options.defaults.seed)
    invalid += bad
    eos = _eos_ids(model, tokenizer)
    engine = Engine(model, eos_token_ids=eos, min_shared_tokens=options.min_shared_tokens,
                    max_batch_tokens=options.max_batch_tokens)
    by_job: dict[int, list[Completion]] = {}
    for c in engine.run(requests):
        by_job.setdefault(c.key, []).append(c)
        if progress is not None:
            progress(c, engine.stats)

    rows: list[dict[str, Any]] = []
    for index, job in enumerate(jobs):
        done = by_job.get(index)
        if done is None:
            continue  # reported in invalid already
        failed = [c for c in done if c.error]
        if failed:
            invalid.append(InvalidRow(job.location, job.id, f"generation failed: {failed[0].error}"))
            continue
        rows.extend(result_rows(job, done, tokenizer))
    model_name = options.model or DEFAULT_MODEL
    with open_result_writer(output, schema, options.output_format, options.overwrite, model=model_name) as w:
        w.write(rows)
    with ErrorWriter(errors_path(output), overwrite=True) as ew:
        ew.write(invalid)
    summary = _summary(engine.stats, len(jobs) + len(invalid), rows, invalid, model_name, options, started)
    summary["output"], summary["errors_file"] = output, errors_path(output) if invalid else None
    write_summary(summary_path(output), summary)
    return summary


def _check_free(output: str, overwrite: bool) -> None:
    import os

    from jobs import JobError

    if os.path.exists(output) and not overwrite:
        raise JobError(f"{output} already exists; pass --overwrite to replace it")


def _eos_ids(model: Any, tokenizer: Tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return tokenizer.eos_token_ids
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _summary(stats: RunStats, n_jobs: int, rows, invalid, model_name: str, options: RunOptions,
             started: float) -> dict[str, Any]:
    import torch
    import transformers

    from pipeline import __version__

    wall = time.monotonic() - started
    opts = asdict(options)
    opts["defaults"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts["defaults"].items()}
    return {
        "jobs": n_jobs,
        "completed": len({r["id"] for r in rows}),
        "failed": len(invalid),
        "rows": len(rows),
        "prompt_tokens": stats.prompt_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "cached_tokens": stats.cached_tokens,
        "completion_tokens": stats.completion_tokens,
        "decode_steps": stats.decode_steps,
        "batches": stats.batches,
        "shared_prefixes": stats.prefix_nodes,
        "prefill_saving": round(1 - stats.prefill_tokens / stats.prompt_tokens, 4) if stats.prompt_tokens else 0.0,
        "wall_seconds": round(wall, 3),
        "completion_tokens_per_second": round(stats.completion_tokens / wall, 2) if wall > 0 else None,
        "model": model_name,
        "versions": {"batchgen": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "options": opts,
    }
