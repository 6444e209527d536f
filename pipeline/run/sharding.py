"""Prefix-aware shards for cluster arrays, and merging their outputs.

Every shard reads and tokenizes the whole input and computes the same assignment
(`windows.assign_shards`): jobs are grouped by their top shared prefix (a top-level shared node of
the radix tree, found in the sorted prefix index), and whole groups go to shards, heaviest first,
to the least-loaded shard. A prefix is prefilled by one shard only.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

import numpy as np
import pyarrow.parquet as pq

from batchgen.jobs import ErrorWriter, JobError, ParquetWriter, errors_path, summary_path, write_summary
from batchgen.jobs.columns import ORDER
from batchgen.jobs.errors import OptionError
from batchgen.pipeline.run.summary import merged


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    if spec is None:
        return None
    found = re.fullmatch(r"([0-9]+)/([0-9]+)", spec.strip())  # ASCII digits: int() also reads "٣"
    if found is None:
        raise OptionError("shard", "expected I/N, e.g. 0/8", repr(spec))
    i, n = int(found[1]), int(found[2])
    if not (n >= 1 and 0 <= i < n):
        raise OptionError("shard", "need 0 <= I < N", repr(spec))
    return i, n


def merge(shard_outputs: Sequence[str], output: str, overwrite: bool = False) -> dict[str, Any]:
    """Join shard outputs into one file in input order; every job exactly once, or an error.
    Streamed: the shards' rows go through Arrow a bucket of input positions at a time."""
    from batchgen.pipeline.run.ordered import in_order
    from batchgen.pipeline.run.overlap import check_apart

    # what merge reads of each shard: the output and the errors file and summary beside it
    check_apart(output, "parquet", [p for s in shard_outputs for p in (s, errors_path(s), summary_path(s))],
                reads="shard")
    summaries = []
    for path in shard_outputs:
        try:
            with open(summary_path(path)) as f:
                summary = json.load(f)
        except FileNotFoundError:
            raise JobError(f"{path}: no {summary_path(path)} beside it; is it a finished shard output?") from None
        except ValueError as e:  # not JSON, not UTF-8
            raise JobError(f"{summary_path(path)} is unreadable ({e}); rerun that shard") from None
        if not isinstance(summary, dict):
            raise JobError(f"{summary_path(path)} is not a batchgen summary; rerun that shard")
        summaries.append(summary)
    specs = [s.get("shard") for s in summaries]
    if any(s is None for s in specs):
        raise JobError("merge takes outputs of `batchgen process --shard I/N` runs")
    total = specs[0][1]
    if sorted(s[0] for s in specs) != list(range(total)) or any(s[1] != total for s in specs):
        found = ", ".join(f"{i}/{n}" for i, n in sorted(map(tuple, specs)))
        raise JobError(f"shards {found} given: need each of 0/{total} .. {total - 1}/{total} exactly once")
    if len({s["job_set"] for s in summaries}) != 1:
        if len({s.get("model_files") for s in summaries}) != 1:  # (model_identity: names, sizes, content)
            raise JobError("the shards ran different model files (another checkpoint, or other weights at "
                           "the same path); rerun them on one model")
        raise JobError("the shards ran different job sets or options; rerun them from one command line")
    jobs = summaries[0]["jobs_total"]
    errors = [pq.read_table(errors_path(p)) for p in shard_outputs if os.path.exists(errors_path(p))]
    failed = sum(t.num_rows for t in errors)
    schema = pq.read_schema(shard_outputs[0])
    out_schema = schema.remove(schema.get_field_index(ORDER))
    done, last = 0, (-1, -1)
    with ParquetWriter(output, out_schema, overwrite) as w:
        for table in in_order(list(shard_outputs), schema, jobs, os.path.dirname(os.path.abspath(output))):
            orders, samples = table.column(ORDER).to_numpy(), table.column("sample_index").to_numpy()
            before_o, before_s = np.append(last[0], orders[:-1]), np.append(last[1], samples[:-1])
            twice = (orders == before_o) & (samples == before_s)
            if twice.any():
                raise JobError(f"the shards hold input row {int(orders[twice][0]) + 1} more than once; "
                               "were they run from one command line?")
            done += int((orders != before_o).sum())
            last = (int(orders[-1]), int(samples[-1]))
            w.write_table(table.drop_columns([ORDER]))
    if done + failed != jobs:
        raise JobError(f"merged shards hold {done} jobs and {failed} errors, but the input has {jobs} jobs")
    with ErrorWriter(errors_path(output), overwrite=True) as ew:
        for t in errors:
            ew.write_table(t)
    summary = merged(summaries)  # every field a shard summary has; counters summed
    summary.update(shard=None, shards=total, merged_from=list(shard_outputs), output=output,
                   errors_file=errors_path(output) if errors else None)
    write_summary(summary_path(output), summary)
    return summary
