"""What a run keeps of a million jobs between reading them and running them, without holding
them as Python objects: the rows that cannot run as an Arrow table, each job's input position
and samples as arrays, and the jobs themselves on disk.

Jobs are pickled one by one into an anonymous temporary file (gone when the process ends, even
by SIGKILL), and read back by job number for the one window the engine runs; a job is written
whole, with its carried columns, so nothing about it is decided twice.
"""
from __future__ import annotations

import array
import os
import pickle
import tempfile
from dataclasses import replace
from typing import Iterable, Iterator, Sequence

import pyarrow as pa

from batchgen.jobs import InvalidRow, Job

PROBLEM_SCHEMA = pa.schema([pa.field("order", pa.int64()), pa.field("id", pa.string()),
                            pa.field("location", pa.string()), pa.field("reason", pa.string())])


class Problems:
    """Rows that cannot run, in input order: (input position, id, location, reason), as written
    to the errors file (`InvalidRow.to_row`), so `validate` prints exactly what `process` writes."""

    def __init__(self) -> None:
        self._tables: list[pa.Table] = []
        self._count = 0

    def add(self, rows: Iterable[tuple[int, InvalidRow]]) -> None:
        """Rows of one chunk; chunks come in input order."""
        got = sorted(rows, key=lambda r: r[0])
        if got:
            cols = [r.to_row() for _, r in got]
            self._tables.append(pa.table({"order": [o for o, _ in got], "id": [c["id"] for c in cols],
                                          "location": [c["location"] for c in cols],
                                          "reason": [c["reason"] for c in cols]}, schema=PROBLEM_SCHEMA))
            self._count += len(got)

    def __len__(self) -> int:
        return self._count

    def table(self) -> pa.Table:
        return pa.concat_tables(self._tables) if self._tables else PROBLEM_SCHEMA.empty_table()

    def lines(self, limit: int | None = None) -> Iterator[str]:
        """`location: reason` per row, as `validate` prints them."""
        shown = 0
        for t in self._tables:
            for loc, reason in zip(t.column("location").to_pylist(), t.column("reason").to_pylist()):
                if limit is not None and shown >= limit:
                    return
                shown += 1
                yield f"{loc}: {reason}"

    def orders(self) -> pa.Array:
        return self.table().column("order").combine_chunks()


class JobSpool:
    """Jobs by job number (the order they were added), on disk: what a run needs of a job once its
    prompt is tokenized (the prompt itself is in the prefix index as token ids)."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="batchgen-jobs-")
        self._ends = array.array("q")
        self._size = 0
        self._flushed = True

    def add(self, jobs: Sequence[Job]) -> None:
        # the text goes; the endpoint it implies stays (the OpenAI writer reports it). A scoring
        # job keeps it (its pairs are split again from the text), and so does a job that scores
        # its prompt (echo writes the prompt back; scored alone, the index holds less than its
        # prompt: `expand.whole_key`), and so does a conversation (its later turns are rendered from it)
        blobs = [pickle.dumps(j if j.is_scoring or j.prompt_logprobs or j.then is not None else
                              replace(j, prompt=None, messages=None, endpoint=j.openai_endpoint),
                              protocol=pickle.HIGHEST_PROTOCOL) for j in jobs]
        for b in blobs:
            self._size += len(b)
            self._ends.append(self._size)
        self._file.write(b"".join(blobs))
        self._flushed = False

    def __len__(self) -> int:
        return len(self._ends)

    def get(self, numbers: Iterable[int]) -> dict[int, Job]:
        if not self._flushed:
            self._file.flush()
            self._flushed = True
        fd, ends, out = self._file.fileno(), self._ends, {}
        for n in numbers:
            start = ends[n - 1] if n else 0
            out[n] = pickle.loads(os.pread(fd, ends[n] - start, start))
        return out

    def close(self) -> None:
        self._file.close()
