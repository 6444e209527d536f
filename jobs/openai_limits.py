"""The Batch API's own limits on a request line, beyond batchgen's (which takes, say, a
temperature of 2.5 or 500 samples from a plain job): a line the API would refuse is refused, with
its location and field, so that a batch file that runs here runs there too (OpenAI's API
reference for /v1/chat/completions and /v1/completions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .checks import Checker, bad_type, show

# body field -> (low, high, integer?): the API's ranges (presence/frequency penalties, top_logprobs,
# logit_bias and completions' logprobs have batchgen's own check with the same range)
RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0, 2, False), "top_p": (0, 1, False), "n": (1, 128, True),
}
MAX_STOP = 4  # "up to 4 sequences"
_TEXT_FIELDS = ("model", "user", "service_tier", "prompt_cache_key", "safety_identifier")


def custom_id(check: Checker, value: Any) -> str:
    """The line's custom_id: a non-empty string (the API takes no other type)."""
    if isinstance(value, str) and value:
        return value
    if value is None:
        got = "null"
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        got = f"the number {show(value)}; write it as a string (\"{value}\")"
    else:
        got = show(value)
    raise check.fail("custom_id", f"must be a non-empty string, got {got}")


def check_body(check: Checker, body: Mapping[str, Any]) -> None:
    """Refuse a body field outside the API's range; a value of the wrong type is left to batchgen's
    own check of that field, which names the type it wants."""
    for name, (low, high, integer) in RANGES.items():
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if integer and not float(value).is_integer():
            continue
        if not low <= value <= high:
            what = f"an integer in [{low}, {high}]" if integer else f"a number in [{low}, {high}]"
            raise check.fail(f"body.{name}", f"must be {what} (the Batch API's range), got {value}")
    stop = body.get("stop")
    if isinstance(stop, (list, tuple)) and len(stop) > MAX_STOP:
        raise check.fail("body.stop", f"has {len(stop)} sequences; the Batch API takes at most {MAX_STOP}")
    for name in _TEXT_FIELDS:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise check.fail(f"body.{name}", bad_type(body[name], "a string"))
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise check.fail("body.store", bad_type(body["store"], "true or false"))
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, Mapping)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise check.fail("body.metadata", f"must be an object of string values, got {show(metadata)}")
