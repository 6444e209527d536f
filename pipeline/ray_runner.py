"""`batchgen process --engine ray`: the same run, spread over a Ray cluster, prefix-aware.

The driver reads and validates the jobs; tokenization runs in parallel Ray tasks; each job gets
the key of its top shared prefix, and every group goes whole to one actor of a pool (one model per
actor, loaded once), so a prefix is prefilled once across the cluster. Actors write their results
as Parquet parts into OUTPUT_DIR, named by the jobs they hold: a retried task rewrites the same
part instead of duplicating it, and a rerun skips every job already in a part (exactly once).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import asdict
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from jobs import ErrorWriter, JobError, id_type_for, infer_extra_schema, input_schema, result_schema, write_summary
from jobs import InvalidRow
from pipeline.parts import ERROR_PART_SCHEMA, ORDER, write_part
from pipeline.runner import (RunOptions, _eos_ids, _settings, _summary, context_window, job_rows, length_error,
                             read_all)
from pipeline.types import RunStats

UNSHARED_BUCKETS = 64  # jobs that share no prefix are spread over this many groups


def group_keys(prompts: dict[int, list[int]], min_shared_tokens: int, workers: int) -> dict[int, str]:
    """Each job's group: a hash of its top shared prefix's tokens, or a bucket of unshared jobs."""
    from pipeline.schedule import top_groups

    keys = {}
    for order, top in top_groups(prompts, min_shared_tokens).items():
        if top is None:
            keys[order] = f"unshared-{order % max(UNSHARED_BUCKETS, workers)}"
        else:
            keys[order] = hashlib.blake2b(repr(prompts[order][: top.depth]).encode(), digest_size=8).hexdigest()
    return keys


class _Tokenize:
    """A Ray task body: job rows -> token ids (the tokenizer loaded once per worker process)."""

    def __init__(self, source: str, trust_remote_code: bool) -> None:
        from pipeline.tokenize import Tokenizer

        self.tok = Tokenizer.load(source, trust_remote_code=trust_remote_code)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import json

        from pipeline.tokenize import TokenizerError

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
                 out_dir: str, schema_blob: bytes, trust_remote_code: bool) -> None:
        import pickle

        from pipeline.model import load_model
        from pipeline.tokenize import Tokenizer

        self.model, source = load_model(model, device, dtype, trust_remote_code)
        self.tok = Tokenizer.load(source, trust_remote_code=trust_remote_code)
        self.options, self.out_dir = options, out_dir
        self.jobs = pickle.loads(jobs_blob)
        self.schema = pa.ipc.read_schema(pa.py_buffer(schema_blob))  # schemas travel as IPC bytes

    def __call__(self, group: pa.Table) -> pa.Table:
        import json

        from pipeline.engine import Engine
        from pipeline.runner import make_request

        ids = dict(zip(group.column("order").to_pylist(), (json.loads(x) for x in group.column("ids").to_pylist())))
        orders = sorted(ids)
        mine = {o: self.jobs[o] for o in orders}
        # the driver checked lengths: every job here makes a request
        requests = [make_request(o, mine[o], ids[o], self.tok, None, self.options.defaults.seed) for o in orders]
        engine = Engine(self.model, eos_token_ids=_eos_ids(self.model, self.tok),
                        min_shared_tokens=self.options.min_shared_tokens,
                        max_batch_tokens=self.options.max_batch_tokens)
        samples: dict[int, list] = {}
        for c in engine.run(requests):
            samples.setdefault(c.key, []).append(c)
        rows, errors = [], []
        for o in orders:
            results, failed = job_rows(o, mine[o], samples.get(o, []), self.tok)
            rows += results
            errors += failed
        name = hashlib.blake2b(repr(orders).encode(), digest_size=10).hexdigest()
        write_part(os.path.join(self.out_dir, f"part-{name}.parquet"), rows, self.schema)
        if errors:
            write_part(os.path.join(self.out_dir, f"errors-{name}.parquet"), errors, ERROR_PART_SCHEMA)
        return pa.table({k: [v] for k, v in asdict(engine.stats).items()})


def done_orders(out_dir: str) -> set[int]:
    done: set[int] = set()
    for name in os.listdir(out_dir):
        if (name.startswith("part-") or name.startswith("errors-")) and name.endswith(".parquet"):
            done.update(pq.read_table(os.path.join(out_dir, name), columns=[ORDER])[ORDER].to_pylist())
    return done


def process_ray(inputs: Sequence[str], out_dir: str, options: RunOptions, *, address: str | None = None,
                workers: int = 1, gpus_per_worker: float = 0.0) -> dict[str, Any]:
    import json
    import pickle

    import ray

    from pipeline.model import DEFAULT_MODEL, default_model_path

    started = time.monotonic()
    if os.path.isfile(out_dir):
        raise JobError(f"{out_dir}: --engine ray writes a directory of parts; give a directory path")
    os.makedirs(out_dir, exist_ok=True)
    jobs, invalid = read_all(inputs, options)
    schema = result_schema(infer_extra_schema((j.extra for j in jobs.values()), input_schema(inputs)),
                           id_type_for(j.id for j in jobs.values())).append(pa.field(ORDER, pa.int64()))
    settings = _settings(options, options.model or DEFAULT_MODEL)
    _check_settings(out_dir, settings, options.overwrite)
    done = done_orders(out_dir)
    source = options.model if options.model is not None else str(default_model_path())

    started_ray = not ray.is_initialized()
    if started_ray:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(num_cpus=os.cpu_count(), num_gpus=1 if gpus_per_worker else 0, _temp_dir=_ray_temp(out_dir),
                     include_dashboard=False, log_to_driver=False)
    try:
        todo = [{"order": o, "prompt": j.prompt or "", "messages": json.dumps(j.messages) if j.messages else ""}
                for o, j in jobs.items() if o not in done]
        stats = RunStats()
        if todo:
            tokenized = (ray.data.from_items(todo, override_num_blocks=max(1, min(len(todo) // 64, 16)))
                         .map_batches(_Tokenize, fn_constructor_args=(source, options.trust_remote_code),
                                      concurrency=1, num_cpus=0.25, batch_format="numpy")
                         .take_all())
            window = _context_window(source, options.trust_remote_code)
            ids = {}
            for r in tokenized:
                o, x = int(r["order"]), json.loads(r["ids"])
                bad = InvalidRow(jobs[o].location, jobs[o].id, x["error"]) if isinstance(x, dict) \
                    else length_error(jobs[o], len(x), window)
                if bad is None:
                    ids[o] = x
                else:
                    invalid[o] = bad
            keys = group_keys(ids, options.min_shared_tokens, workers)
            table = pa.table({"order": list(ids), "ids": [json.dumps(ids[o]) for o in ids],
                              "group": [keys[o] for o in ids]})
            results = (ray.data.from_arrow(table)
                       .groupby("group")
                       .map_groups(_Generate, batch_format="pyarrow", concurrency=workers,
                                   num_cpus=0 if gpus_per_worker else 0.5, num_gpus=gpus_per_worker or None,
                                   fn_constructor_args=(options.model, options.device, options.dtype, options,
                                                        pickle.dumps({o: jobs[o] for o in ids}), out_dir,
                                                        schema.serialize().to_pybytes(), options.trust_remote_code))
                       .take_all())
            for r in results:
                stats.add(RunStats(**{k: int(r[k]) for k in RunStats.__dataclass_fields__}))
    finally:
        if started_ray:
            ray.shutdown()

    errors = [{**inv.to_row()} for o, inv in sorted(invalid.items())]
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("errors-") and name.endswith(".parquet"):
            errors += [{k: v for k, v in e.items() if k != ORDER} for e in pq.read_table(os.path.join(out_dir, name)).to_pylist()]
    with ErrorWriter(os.path.join(out_dir, "errors.parquet"), overwrite=True) as ew:
        ew.write(errors)
    parts = [os.path.join(out_dir, n) for n in os.listdir(out_dir) if n.startswith("part-") and n.endswith(".parquet")]
    completed = len({o for p in parts for o in pq.read_table(p, columns=[ORDER])[ORDER].to_pylist()})
    rows = sum(pq.read_metadata(p).num_rows for p in parts)
    summary = _summary(stats, len(jobs) + len(invalid), completed, len(errors), rows, settings["model"], options, started)
    summary.update(engine="ray", output=out_dir, workers=workers, resumed_jobs=len(done), settings=settings)
    write_summary(os.path.join(out_dir, "summary.json"), summary)
    return summary


def _check_settings(out_dir: str, settings: dict[str, Any], overwrite: bool) -> None:
    """Parts of a run with other options or another model are never mixed in."""
    import json

    path = os.path.join(out_dir, "settings.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old != json.loads(json.dumps(settings, default=str)):
            if not overwrite:
                raise JobError(f"{out_dir} holds parts of a run with other options or model; "
                               "pass --overwrite to discard them and start over")
            for name in os.listdir(out_dir):
                if name.endswith(".parquet"):
                    os.unlink(os.path.join(out_dir, name))
    write_summary(path, settings)


def _context_window(source: str, trust_remote_code: bool) -> int | None:
    from transformers import AutoConfig

    return context_window(AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code))


def _ray_temp(out_dir: str) -> str:
    """Ray's files go under the run's own directory, unless that path is too long for the
    unix sockets Ray puts there (about 107 bytes); then under a short private temp dir."""
    path = os.path.abspath(os.path.join(out_dir, ".ray"))
    if len(path) > 40:
        path = tempfile.mkdtemp(prefix="bgray-")
    os.makedirs(path, exist_ok=True)
    return path
