"""`batchgen process --engine ray`: the same run, spread over a Ray cluster, prefix-aware.

The driver reads and checks the jobs (the same checks as a local run, `inputrows.read_checked`);
tokenization runs on an autoscaling pool of Ray actors (up to one per cluster CPU, at most 16,
each loading the tokenizer once); each job gets the key of its top shared prefix, and every group
goes whole to one actor of a pool (one model per actor, loaded once), so a prefix is prefilled
once across the cluster. Actors write their results as Parquet parts into OUTPUT_DIR, named by the
jobs they hold: a retried task rewrites the same part instead of duplicating it, and a rerun of
the same job set and settings (`run.json`, the local runner's fingerprint) skips every job already
in a part (exactly once). Output is always Parquet parts: another --output-format is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import replace
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.jobs import ErrorWriter, InvalidRow, JobError, write_summary
from batchgen.pipeline.run.parts import ERROR_PART_SCHEMA, ORDER, job_set_key, may_resume, write_part
from batchgen.pipeline.text.expand import JobTokens, completions_expected, finished_jobs, token_problem
from batchgen.pipeline.run.inputrows import read_checked
from batchgen.pipeline.run.overlap import check_directory_apart
from batchgen.pipeline.run.preflight import check_options, context_window, job_digest
from batchgen.pipeline.text.results import job_rows
from batchgen.pipeline.run.options import RunOptions, run_settings
from batchgen.pipeline.run.summary import JobCounts, ThisRun, add_work, run_summary, work_of

RUN_FILE = "run.json"  # the job set's key and the settings the parts beside it were made with
_WORK_KEY = b"batchgen_work"  # a part's engine work, in its Parquet metadata
UNSHARED_BUCKETS = 64  # jobs that share no prefix are spread over this many groups


def group_keys(prompts: dict[int, list[int]], min_shared_tokens: int, workers: int,
               adapters: dict[int, int] | None = None) -> dict[int, str]:
    """Each job's group: its top shared prefix (`windows.units`; of its adapter's jobs, by the
    adapter index in `adapters`), or a bucket of unshared jobs."""
    import numpy as np

    from batchgen.pipeline.run.prefix_index import PrefixIndex
    from batchgen.pipeline.run.windows import units

    orders = list(prompts)
    index = PrefixIndex.of([prompts[o] for o in orders],
                           adapters=[adapters.get(o, 0) for o in orders] if adapters else None)
    jobs, held = index.subset(np.arange(len(index)))
    found = units(held, index.lengths[jobs], index.weights[jobs], min_shared_tokens)
    keys = {}
    for k, (start, end, grouped) in enumerate(zip(found.starts, found.ends, found.grouped)):
        for j in jobs[start:end].tolist():
            keys[orders[j]] = f"group-{k}" if grouped else f"unshared-{orders[j] % max(UNSHARED_BUCKETS, workers)}"
    return keys


class _Tokenize:
    """A Ray task body: job rows -> token ids (the tokenizer loaded once per worker process)."""

    def __init__(self, source: str, trust_remote_code: bool) -> None:
        from batchgen.pipeline.text.tokenize import Tokenizer

        self.tok = Tokenizer.load(source, trust_remote_code=trust_remote_code)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import json

        from batchgen.pipeline.text.tokenize import TokenizerError

        ids = []
        for prompt, messages in zip(batch["prompt"], batch["messages"]):
            try:
                x = self.tok.encode_messages(json.loads(messages)) if messages else self.tok.encode_prompt(prompt)
            except TokenizerError as e:
                x = {"error": str(e)}
            ids.append(json.dumps(x))
        return {"order": batch["order"], "ids": ids}


class _Generate:
    """A Ray actor: loads the model once, runs whole prefix groups, writes each as a part."""

    def __init__(self, model: str | None, device: str, dtype: str, options: RunOptions, jobs_blob: bytes,
                 out_dir: str, schema_blob: bytes, trust_remote_code: bool, adapters: Any = None) -> None:
        import pickle

        from batchgen.pipeline.model.hf import as_forward
        from batchgen.pipeline.model.load import load_model
        from batchgen.pipeline.text.tokenize import Tokenizer

        loaded, source = load_model(model, device, dtype, trust_remote_code)
        self.model = as_forward(loaded)
        self.adapters = adapters  # the driver's: every job's adapter resolved and checked
        if adapters is not None and adapters.infos:
            self.model.set_adapters(adapters.infos)
        self.tok = Tokenizer.load(source, trust_remote_code=trust_remote_code)
        self.options, self.out_dir = options, out_dir
        self.jobs = pickle.loads(jobs_blob)
        self.schema = pa.ipc.read_schema(pa.py_buffer(schema_blob))  # schemas travel as IPC bytes

    def __call__(self, group: pa.Table) -> pa.Table:
        import json

        from batchgen.pipeline.engine.engine import Engine
        from batchgen.pipeline.run.preflight import make_requests

        ids = dict(zip(group.column("order").to_pylist(), (json.loads(x) for x in group.column("ids").to_pylist())))
        orders = sorted(ids)
        mine = {o: self.jobs[o] for o in orders}
        # the driver checked every job: each one here makes a request
        by_job = {o: make_requests(o, mine[o], JobTokens(ids[o]), self.tok, None, self.options.defaults.seed,
                                   adapter=self.adapters.index_of(mine[o]) if self.adapters is not None else 0)
                  for o in orders}
        requests = [r for o in orders for r in by_job[o]]
        engine = Engine.for_model(self.model, self.tok.eos_token_ids, min_shared_tokens=self.options.min_shared_tokens,
                                  max_batch_tokens=self.options.max_batch_tokens)
        samples = dict(finished_jobs(engine.run(requests), {o: completions_expected(by_job[o]) for o in orders}))
        rows, errors = [], []
        for o in orders:
            results, failed = job_rows(o, mine[o], samples.get(o, []), self.tok)
            rows += results
            errors += failed
        name = hashlib.blake2b(repr(orders).encode(), digest_size=10).hexdigest()
        write_part(os.path.join(self.out_dir, f"part-{name}.parquet"), rows, self.schema,
                   {_WORK_KEY: json.dumps(work_of(engine.stats))})
        if errors:
            write_part(os.path.join(self.out_dir, f"errors-{name}.parquet"), errors, ERROR_PART_SCHEMA)
        return pa.table({"jobs": [len(orders)]})


def done_orders(out_dir: str) -> set[int]:
    done: set[int] = set()
    for name in os.listdir(out_dir):
        if (name.startswith("part-") or name.startswith("errors-")) and name.endswith(".parquet"):
            done.update(pq.read_table(os.path.join(out_dir, name), columns=[ORDER])[ORDER].to_pylist())
    return done


def process_ray(inputs: Sequence[str], out_dir: str, options: RunOptions, *, address: str | None = None,
                workers: int = 1, gpus_per_worker: float = 0.0) -> dict[str, Any]:
    import pickle

    started = time.monotonic()
    # the jobs Ray cannot run yet are refused as the rows are read (inputrows.refusal), as `validate --engine ray` does
    options = replace(options, engine="ray")
    check_options(options)
    check_directory_apart(out_dir, inputs)
    import ray

    from batchgen.pipeline.model.load import DEFAULT_MODEL, default_model_path, resolve_precision

    if os.path.isfile(out_dir):
        raise JobError(f"{out_dir}: --engine ray writes a directory of parts; give a directory path")
    os.makedirs(out_dir, exist_ok=True)
    from batchgen.pipeline.model.identity import model_identity
    from batchgen.pipeline.model.load import load_config
    from batchgen.pipeline.run.adapters import Adapters

    source = options.model if options.model is not None else str(default_model_path())
    adapters = Adapters.of(options.adapters, load_config(options.model, options.trust_remote_code))
    jobs, invalid, schema = read_checked(list(inputs), options, adapters)
    schema = schema.append(pa.field(ORDER, pa.int64()))
    model_name = options.model or DEFAULT_MODEL

    started_ray = not ray.is_initialized()
    if started_ray:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(num_cpus=os.cpu_count(), num_gpus=1 if gpus_per_worker else 0, _temp_dir=_ray_temp(out_dir),
                     include_dashboard=False, log_to_driver=False)
    try:
        # where the actors run, `auto` resolves to their device: ask a task with their resources
        probe = ray.remote(num_cpus=0, num_gpus=gpus_per_worker or 0)(resolve_precision)
        settings = run_settings(options, model_name, ray.get(probe.remote(options.device, options.dtype, options.model)),
                                adapters.digests(), model_identity(options.model))
        claim(out_dir, job_set_key(job_digest(jobs), settings), settings, options.overwrite)
        done = done_orders(out_dir)
        earlier = set(_result_parts(out_dir))  # committed by earlier runs: this run's share is counted apart
        todo = [{"order": o, "prompt": j.prompt or "", "messages": json.dumps(j.messages) if j.messages else ""}
                for o, j in jobs.items() if o not in done]
        if todo:
            tokenizers = max(1, min(16, int(ray.cluster_resources().get("CPU", 1))))
            tokenized = (ray.data.from_items(todo, override_num_blocks=max(1, min(len(todo) // 64, 16)))
                         .map_batches(_Tokenize, fn_constructor_args=(source, options.trust_remote_code),
                                      concurrency=(1, tokenizers) if tokenizers > 1 else 1, num_cpus=0.25,
                                      batch_format="numpy")
                         .take_all())
            window = _context_window(source, options.trust_remote_code)
            check = _generation_check(source, options.trust_remote_code, jobs)
            ids = {}
            for r in tokenized:
                o, x = int(r["order"]), json.loads(r["ids"])
                bad = InvalidRow(jobs[o].location, jobs[o].id, x["error"]) if isinstance(x, dict) \
                    else token_problem(jobs[o], JobTokens(x), window) or check(jobs[o])
                if bad is None:
                    ids[o] = x
                else:
                    invalid[o] = bad
            keys = group_keys(ids, options.min_shared_tokens, workers, {o: adapters.index_of(jobs[o]) for o in ids})
            table = pa.table({"order": list(ids), "ids": [json.dumps(ids[o]) for o in ids],
                              "group": [keys[o] for o in ids]})
            (ray.data.from_arrow(table)
             .groupby("group")
             .map_groups(_Generate, batch_format="pyarrow", concurrency=workers,
                         num_cpus=0 if gpus_per_worker else 0.5, num_gpus=gpus_per_worker or None,
                         fn_constructor_args=(options.model, options.device, options.dtype, options,
                                              pickle.dumps({o: jobs[o] for o in ids}), out_dir,
                                              schema.serialize().to_pybytes(), options.trust_remote_code,
                                              adapters))
             .take_all())
    finally:
        if started_ray:
            ray.shutdown()

    errors = [{**inv.to_row()} for o, inv in sorted(invalid.items())]
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("errors-") and name.endswith(".parquet"):
            errors += [{k: v for k, v in e.items() if k != ORDER} for e in pq.read_table(os.path.join(out_dir, name)).to_pylist()]
    with ErrorWriter(os.path.join(out_dir, "errors.parquet"), overwrite=True) as ew:
        ew.write(errors)
    parts = _result_parts(out_dir)
    tables = {p: pq.read_table(p) for p in parts}
    results = pa.concat_tables(list(tables.values())) if parts else schema.empty_table()

    def work_in(paths: list[str]) -> dict[str, int]:
        return add_work(*(json.loads((pq.read_schema(p).metadata or {}).get(_WORK_KEY, b"{}")) for p in paths))

    mine = JobCounts()
    for p in parts:
        if p not in earlier:
            mine.add(tables[p])
    share = ThisRun(mine.completed, mine.prompt_tokens, mine.completion_tokens, work_in(sorted(earlier)))
    summary = run_summary(JobCounts.of(results, len(errors)), work_in(parts), started=started, model=model_name,
                          options=options, run=share)
    summary.update(engine="ray", output=out_dir, workers=workers, resumed_jobs=len(done), settings=settings,
                   jobs_total=len(jobs.keys() | invalid.keys()))
    write_summary(os.path.join(out_dir, "summary.json"), summary)
    return summary


def _result_parts(out_dir: str) -> list[str]:
    """The result parts in `out_dir`, by name."""
    return sorted(os.path.join(out_dir, n) for n in os.listdir(out_dir)
                  if n.startswith("part-") and n.endswith(".parquet"))


def claim(out_dir: str, key: str, settings: dict[str, Any], overwrite: bool) -> None:
    """Parts of another job set, other options or another precision are never mixed in: the same
    check as the local runner's (`parts.may_resume`), on `run.json`."""
    path = os.path.join(out_dir, RUN_FILE)
    recorded: dict[str, Any] | None = None
    try:
        with open(path) as f:
            recorded = json.load(f)
    except FileNotFoundError:
        if any(n.endswith(".parquet") for n in os.listdir(out_dir)):
            recorded = {"key": None, "settings": "unknown (no run.json beside its parts)"}
    except (OSError, ValueError) as e:
        if not overwrite:
            raise JobError(f"{path} is unreadable ({e}); pass --overwrite to start over") from e
        recorded = {"key": None}
    if not may_resume(out_dir, recorded, key, overwrite, settings):
        for name in os.listdir(out_dir):
            if name.endswith(".parquet") or name == "summary.json":
                os.unlink(os.path.join(out_dir, name))
    write_summary(path, {"key": key, "settings": settings})


