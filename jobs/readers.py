"""Stream jobs out of JSONL / Parquet / Hugging Face ``datasets`` inputs.

Every source is reduced to ``(Location, row-or-problem)`` pairs and validated
by :meth:`Job.from_row`. A bad row becomes an :class:`InvalidRow` so that one
typo does not cost the other million jobs; a bad *input* (missing path,
truncated Parquet or gzip) raises :class:`JobError` because nothing after the
damage can be trusted.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from . import remote
from .checks import TOO_DEEP
from .schema import (GenerationDefaults, InvalidRow, Job, JobError, JobValidationError,
                     Location, template_fields)

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".jsonl.zstd",
                  ".json.zst", ".json.zstd")
PARQUET_SUFFIXES = (".parquet", ".pq")
_BATCH_ROWS = 1024  # rows per Arrow batch: small enough to stream, large enough to be fast

# A raw record: either a row dict or the reason it could not be parsed.
Record = tuple[Location, "dict[str, Any] | str"]


@dataclass(frozen=True)
class _Source:
    """One resolved input: ``kind`` is jsonl, parquet, saved (save_to_disk) or hub."""

    kind: str
    path: str
    split: str = "train"


def read_jobs(paths: Sequence[str], defaults: GenerationDefaults, *, dataset: str | None = None,
              split: str = "train", prompt_template: str | None = None,
              system: str | None = None) -> Iterator[Job | InvalidRow]:
    """Yield a Job or InvalidRow per input row, in input order across all inputs.

    ``paths`` are read first, then ``dataset`` (a Hub name or local script, loaded
    with ``datasets.load_dataset(dataset, split=split)``). Rows without an ``id``
    get their 0-based record number across all inputs; blank JSONL lines are not
    records, invalid rows are (so ids do not shift when a row is fixed). A repeated
    id is reported as an InvalidRow because results are keyed by id.

    Paths, directories and the template are checked here, before the first row is
    read, so a typo fails immediately instead of after a long prefix of the run.
    """
    sources = resolve_sources(paths, dataset=dataset, split=split, prompt_template=prompt_template)
    return _generate(sources, defaults, prompt_template, system)


def resolve_sources(paths: Sequence[str], *, dataset: str | None = None, split: str = "train",
                    prompt_template: str | None = None) -> list[_Source]:
    """The inputs, checked before any row is read (see read_jobs)."""
    if prompt_template is not None:
        template_fields(prompt_template)  # raises JobError for malformed templates
    sources = [src for p in paths for src in _resolve(p, split)]
    if dataset is not None:
        sources.append(_Source("hub", dataset, split))
    if not sources:
        raise JobError("no inputs given: pass at least one path or a dataset name")
    return sources


def _generate(sources: list[_Source], defaults: GenerationDefaults,
              prompt_template: str | None, system: str | None) -> Iterator[Job | InvalidRow]:
    return jobs_of_records((rec for source in sources for rec in _records(source)), defaults,
                           prompt_template, system)


def jobs_of_records(records: Iterable[Record], defaults: GenerationDefaults, prompt_template: str | None = None,
                    system: str | None = None) -> Iterator[Job | InvalidRow]:
    """A Job or InvalidRow per record, as read_jobs yields them (the Python API hands in-memory
    rows here): ids default to the record number, a repeated id is an InvalidRow."""
    rows = RecordJobs(defaults, prompt_template, system)
    for location, record in records:
        yield from rows.of(location, record)


class RecordJobs:
    """Records into jobs, one after the other: what the ids are checked against (the record
    number is the default id; an id already used is refused). `jobs/chunks.py` shares one with
    its fast path, so both number and check ids as this path alone does."""

    def __init__(self, defaults: GenerationDefaults, prompt_template: str | None = None,
                 system: str | None = None) -> None:
        self.defaults, self.prompt_template, self.system = defaults, prompt_template, system
        self.seen: set[str] = set()  # ids by str(): outputs with mixed id types store ids as strings
        self.number = 0  # records so far

    def of(self, location: Location, record: dict[str, Any] | str) -> list[Job | InvalidRow]:
        """The items of one record: a Job or an InvalidRow, or a Job per element of an OpenAI
        list prompt."""
        default_id, self.number = self.number, self.number + 1
        if isinstance(record, str):
            return [InvalidRow(location, None, record)]
        try:
            jobs = Job.from_record(record, location, self.defaults, default_id,
                                   prompt_template=self.prompt_template, system=self.system)
        except JobValidationError as e:
            return [InvalidRow.from_error(e)]
        # one id per record: the elements of a list prompt share their request's (prompt_index tells them apart)
        first = jobs[0]
        key = str(first.id)
        if key in self.seen:  # the whole record is refused: one request, one error
            name, what = ("id", "job") if first.custom_id is None else ("custom_id", "request")
            return [InvalidRow(location, first.id, f"duplicate {name} {first.id!r}: an earlier "
                                                   f"{what} already uses it; {name}s must be unique")]
        self.seen.add(key)
        return list(jobs)


def _resolve(path: str, split: str) -> list[_Source]:
    if remote.is_uri(path):
        found = remote.kind(path)
        if found == "missing":
            raise JobError(f"{path}: no such file or directory")
        if found == "file":
            return [_file_source(path)]
        parts = [p for p in remote.list_files(path)
                 if not os.path.basename(p).startswith((".", "_")) and _kind_of(p) is not None]
        if not parts:
            raise JobError(f"{path}: directory has no .jsonl/.parquet part files")
        return [_file_source(p) for p in parts]
    if not os.path.exists(path):
        raise JobError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            return [_Source("saved", path, split)]
        parts = sorted(e.path for e in os.scandir(path)
                       if e.is_file() and not e.name.startswith((".", "_"))
                       and _kind_of(e.name) is not None)
        if not parts:
            raise JobError(f"{path}: directory has no .jsonl/.parquet part files and is not a "
                           "datasets save_to_disk directory")
        return [_file_source(p) for p in parts]
    return [_file_source(path)]


def _file_source(path: str) -> _Source:
    kind = _kind_of(path)
    if kind is None:
        raise JobError(f"{path}: unknown input format; expected one of "
                       f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}")
    if kind == "parquet":
        try:  # reads only the footer; catches truncated copies before any work is done
            pq.read_metadata(_seekable(path))
        except (OSError, pa.ArrowException) as e:
            raise JobError(f"{path}: not a readable Parquet file ({e})") from None
    elif not remote.is_uri(path) and not os.access(path, os.R_OK):
        raise JobError(f"{path}: permission denied")
    return _Source(kind, path)


def _kind_of(name: str) -> str | None:
    lower = name.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def _is_saved_dataset(path: str) -> bool:
    names = set(os.listdir(path))
    return "dataset_dict.json" in names or {"dataset_info.json", "state.json"} <= names


def _records(source: _Source) -> Iterator[Record]:
    if source.kind == "jsonl":
        return _jsonl_records(source.path)
    if source.kind == "parquet":
        return _parquet_records(source.path)
    return _dataset_records(source)


# --- JSON Lines -------------------------------------------------------------------------

def _seekable(path: str) -> Any:
    return remote.open_input_file(path) if remote.is_uri(path) else path


def _open_binary(path: str) -> BinaryIO:
    lower = path.lower()
    if remote.is_uri(path):
        raw = remote.open_input_stream(path)
        if lower.endswith(".gz"):
            return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
        codec = "zstd" if lower.endswith((".zst", ".zstd")) else None
        stream = pa.CompressedInputStream(raw, codec) if codec else raw
        return io.BufferedReader(stream, buffer_size=1 << 20)  # type: ignore[arg-type]
    if lower.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if lower.endswith((".zst", ".zstd")):
        stream = pa.CompressedInputStream(pa.OSFile(path), "zstd")
        # Arrow streams have no readline; BufferedReader gives line iteration cheaply.
        return io.BufferedReader(stream, buffer_size=1 << 20)  # type: ignore[arg-type]
    return open(path, "rb")


def _jsonl_records(path: str) -> Iterator[Record]:
    line_no = 0
    try:
        with _open_binary(path) as f:
            first = f.peek(1)[:1] if hasattr(f, "peek") else b""
            if path.lower().endswith(".json") and first.lstrip()[:1] == b"[":
                yield from _json_array_records(path, f)
                return
            for line_no, raw in enumerate(f, start=1):
                if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # UTF-8 BOM written by some Windows editors
                if not raw.strip():
                    continue
                yield Location(path, line=line_no), _parse_line(raw)
    except (OSError, EOFError, pa.ArrowException) as e:
        # Truncated gzip/zstd or an I/O error: later lines are gone, so stop loudly.
        raise JobError(f"{path}: read failed after line {line_no}: {e}") from None


def _parse_line(raw: bytes) -> dict[str, Any] | str:
    raw = raw.rstrip(b"\r\n")  # a raw newline inside an unterminated string misleads json
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"line is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        # json's messages sometimes already end in "at" ("Unterminated string starting at").
        joiner = " " if e.msg.endswith(" at") else " at "
        return f"malformed JSON: {e.msg}{joiner}column {e.colno}"
    except RecursionError:  # json's parser recurses per level: far too deep to hold anyway
        return f"a value {TOO_DEEP}"
    if not isinstance(value, dict):
        return f"expected a JSON object per line, got {_json_type(value)}"
    return value


def _json_array_records(path: str, f: BinaryIO) -> Iterator[Record]:
    # A .json file holding one array: small by nature, so loading it whole is fine.
    try:
        items = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise JobError(f"{path}: malformed JSON array ({e}); use JSON Lines for large inputs") from None
    except RecursionError:  # the array is parsed whole: no row of it can be read
        raise JobError(f"{path}: a value in the array {TOO_DEEP}; or write the rows as JSON Lines, where "
                       "only its own row is refused") from None
    for i, item in enumerate(items):
        value = item if isinstance(item, dict) else f"expected a JSON object, got {_json_type(item)}"
        yield Location(path, row=i), value


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# --- Parquet and datasets -------------------------------------------------------------

def _parquet_records(path: str) -> Iterator[Record]:
    row = 0
    try:
        pf = pq.ParquetFile(_seekable(path))
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS):
            for record in batch.to_pylist():
                yield Location(path, row=row), record
                row += 1
    except (OSError, pa.ArrowException) as e:
        raise JobError(f"{path}: Parquet read failed at row {row}: {e}") from None


def _dataset_records(source: _Source) -> Iterator[Record]:
    ds = _load_dataset(source)
    label = source.path if source.kind == "saved" else f"{source.path}[{source.split}]"
    row = 0
    # Arrow format skips feature decoding (e.g. images) so columns carry through as stored.
    for table in ds.with_format("arrow").iter(batch_size=_BATCH_ROWS):
        for record in table.to_pylist():
            yield Location(label, row=row), record
            row += 1


def _load_dataset(source: _Source) -> Any:
    import datasets  # slow to import; only pay for it when a dataset input is used

    try:
        if source.kind == "saved":
            ds = datasets.load_from_disk(source.path)
        else:
            ds = datasets.load_dataset(source.path, split=source.split)
    except Exception as e:  # datasets raises many unrelated types for "cannot load"
        raise JobError(f"{source.path}: cannot load dataset: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if source.split not in ds:
            raise JobError(f"{source.path}: no split '{source.split}'; available: "
                           f"{', '.join(ds)} (choose one with --split)")
        ds = ds[source.split]
    return ds


def input_schema(paths: Sequence[str], *, dataset: str | None = None,
                 split: str = "train") -> pa.Schema | None:
    """Arrow schema of typed inputs (Parquet, datasets), merged; None for JSONL-only input.

    Writers use it as a hint so carried-through columns keep their stored types
    (int32 stays int32) instead of whatever Python-value inference would pick.
    """
    sources = [src for p in paths for src in _resolve(p, split)]
    if dataset is not None:
        sources.append(_Source("hub", dataset, split))
    schemas = []
    for source in sources:
        if source.kind == "parquet":
            schemas.append(pq.read_schema(_seekable(source.path)))
        elif source.kind in ("saved", "hub"):
            schemas.append(_load_dataset(source).data.schema)
    if not schemas:
        return None
    try:
        return pa.unify_schemas([s.remove_metadata() for s in schemas])
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None  # conflicting part types: let the writer infer from values instead


__all__ = ["read_jobs", "jobs_of_records", "input_schema", "JSONL_SUFFIXES", "PARQUET_SUFFIXES"]
