"""Rows in chunks, with a fast path for the commonest rows of a big JSON Lines file.

A million-row input is mostly rows like ``{"id": 17, "prompt": "...", "subject": "law"}``: a
prompt, at most an id, and maybe columns to carry through to the output. Through the reference
path (``readers.read_jobs``: json.loads, a Location, then ``Job.from_record`` with every field
check) such a row costs 10-25 us of Python. It can fail only a few checks, so here they run in
bulk or in line. Runs of lines holding only a prompt and an id are parsed by Arrow's JSON reader
and checked as columns (jobs/bulkjson.py says where its parse and json.loads part ways, and how
such lines are sent back); any other line is parsed by json's own C scanner (what json.loads
runs, without its Python layers), then the id's type and range, lone surrogates (in any string
or key), a blank prompt, an id used before, and that every other field is a plain column (no
generation parameter, nothing batchgen reads or refuses) are checked. The row stays in columns
(``PlainRows``: line numbers, ids, prompts, carried columns), with no Job or Location object,
until a caller asks for one (``PlainRows.job``).

Every other row, and every row this path is unsure of (a parse error, a field the reference
reads, a float id, a surrogate, a value nested deeper than `_NESTING` ...), goes through the
reference path's own per-record step (``readers.RecordJobs``), which numbers the records and
keeps the ids seen for both paths: the jobs, errors and messages are those of read_jobs
(tests/run/test_chunks.py and tests/run/test_bulkjson.py compare the two). The
fast path runs only where a plain row means one job whatever the options: no --prompt-template,
no --system; Parquet and datasets inputs take the per-record path.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import islice, repeat
from typing import Any, Iterable, Iterator, Sequence

import pyarrow as pa

from .bulkjson import Columns, plain_columns
from .errors import JobError, Location
from . import readers
from .readers import RecordJobs, _json_array_records, _parse_line, resolve_sources
from .params import RESERVED
from .schema import JOB_KEYS, RESERVED_COLUMNS, GenerationDefaults, InvalidRow, Job
from .text import encodes

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_SCAN = json.decoder.JSONDecoder().scan_once  # json.loads' scanner, with its default decoder's options
_BOM = b"\xef\xbb\xbf"
# fields Job.from_record reads or refuses, and body (with custom_id, an OpenAI request): a row
# holding one takes the reference path; any other field is a column carried through as it is
_NOT_CARRIED = RESERVED | frozenset(JOB_KEYS) | frozenset(RESERVED_COLUMNS) | {"body"}
_NESTING = 32  # carried values nested deeper go to the reference path (its checks recurse)
_BULK_LINES = 2048  # lines read and handed to Arrow's reader together (a refused row costs a second parse of
# the lines before it: not many)
_BULK_MIN = 16  # a shorter run of lines is read one by one (Arrow's call costs more than it saves)
_ARROW_TRIES = 16  # Arrow calls per batch of lines; then the rest are read one by one (many odd rows)


@dataclass
class PlainRows:
    """Rows of one input that are each a valid job as they stand: a prompt and at most an id."""

    path: str
    orders: list[int] = field(default_factory=list)  # input positions (read_jobs' item numbers)
    lines: list[int] = field(default_factory=list)  # 1-based line numbers
    ids: list[int | str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    extras: dict[int, dict[str, Any]] = field(default_factory=dict)  # row -> its carried columns, if any

    def __len__(self) -> int:
        return len(self.orders)

    def location(self, k: int) -> Location:
        return Location(self.path, line=self.lines[k])

    def job(self, k: int, template: Job) -> Job:
        """Row k as Job.from_record makes it; `template`: `plain_template` of the run's defaults
        (a plain row's job differs from it only in these four fields)."""
        job = object.__new__(Job)
        job.__dict__.update(template.__dict__)
        job.id, job.prompt, job.location = self.ids[k], self.prompts[k], self.location(k)
        job.extra = self.extras.get(k) or {}
        return job


def plain_template(defaults: GenerationDefaults) -> Job:
    """A plain row's job under these defaults, made by the reference path itself."""
    [job] = Job.from_record({"prompt": "x"}, Location(""), defaults, 0)
    return job


@dataclass
class Chunk:
    """Consecutive input items: what the per-record path made (jobs and invalid rows, by input
    position) and plain rows in columns. `end`: items read so far, this chunk's included."""

    items: list[tuple[int, Job | InvalidRow]]
    plain: list[PlainRows]
    end: int

    def __len__(self) -> int:
        return len(self.items) + sum(len(p) for p in self.plain)

    def in_order(self, template: Job) -> list[tuple[int, Job | InvalidRow]]:
        """Every item as read_jobs yields it, with its input position, in input order."""
        out = list(self.items)
        for rows in self.plain:
            out += [(o, rows.job(k, template)) for k, o in enumerate(rows.orders)]
        return sorted(out, key=lambda item: item[0]) if self.plain and self.items else out


def read_chunks(paths: Sequence[str], defaults: GenerationDefaults, *, dataset: str | None = None,
                split: str = "train", prompt_template: str | None = None, system: str | None = None,
                size: int = 8192, carried: bool = True) -> Iterator[Chunk]:
    """read_jobs' items in chunks of `size` (the last may be smaller, or empty); inputs are
    checked on the call, as read_jobs does. `carried`: plain rows may carry other columns (else
    such rows are Jobs: a caller that checks carried values against typed inputs needs Jobs)."""
    sources = resolve_sources(paths, dataset=dataset, split=split, prompt_template=prompt_template)
    state = RecordJobs(defaults, prompt_template, system)
    return _chunks(sources, state, _Chunker(size), fast=prompt_template is None and system is None,
                   carried=carried)


class _Chunker:
    def __init__(self, size: int) -> None:
        self.size, self.order = size, 0
        self.items: list[tuple[int, Job | InvalidRow]] = []
        self.plain: list[PlainRows] = []
        self.count = 0  # items in the chunk being filled

    def add(self, items: Iterable[Job | InvalidRow]) -> Iterator[Chunk]:
        for item in items:
            self.items.append((self.order, item))
            self.order += 1
            self.count += 1
            if self.count >= self.size:
                yield self.take()

    def take(self) -> Chunk:
        chunk = Chunk(self.items, [p for p in self.plain if len(p)], self.order)
        self.items, self.plain, self.count = [], [], 0  # a reader filling plain rows starts new ones
        return chunk


def _chunks(sources: list, state: RecordJobs, out: _Chunker, fast: bool, carried: bool) -> Iterator[Chunk]:
    for source in sources:
        if fast and source.kind == "jsonl":
            yield from _jsonl(source.path, state, out, carried)
        else:
            for location, record in readers._records(source):
                yield from out.add(state.of(location, record))
    yield out.take()


def _jsonl(path: str, state: RecordJobs, out: _Chunker, carried: bool) -> Iterator[Chunk]:
    """_jsonl_records' lines (the same BOM, blank-line and read-error rules), plain rows in bulk."""
    line_no = 0
    try:
        with readers._open_binary(path) as f:
            first = f.peek(1)[:1] if hasattr(f, "peek") else b""
            if path.lower().endswith(".json") and first.lstrip()[:1] == b"[":
                for location, record in _json_array_records(path, f):
                    yield from out.add(state.of(location, record))
                return
            lines = _Lines(path, state, out, carried)
            failed: Exception | None = None
            while failed is None:
                batch: list[bytes] = []
                # a read error: the lines read before it are taken first, as the reference takes them
                try:  # (list.extend keeps what the iterator gave before it raised)
                    batch.extend(islice(f, _BULK_LINES))
                except (OSError, EOFError, pa.ArrowException) as e:
                    failed = e
                if line_no == 0 and batch and batch[0].startswith(_BOM):
                    batch[0] = batch[0][3:]  # UTF-8 BOM written by some Windows editors
                line_no += len(batch)
                yield from lines.bulk(batch, line_no - len(batch) + 1)
                if len(batch) < _BULK_LINES:
                    break
            if failed is not None:
                raise failed
    except (OSError, EOFError, pa.ArrowException) as e:
        # Truncated gzip/zstd or an I/O error: later lines are gone, so stop loudly.
        raise JobError(f"{path}: read failed after line {line_no}: {e}") from None


class _Lines:
    """One JSON Lines file's lines into chunks: runs of plain rows through Arrow's reader
    (jobs/bulkjson.py), every other line alone (`one_by_one`: json's scanner, else the reference's
    parse), in input order."""

    def __init__(self, path: str, state: RecordJobs, out: _Chunker, carried: bool) -> None:
        self.path, self.state, self.out, self.carried = path, state, out, carried
        self.rows = self._new_rows()
        self.tries = _ARROW_TRIES

    def _new_rows(self) -> PlainRows:
        rows = PlainRows(self.path)
        self.out.plain.append(rows)
        return rows

    def _taken(self) -> Chunk:
        chunk = self.out.take()
        self.rows = self._new_rows()
        return chunk

    def bulk(self, lines: list[bytes], first: int) -> Iterator[Chunk]:
        """`lines`: lines `first`, `first` + 1, ... of the file."""
        self.tries = _ARROW_TRIES
        if sum(map(bytes.startswith, lines, repeat(b"{"))) == len(lines):  # each line starts an object
            yield from self._runs(lines, 0, len(lines), first)
            return
        i = 0
        for j, raw in enumerate(lines):  # blank lines, malformed ones: alone, between runs
            if raw[:1] != b"{":
                yield from self._runs(lines, i, j, first)
                yield from self.one_by_one(lines[j:j + 1], first + j)
                i = j + 1
        yield from self._runs(lines, i, len(lines), first)

    def _runs(self, lines: list[bytes], i: int, j: int, first: int) -> Iterator[Chunk]:
        """Lines i..j (each starting with `{`) through Arrow, split where it names a row it refuses."""
        while j - i >= _BULK_MIN and self.tries:
            self.tries -= 1
            found = plain_columns(b"".join(lines[i:j]), j - i)
            if isinstance(found, Columns):
                yield from self._columns(found, lines, i, first)
                return
            if found is None or not 0 <= found < j - i:  # no row to split at: the lines alone
                break
            yield from self._runs(lines, i, i + found, first)  # the run before the refused row
            yield from self.one_by_one(lines[i + found:i + found + 1], first + i + found)
            i += found + 1
        yield from self.one_by_one(lines[i:j], first + i)

    def _columns(self, found: Columns, lines: list[bytes], i: int, first: int) -> Iterator[Chunk]:
        """A run's rows in order: plain ones in columns, the others alone."""
        k = 0
        for end in found.alone + [len(found.ids)]:
            if end > k:
                yield from self._plain(found.ids[k:end], found.prompts[k:end], lines, i + k, first)
            if end < len(found.ids):
                yield from self.one_by_one(lines[i + end:i + end + 1], first + i + end)
            k = end + 1

    def _plain(self, ids: list, prompts: list, lines: list[bytes], i: int, first: int) -> Iterator[Chunk]:
        """Rows that are plain jobs as they stand, but for their ids: in columns up to an id used
        before, which is read alone (the reference words it), and so on."""
        state = self.state
        while ids:
            number = state.number
            if None in ids:  # no id (or null): the record number is the id
                ids = [number + k if v is None else v for k, v in enumerate(ids)]
            keys = list(map(str, ids))
            cut = len(keys)
            if len(set(keys)) < cut or not state.seen.isdisjoint(keys):
                seen, run = state.seen, set()
                cut = next(k for k, key in enumerate(keys) if key in seen or key in run or run.add(key))
            state.seen.update(keys[:cut])
            state.number += cut
            yield from self._columns_of(ids[:cut], prompts[:cut], first + i)
            if cut == len(keys):
                return
            yield from self.one_by_one(lines[i + cut:i + cut + 1], first + i + cut)
            ids, prompts, i = ids[cut + 1:], prompts[cut + 1:], i + cut + 1

    def _columns_of(self, ids: list, prompts: list, line: int) -> Iterator[Chunk]:
        out = self.out
        at = 0
        while at < len(ids):
            take = min(len(ids) - at, out.size - out.count)
            rows = self.rows
            rows.orders.extend(range(out.order, out.order + take))
            rows.lines.extend(range(line + at, line + at + take))
            rows.ids.extend(ids[at:at + take])
            rows.prompts.extend(prompts[at:at + take])
            out.order += take
            out.count += take
            at += take
            if out.count >= out.size:
                yield self._taken()

    def one_by_one(self, lines: list[bytes], first: int) -> Iterator[Chunk]:
        """Each line parsed by json's scanner and checked in line (rows carrying columns, say), or
        by the reference path."""
        path, state, out, carried = self.path, self.state, self.out, self.carried
        rows, seen = self.rows, state.seen
        for line_no, raw in enumerate(lines, start=first):
            record: Any = None
            if raw[:1] == b"{":
                try:
                    text = raw.decode("utf-8")
                    record, end = _SCAN(text, 0)
                    if text[end:].strip(" \t\n\r"):  # more after the object: the reference words it
                        record = None
                except Exception:  # noqa: BLE001 - any failure: the reference path parses it again
                    record = None
                if type(record) is dict:
                    job_id = _plain_id(record, state.number, seen, carried)
                    extra = None
                    if job_id is not None and len(record) > 1 + ("id" in record):
                        extra = _carried(record)
                        # a nested value: the reference's parse must take the line too (its limits hold)
                        if extra is None or (any(type(v) is list or type(v) is dict for v in extra.values())
                                             and type(_parse_line(raw)) is not dict):
                            job_id = None
                    if job_id is not None:
                        if extra:
                            rows.extras[len(rows.ids)] = extra
                        state.number += 1
                        seen.add(str(job_id))
                        rows.orders.append(out.order)
                        rows.lines.append(line_no)
                        rows.ids.append(job_id)
                        rows.prompts.append(record["prompt"])
                        out.order += 1
                        out.count += 1
                        if out.count >= out.size:
                            yield self._taken()
                            rows = self.rows
                        continue
                record = None  # the reference parses the line itself: its rules and messages
            elif not raw.strip():
                continue
            for chunk in out.add(state.of(Location(path, line=line_no), _parse_line(raw))):
                yield chunk
                if not out.plain or out.plain[-1] is not rows:
                    rows = self.rows = self._new_rows()


def _plain_id(row: dict, default_id: int, seen: set[str], carried: bool = False) -> int | str | None:
    """The job id of a row that is a valid plain job as it stands (Job.from_record's checks that
    such a row can fail, and no earlier job with its id); None: the reference path decides. With
    `carried`, a row may have other fields (which `_carried` must pass)."""
    prompt = row.get("prompt")
    if type(prompt) is not str or not prompt or prompt.isspace() or not (prompt.isascii() or encodes(prompt)):
        return None
    if "id" not in row:
        if len(row) > 1 and not carried:
            return None
        job_id: Any = default_id
    else:
        if len(row) > 2 and not carried:
            return None
        job_id = row["id"]
        kind = type(job_id)
        if job_id is None:
            job_id = default_id
        elif kind is int:
            if not _INT64_MIN <= job_id <= _INT64_MAX:
                return None
        elif kind is not str or not job_id or not (job_id.isascii() or encodes(job_id)):
            return None
    return None if str(job_id) in seen else job_id


def _carried(row: dict) -> dict[str, Any] | None:
    """The fields of a row other than its id and prompt, where each is a column Job.from_record
    carries as it is (its `extra`): no name it reads or refuses, no lone surrogate in a name or a
    string, nothing nested deeper than _NESTING; None: the reference path decides."""
    extra = {}
    for key, value in row.items():
        if key == "id" or key == "prompt":
            continue
        if key in _NOT_CARRIED or not (key.isascii() or encodes(key)):
            return None
        kind = type(value)
        if kind is str:
            if not (value.isascii() or encodes(value)):
                return None
        elif (kind is list or kind is dict) and not _valid_text(value, _NESTING - 1):
            return None
        extra[key] = value
    return extra


def _valid_text(value: Any, depth: int) -> bool:
    """Every string and key in a parsed JSON value is valid Unicode (`text.bad_text_at` finds
    nothing), and its lists and objects nest at most `depth` deep."""
    kind = type(value)
    if kind is str:
        return value.isascii() or encodes(value)
    if kind is dict:
        return depth > 0 and all((key.isascii() or encodes(key)) and _valid_text(item, depth - 1)
                                 for key, item in value.items())
    if kind is list:
        return depth > 0 and all(_valid_text(item, depth - 1) for item in value)
    return True


__all__ = ["Chunk", "PlainRows", "plain_template", "read_chunks"]
