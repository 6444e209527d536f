"""Rows of many Parquet files in input order (their `_batchgen_order` column), as Arrow batches,
in bounded memory: the final output of a run and of `batchgen merge`.

A run commits parts as jobs finish, a prefix group at a time, so one part holds positions from
all over the input. Each file is read once, in batches, and each batch's rows go to buckets of
consecutive positions (Arrow IPC files in a scratch directory); then each bucket in turn is
read, sorted (stably: a job's samples keep their order) and handed on. Memory holds one batch
and one bucket, never the whole output, and no row becomes a Python object.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.jobs.columns import ORDER

BUCKET_POSITIONS = 1 << 17  # input positions per bucket ...
MAX_BUCKETS = 256  # ... unless that makes more buckets than this (files open at once)
READ_ROWS = 1 << 16


def in_order(files: Sequence[str], schema: pa.Schema, positions: int, scratch: str) -> Iterator[pa.Table]:
    """The rows of `files` (all of `schema`, ORDER below `positions`) sorted by ORDER, then by
    `sample_index` if there is one. `scratch`: a directory for the buckets (removed after)."""
    per = max(BUCKET_POSITIONS, -(-positions // MAX_BUCKETS))
    keys = [(ORDER, "ascending")] + ([("sample_index", "ascending")] if "sample_index" in schema.names else [])
    if positions <= per:  # one bucket: no files to write
        tables = [b for f in files for b in _batches(f, schema)]
        if tables:
            yield pa.concat_tables(tables).sort_by(keys)
        return
    work = tempfile.mkdtemp(prefix=".sort-", dir=scratch)
    writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
    try:
        for f in files:
            for table in _batches(f, schema):
                bucket = pc.divide(table.column(ORDER), pa.scalar(per, pa.int64())).to_numpy()
                for k in np.unique(bucket).tolist():
                    if k not in writers:
                        writers[k] = pa.ipc.new_file(os.path.join(work, f"{k:06d}.arrow"), schema)
                    writers[k].write_table(table.filter(pa.array(bucket == k)))
        for w in writers.values():
            w.close()
        for k in sorted(writers):
            path = os.path.join(work, f"{k:06d}.arrow")
            with pa.OSFile(path) as source:
                table = pa.ipc.open_file(source).read_all().sort_by(keys)
            yield table
            del table
            os.unlink(path)
    finally:
        for w in writers.values():
            try:
                w.close()
            except (OSError, pa.ArrowException):
                pass
        shutil.rmtree(work, ignore_errors=True)


def _batches(path: str, schema: pa.Schema) -> Iterator[pa.Table]:
    source = pq.ParquetFile(path)
    for batch in source.iter_batches(batch_size=READ_ROWS):
        yield pa.Table.from_batches([batch]).cast(schema)