def _generation_check(source: str, trust_remote_code: bool, jobs: dict[int, Any]):
    """The local runner's check of token ids and constraints (preflight.generation_error), on the
    driver, with a tokenizer loaded only if some job needs it."""
    if not any(j.constraint is not None or j.logit_bias or j.stop_token_ids for j in jobs.values()):
        return lambda job: None
    from batchgen.pipeline.model.load import load_config
    from batchgen.pipeline.run.preflight import generation_error, vocab_size
    from batchgen.pipeline.text.tokenize import Tokenizer

    tok = Tokenizer.load(source, trust_remote_code=trust_remote_code)
    vocab = vocab_size(load_config(source, trust_remote_code))
    return lambda job: generation_error(job, tok, vocab)


def _context_window(source: str, trust_remote_code: bool) -> int | None:
    from batchgen.pipeline.model.load import load_config

    return context_window(load_config(source, trust_remote_code))


def _ray_temp(out_dir: str) -> str:
    """Ray's files go under the run's own directory, unless that path is too long for the
    unix sockets Ray puts there (about 107 bytes); then under a short private temp dir."""
    path = os.path.abspath(os.path.join(out_dir, ".ray"))
    if len(path) > 40:
        path = tempfile.mkdtemp(prefix="bgray-")
    os.makedirs(path, exist_ok=True)
    return path
