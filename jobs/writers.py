"""Result writers: Parquet, JSON Lines, and OpenAI Batch API output, and the errors file and
summary beside them; each one an :class:`~batchgen.jobs.atomic.AtomicWriter` (atomic, symlink-safe).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from .atomic import AtomicWriter, WrittenIfAny, remove_stale_temps
from .columns import (CREATED, ERROR_SCHEMA, OUTPUT_COLUMNS, OUTPUT_FIELDS, RESULT_COLUMNS, RESULT_FIELDS,
                      check_required, dumps, json_default)
from .openai_batch import OpenAIBatchWriter, OpenAIErrorWriter
from .schema import CHAT_ENDPOINT, InvalidRow, Job, JobError

FORMATS = ("parquet", "jsonl", "openai")
_ROW_GROUP_ROWS = 8192  # buffer tiny write() calls so Parquet row groups stay efficient


def outputs_of(job: Job) -> set[str]:
    """The optional result columns a job fills (OUTPUT_FIELDS' keys)."""
    return {name for name, on in (("prompt_index", job.prompt_index is not None), ("logprobs", job.logprobs),
                                  ("prompt_logprobs", job.prompt_logprobs), ("scores", job.is_scoring),
                                  ("adapter", job.adapter is not None), ("turns", job.then is not None)) if on}


def result_schema(extra_schema: pa.Schema | None, id_type: pa.DataType, created: bool = False,
                  outputs: Iterable[str] = ()) -> pa.Schema:
    """Extra (carried-through) columns first, then ``id`` and the result columns, then the
    optional columns of ``outputs`` (those some job asks for); with ``created``, each job's
    completion time (what OpenAI output reports as ``created``).

    Raises JobError when an input column has the name of a result column, since
    one would silently overwrite the other.
    """
    extra = list(extra_schema or [])
    clash = sorted({f.name for f in extra} & set(RESULT_COLUMNS + OUTPUT_COLUMNS))
    if clash:
        raise JobError(f"input column(s) {', '.join(clash)} clash with result columns of the "
                       "same name; rename them in the input")
    optional = [f for name, fields in OUTPUT_FIELDS.items() if name in set(outputs) for f in fields]
    return pa.schema(extra + [pa.field("id", id_type), *RESULT_FIELDS, *optional]
                     + ([pa.field(CREATED, pa.int64())] if created else []))


def id_type_for(ids: Iterable[str | int]) -> pa.DataType:
    """int64 when every id is an int, else string (ints are written as their decimal text)."""
    return pa.int64() if all(isinstance(i, int) for i in ids) else pa.string()


def infer_extra_schema(extras: Iterable[Mapping[str, Any]],
                       hint: pa.Schema | None = None) -> pa.Schema:
    """Schema for carried-through columns, in first-seen order.

    Types come from ``hint`` (see readers.input_schema) where it has the column,
    else from the values. A column whose values are of mixed kinds (a dict in one JSONL
    row, a string in the next; a date and an int) or that Arrow cannot unify becomes a
    string column of JSON text, which keeps every value as it was.
    """
    inference = ExtraSchema(hint)
    chunk: list[Mapping[str, Any]] = []
    for extra in extras:
        chunk.append(extra)
        if len(chunk) >= ExtraSchema.CHUNK:
            inference.update(chunk)
            chunk = []
    inference.update(chunk)
    return inference.schema()


def value_kind(value: Any) -> type:
    """What a carried value is at its top level: a column holds one kind or becomes JSON text.

    Arrow's own inference over mixed kinds depends on their order (a date and then an int give a
    date column that turns 1 into 1970-01-02; an int and then a date fail), so batchgen decides
    mixing itself. Ints and floats are one kind (Arrow joins them to double).
    """
    if isinstance(value, bool):
        return bool
    if isinstance(value, (int, float)):
        return float
    if isinstance(value, Mapping):
        return dict
    if isinstance(value, (list, tuple)):
        return list
    return type(value)


def _arrow_type(values: list[Any]) -> pa.DataType | None:
    """The type Arrow infers for these values, or None where it cannot convert them to one."""
    try:
        return pa.array(values).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return None


class ExtraSchema:
    """`infer_extra_schema` over a stream of rows, chunk by chunk, with the same result.

    A column whose non-null values are of more than one kind (:func:`value_kind`), or whose values
    Arrow cannot convert to one type, is JSON text. Within one kind Arrow infers a column's type as
    a join (ints and floats give double, structs merge their fields, a conflict fails), so one chunk
    of values per distinct chunk type holds everything the whole column would tell: the kept chunks
    are inferred together at the end.
    """

    CHUNK = 4096

    def __init__(self, hint: pa.Schema | None = None) -> None:
        self.hint = hint
        self._names: dict[str, None] = {}  # first-seen order
        self._kinds: dict[str, set[type]] = {}  # column -> the kinds of its non-null values so far
        self._text: set[str] = set()  # columns already known to be JSON text
        self._kept: dict[str, dict[pa.DataType, list[Any]]] = {}  # column -> chunk type -> that chunk's values

    def update(self, extras: Sequence[Mapping[str, Any]]) -> None:
        for extra in extras:
            for name in extra:
                self._names.setdefault(name, None)
        hinted = self.hint.names if self.hint is not None else ()
        for name in self._names:
            if name in hinted or name in self._text or not extras:
                continue
            values = [e.get(name) for e in extras]
            kinds = self._kinds.setdefault(name, set())
            kinds.update(value_kind(v) for v in values if v is not None)
            dtype = _arrow_type(values) if len(kinds) <= 1 else None
            if dtype is None:
                self._text.add(name)
                self._kept.pop(name, None)  # its values no longer matter
            else:
                self._kept.setdefault(name, {}).setdefault(dtype, values)

    def schema(self) -> pa.Schema:
        out = []
        for name in self._names:
            if self.hint is not None and name in self.hint.names:
                out.append(self.hint.field(name))
                continue
            dtype = None
            if name not in self._text:
                dtype = _arrow_type([v for chunk in self._kept.get(name, {}).values() for v in chunk])
            out.append(pa.field(name, pa.string() if dtype is None or pa.types.is_null(dtype) else dtype))
        return pa.schema(out)


def conform_rows(rows: Sequence[Mapping[str, Any]], schema: pa.Schema, required: bool = True) -> list[dict[str, Any]]:
    """Order keys by schema and turn non-strings in string columns into JSON text."""
    if required:
        check_required(rows, schema.names)
    string_cols = {f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)}
    out = []
    for r in rows:
        row = {}
        for name in schema.names:
            v = r.get(name)
            row[name] = dumps(v) if name in string_cols and v is not None and not isinstance(v, str) else v
        out.append(row)
    return out


