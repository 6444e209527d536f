"""Plain rows of JSON Lines in bulk: Arrow's JSON reader parses a run of lines at once, and its
columns are checked at once (jobs/chunks.py takes the rows that pass as plain rows).

Only runs whose every row holds a prompt and at most an id are taken here (any other field, a
float or a bool id, ... : the caller reads the lines one by one). What Arrow's reader (RapidJSON)
takes differently from json.loads makes it fail or makes a column of another type, and either
sends the lines back to the caller: a key given twice ("specified twice"), a lone surrogate
escape, NaN or Infinity and integers past int64 (a float column), a string id that looks like a
date (a timestamp column). Arrow also takes what a JSON Lines reader must not: two objects on one
line, an object over several lines, blank lines. The caller hands in only lines that start with
`{`, and a run is taken only where Arrow made exactly one row per line: in a run whose values are
strings and numbers, no object can go on past its line's end, so then each row is its line's
object. Strings are made Python strings by Python's own UTF-8 decoder (`to_pylist`): bytes it
refuses send the run back, as the reference path refuses such a line.

A row that passes is what the reference path makes a job of as it stands, except for its id's
uniqueness, which the caller checks against the ids seen; a row that may not pass (no prompt, an
empty or a blank one, an empty string id) is marked, and the caller reads it alone.
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.json as pj

# the prompt is a string, so no date-like prompt becomes a timestamp; the id's type is inferred
_PARSE = pj.ParseOptions(explicit_schema=pa.schema([("prompt", pa.string())]), unexpected_field_behavior="infer")
_ID_TYPES = (pa.int64(), pa.string(), pa.null())
_ERROR_ROW = re.compile(r" in row (\d+)$")


@dataclass
class Columns:
    """A run's rows: ids (None: the row's default id), prompts, and the rows that may not be
    plain as they stand (read alone), by index."""

    ids: list[int | str | None]
    prompts: list[str | None]
    alone: list[int]


def plain_columns(block: bytes, lines: int) -> Columns | int | None:
    """The rows of `block` (`lines` lines, each starting with `{`) where each line is a plain
    row's object; else the row Arrow's error names (a hint: the run before it may parse), or None."""
    try:  # malloc's pool: Arrow's default (mimalloc) keeps tens of MB of the parser's buffers
        table = pj.read_json(io.BytesIO(block), read_options=pj.ReadOptions(use_threads=False,
                                                                             block_size=len(block) + 1),
                             parse_options=_PARSE, memory_pool=pa.system_memory_pool())
    except pa.ArrowInvalid as e:
        found = _ERROR_ROW.search(str(e))
        return int(found.group(1)) if found else None
    if table.num_rows != lines or not set(table.column_names) <= {"prompt", "id"}:
        return None
    prompt = table.column("prompt")
    ids = table.column("id") if "id" in table.column_names else None
    if prompt.type != pa.string() or ids is not None and ids.type not in _ID_TYPES:
        return None
    try:
        prompts = prompt.to_pylist()
        id_list = ids.to_pylist() if ids is not None else [None] * lines
    except UnicodeDecodeError:  # not UTF-8: the reference path words it, line by line
        return None
    alone: list[int] = []
    # no prompt, an empty or a blank one (str.isspace: the reference's own test), an empty id: alone
    if None in prompts or "" in prompts or any(map(str.isspace, filter(None, prompts))) or "" in id_list:
        alone = [k for k, (p, i) in enumerate(zip(prompts, id_list)) if not p or p.isspace() or i == ""]
    return Columns(id_list, prompts, alone)


__all__ = ["Columns", "plain_columns"]
