"""The columns batchgen writes, and how a value becomes JSON text: shared by the result writers
(writers.py), the OpenAI Batch writers (openai_batch.py) and the runner's parts.

An input column of one of these names is refused (schema.RESERVED_COLUMNS): it would silently
overwrite or be overwritten by the value batchgen writes.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
from typing import Any, Mapping, Sequence

import pyarrow as pa

# Result columns, in output order after the carried-through input columns.
RESULT_FIELDS: tuple[pa.Field, ...] = (
    pa.field("sample_index", pa.int32()),
    pa.field("completion", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("cached_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
)
RESULT_COLUMNS = ("id",) + tuple(f.name for f in RESULT_FIELDS)
# Columns only an output whose jobs ask for them has (null in the rows of the other jobs), by the
# output they hold: the element of an OpenAI list prompt (its rows share the request's id),
# generated tokens' logprobs, prompt tokens' logprobs, continuation scores, the LoRA adapter a job
# ran with (its name or path; null: the base model).
_TOKEN = [pa.field("token", pa.string()), pa.field("id", pa.int64()), pa.field("logprob", pa.float64())]
OUTPUT_FIELDS: dict[str, tuple[pa.Field, ...]] = {
    "prompt_index": (pa.field("prompt_index", pa.int32()),),
    "logprobs": (pa.field("logprobs", pa.list_(pa.struct(_TOKEN + [pa.field("top", pa.list_(pa.struct(_TOKEN)))]))),),
    "prompt_logprobs": (pa.field("prompt_logprobs", pa.list_(pa.float64())),),
    "scores": (pa.field("scores", pa.list_(pa.struct([
        pa.field("continuation", pa.string()), pa.field("logprob", pa.float64()), pa.field("tokens", pa.int64()),
        pa.field("is_greedy", pa.bool_())]))), pa.field("best_continuation", pa.string())),
    "adapter": (pa.field("adapter", pa.string()),),
    # a conversation's every generated turn (its text as written, cut before a stop string), why
    # each ended and its tokens; `completion` and its counts are the last turn's
    "turns": (pa.field("turns", pa.list_(pa.string())), pa.field("turn_finish_reasons", pa.list_(pa.string())),
              pa.field("turn_completion_tokens", pa.list_(pa.int64()))),
}
OUTPUT_COLUMNS = tuple(f.name for fields in OUTPUT_FIELDS.values() for f in fields)
ORDER = "_batchgen_order"  # a row's position in the input (the runner's parts and the shard outputs carry it)
CREATED = "_batchgen_created"  # a job's completion time (Unix seconds), kept for OpenAI output
ERROR_SCHEMA = pa.schema([pa.field("id", pa.string()), pa.field("location", pa.string()),
                          pa.field("reason", pa.string())])


def json_default(value: Any) -> Any:
    """JSON for the values Arrow inputs hold that `json` cannot write (dates, decimals, bytes)."""
    if isinstance(value, (_dt.date, _dt.datetime, _dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, _dt.timedelta):
        return value.total_seconds()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=json_default)


def check_required(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> None:
    """Refuse result rows that lack a result column's value (of those in `names`)."""
    # A missing token count is an engine bug; fail here rather than write nulls.
    missing = [c for c in RESULT_COLUMNS if c in names and any(r.get(c) is None for r in rows)]
    if missing:
        raise ValueError(f"result rows lack required value(s) for {', '.join(missing)}")
