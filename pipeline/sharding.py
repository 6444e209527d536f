"""Prefix-aware shards for cluster arrays, and merging their outputs.

Every shard reads and tokenizes the whole input and computes the same assignment: jobs are
grouped by their top shared prefix (a top-level shared node of the radix tree), and whole groups
go to shards, heaviest first, to the least-loaded shard. A prefix is prefilled by one shard only.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Hashable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from jobs import ErrorWriter, JobError, ParquetWriter, errors_path, summary_path, write_summary
from pipeline.schedule import top_groups
from pipeline.summary import merged


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    if spec is None:
        return None
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise JobError(f"--shard {spec!r}: expected I/N, e.g. 0/8") from None
    if not (n >= 1 and 0 <= i < n):
        raise JobError(f"--shard {spec!r}: need 0 <= I < N")
    return i, n


def assign(prompts: Mapping[Hashable, Sequence[int]], shards: int, min_shared_tokens: int) -> dict[Hashable, int]:
    """Shard of each job; jobs under one top shared prefix always share a shard."""
    groups: dict[Any, list[Hashable]] = {}
    for key, top in top_groups(prompts, min_shared_tokens).items():
        groups.setdefault(top if top is not None else ("job", key), []).append(key)

    def cost(group_keys: list[Hashable], top) -> int:
        shared_len = top.depth if not isinstance(top, tuple) else 0
        return shared_len + sum(len(prompts[k]) - shared_len for k in group_keys)

    def tie(top, group_keys) -> str:
        # stable across processes: the group's first prompt, not object identity
        return hashlib.blake2b(json.dumps(list(prompts[group_keys[0]])).encode(), digest_size=8).hexdigest()

    order = sorted(groups.items(), key=lambda kv: (-cost(kv[1], kv[0]), tie(kv[0], kv[1])))
    load = [0] * shards
    out: dict[Hashable, int] = {}
    for top, keys in order:
        target = min(range(shards), key=lambda s: (load[s], s))
        load[target] += cost(keys, top)
        for k in keys:
            out[k] = target
    return out


def merge(shard_outputs: Sequence[str], output: str, overwrite: bool = False) -> dict[str, Any]:
    """Join shard outputs into one file in input order; every job exactly once, or an error."""
    from pipeline.parts import ORDER

    summaries = []
    for path in shard_outputs:
        try:
            with open(summary_path(path)) as f:
                summaries.append(json.load(f))
        except FileNotFoundError:
            raise JobError(f"{path}: no {summary_path(path)} beside it; is it a finished shard output?") from None
    specs = [s.get("shard") for s in summaries]
    if any(s is None for s in specs):
        raise JobError("merge takes outputs of `batchgen process --shard I/N` runs")
    total = specs[0][1]
    if sorted(s[0] for s in specs) != list(range(total)) or any(s[1] != total for s in specs):
        found = ", ".join(f"{i}/{n}" for i, n in sorted(map(tuple, specs)))
        raise JobError(f"shards {found} given: need each of 0/{total} .. {total - 1}/{total} exactly once")
    if len({s["job_set"] for s in summaries}) != 1:
        raise JobError("the shards ran different job sets or options; rerun them from one command line")
    tables = [pq.read_table(p) for p in shard_outputs]
    table = pa.concat_tables(tables).sort_by(ORDER)
    errors = []
    for p in shard_outputs:
        if os.path.exists(errors_path(p)):
            errors += pq.read_table(errors_path(p)).to_pylist()
    orders = table.column(ORDER).to_pylist()
    ids_done = {(o, i) for o, i in zip(orders, table.column("id").to_pylist())}
    jobs = summaries[0]["jobs_total"]
    if len({o for o, _ in ids_done}) + len(errors) != jobs:
        raise JobError(f"merged shards hold {len({o for o, _ in ids_done})} jobs and {len(errors)} errors, "
                       f"but the input has {jobs} jobs")
    with ParquetWriter(output, table.schema.remove(table.schema.get_field_index(ORDER)), overwrite) as w:
        w.write(table.drop_columns([ORDER]).to_pylist())
    with ErrorWriter(errors_path(output), overwrite=True) as ew:
        ew.write(errors)
    summary = merged(summaries)  # every field a shard summary has; counters summed
    summary.update(shard=None, shards=total, merged_from=list(shard_outputs), output=output,
                   errors_file=errors_path(output) if errors else None)
    write_summary(summary_path(output), summary)
    return summary