class ParquetWriter(AtomicWriter):
    """Result rows to Parquet with an explicit schema (see :func:`result_schema`)."""

    def __init__(self, path: str | os.PathLike[str], schema: pa.Schema, overwrite: bool = False) -> None:
        super().__init__(path, overwrite)
        self.schema = schema
        self._buffer: list[dict[str, Any]] = []
        self._pq: pq.ParquetWriter | None = None

    def __enter__(self) -> ParquetWriter:
        super().__enter__()
        self._pq = pq.ParquetWriter(self._file, self.schema)
        return self

    def write(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self._buffer.extend(conform_rows(rows, self.schema))
        if len(self._buffer) >= _ROW_GROUP_ROWS:
            self._flush()

    def write_table(self, table: pa.Table) -> None:
        """Rows already in this writer's schema (a committed part's), as Arrow: no Python rows."""
        self._flush()
        self._pq.write_table(table.select(self.schema.names).cast(self.schema),  # type: ignore[union-attr]
                             row_group_size=_ROW_GROUP_ROWS * 8)

    def _flush(self) -> None:
        if self._buffer:
            self._pq.write_table(pa.Table.from_pylist(self._buffer, schema=self.schema))  # type: ignore[union-attr]
            self._buffer = []

    def _finish(self) -> None:
        self._flush()
        self._pq.close()  # type: ignore[union-attr]  # writes the footer; empty input still gets one

    def _abort(self) -> None:
        # Close now: otherwise its __del__ later writes a footer into a closed file.
        self._buffer = []
        if self._pq is not None:
            self._pq.close()


class JsonlWriter(AtomicWriter):
    """Result rows as JSON Lines, keys in schema order (``.gz`` suffix compresses)."""

    def __init__(self, path: str | os.PathLike[str], schema: pa.Schema, overwrite: bool = False) -> None:
        super().__init__(path, overwrite)
        self.schema = schema

    _allow_gzip = True

    def write(self, rows: Sequence[Mapping[str, Any]]) -> None:
        check_required(rows, self.schema.names)
        # Not conform_rows: nested extras stay real JSON here instead of JSON-in-a-string.
        id_is_str = pa.types.is_string(self.schema.field("id").type)
        lines = []
        for r in rows:
            row = {name: r.get(name) for name in self.schema.names}
            if id_is_str:
                row["id"] = str(row["id"])
            lines.append(dumps(row) + "\n")
        self._file.write("".join(lines).encode("utf-8"))  # type: ignore[union-attr]


def open_result_writer(path: str | os.PathLike[str], schema: pa.Schema, fmt: str = "parquet",
                       overwrite: bool = False, *, model: str | None = None,
                       endpoint: str = CHAT_ENDPOINT, fingerprint: str | None = None) -> AtomicWriter:
    """Writer for ``fmt`` in FORMATS; ``model`` is required for ``openai``."""
    if fmt == "parquet":
        return ParquetWriter(path, schema, overwrite)
    if fmt == "jsonl":
        return JsonlWriter(path, schema, overwrite)
    if fmt == "openai":
        if not model:
            raise JobError("the openai output format needs a model name")
        return OpenAIBatchWriter(path, schema, overwrite, model=model, endpoint=endpoint, fingerprint=fingerprint)
    raise JobError(f"unknown output format {fmt!r}; choose one of {', '.join(FORMATS)}")


def errors_path(output_path: str | os.PathLike[str], fmt: str = "parquet") -> str:
    """``out/results.parquet`` -> ``out/results.parquet.errors.parquet``: beside the output,
    named after it whole, like the summary (``OUTPUT.summary.json``). OpenAI output has its
    errors as Batch API error lines: ``OUTPUT.errors.jsonl``."""
    return os.fspath(output_path) + (".errors.jsonl" if fmt == "openai" else ".errors.parquet")


def summary_path(output_path: str | os.PathLike[str]) -> str:
    return os.fspath(output_path) + ".summary.json"


class ErrorWriter(WrittenIfAny):
    """Invalid rows to Parquet (id, location, reason), atomically.

    No rows -> no file: with ``overwrite`` an errors file of an earlier run at this path is
    removed, so the errors file always lists exactly this run's errors (a stale one would list
    jobs that are now in the output).
    """

    def __init__(self, path: str | os.PathLike[str], overwrite: bool = False) -> None:
        super().__init__(path, overwrite)
        self._tables: list[pa.Table] = []  # held as Arrow: a run may refuse a million rows

    def write(self, rows: Iterable[InvalidRow | Mapping[str, Any]]) -> None:
        rows = [r.to_row() if isinstance(r, InvalidRow) else dict(r) for r in rows]
        if rows:
            self._tables.append(pa.Table.from_pylist(rows, schema=ERROR_SCHEMA))

    def write_table(self, table: pa.Table) -> None:
        """Error rows as Arrow (other columns, such as the input position, are dropped)."""
        if table.num_rows:
            self._tables.append(table.select(ERROR_SCHEMA.names).cast(ERROR_SCHEMA))

    def _empty(self) -> bool:
        return not self._tables

    def _finish(self) -> None:
        pq.write_table(pa.concat_tables(self._tables), self._file)


def open_error_writer(path: str | os.PathLike[str], fmt: str = "parquet", overwrite: bool = False) -> AtomicWriter:
    """The errors file's writer: Batch API error lines beside OpenAI output, else Parquet."""
    return OpenAIErrorWriter(path, overwrite) if fmt == "openai" else ErrorWriter(path, overwrite)


def write_table(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]], schema: pa.Schema,
                overwrite: bool = True) -> None:
    """Rows as one Parquet file, atomically; non-strings in string columns become JSON text."""
    with AtomicWriter(path, overwrite=overwrite) as w:
        table = pa.Table.from_pylist(conform_rows(rows, schema, required=False), schema=schema)
        pq.write_table(table, w._file)  # type: ignore[arg-type]


def write_summary(path: str | os.PathLike[str], summary: Mapping[str, Any]) -> None:
    """Write ``summary`` as indented JSON, atomically (always replaces the old one)."""
    with AtomicWriter(path, overwrite=True) as w:
        w._file.write((json.dumps(summary, indent=2, ensure_ascii=False,  # type: ignore[union-attr]
                                  default=json_default) + "\n").encode("utf-8"))


__all__ = ["result_schema", "id_type_for", "infer_extra_schema", "ParquetWriter", "JsonlWriter",
           "OpenAIBatchWriter", "OpenAIErrorWriter", "ErrorWriter", "CREATED", "open_error_writer",
           "open_result_writer", "errors_path", "summary_path", "write_summary", "write_table", "conform_rows", "ExtraSchema", "value_kind",
           "remove_stale_temps", "AtomicWriter", "RESULT_COLUMNS", "OUTPUT_COLUMNS", "outputs_of", "ERROR_SCHEMA", "FORMATS"]
