"""A batch's input checked as the Batch API checks it before running anything, its request counts
as its parts commit, and its output and error files read back when it ends.

The Batch API fails a whole batch whose file it cannot take: a line that is not JSON, a request
whose `url` is not the batch's endpoint or whose `body.model` is not the batch's model, a repeated
`custom_id`, an empty file, too many requests or bytes. Each problem is an `errors` entry with
its code, message and 1-based line (OpenAI's codes: invalid_json_line, url_mismatch,
model_mismatch, duplicate_custom_id, empty_file, too_many_tasks). Everything else about a request
(its parameters) is the runner's to check: a bad request is a line of the error file, and the
batch runs the others, as the API does.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from batchgen.jobs.columns import ORDER
from batchgen.jobs.openai_batch import NOT_RUN
from batchgen.jobs.schema import OPENAI_ENDPOINTS

MAX_REQUESTS = 50_000  # the Batch API's limits on one input file
MAX_FILE_BYTES = 200 * 1024 * 1024
MAX_LISTED = 1000  # problems listed in a failed batch's errors (the count of the rest is the last entry)


@dataclass
class Checked:
    total: int = 0  # requests
    model: str | None = None
    problems: list[dict[str, Any]] = field(default_factory=list)
    custom_ids: set[str] = field(default_factory=set)

    def fail(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(self.problems) < MAX_LISTED:
            self.problems.append({"code": code, "message": message, "param": param, "line": line})


def check_input(path: str, endpoint: str, max_requests: int = MAX_REQUESTS,
                max_bytes: int = MAX_FILE_BYTES) -> Checked:
    """Every line of the batch input at `path` against the batch's `endpoint` and the limits.
    Blank lines are not requests (as `batchgen process` reads JSON Lines); line numbers count
    every line of the file."""
    out = Checked()
    size = os.path.getsize(path)
    if size > max_bytes:
        out.fail("file_too_large", f"The input file has {size} bytes; a batch takes at most {max_bytes}.")
        return out
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue
            out.total += 1
            if out.total > max_requests:
                continue  # counted for the message below, not checked
            _check_line(out, raw, line_no, endpoint)
    if out.total == 0:
        out.fail("empty_file", "The batch input file is empty: it holds no requests.")
    elif out.total > max_requests:
        out.fail("too_many_tasks", f"The input file holds {out.total} requests; a batch takes at most "
                                   f"{max_requests}.")
    return out


def _check_line(out: Checked, raw: bytes, line: int, endpoint: str) -> None:
    try:
        request = json.loads(raw.rstrip(b"\r\n").decode("utf-8"))  # (a column past the line's end, not 1)
    except UnicodeDecodeError:
        return out.fail("invalid_json_line", f"Line {line} is not valid UTF-8 text.", line)
    except json.JSONDecodeError as e:
        return out.fail("invalid_json_line", f"Line {line} is not parseable as valid JSON: {e.msg} at column "
                                             f"{e.colno}.", line)
    except RecursionError:
        return out.fail("invalid_json_line", f"Line {line} nests values too deeply to be parsed.", line)
    if not isinstance(request, dict):
        return out.fail("invalid_json_line", f"Line {line} is not a JSON object.", line)
    cid = request.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return out.fail("invalid_request", f"Line {line}: custom_id must be a non-empty string.", line,
                        "custom_id")
    if cid in out.custom_ids:
        return out.fail("duplicate_custom_id", f"Line {line}: the custom_id {cid!r} is used by an earlier "
                                               "request; each request needs its own.", line, "custom_id")
    out.custom_ids.add(cid)
    if request.get("method") != "POST":
        return out.fail("invalid_request", f"Line {line}: method must be 'POST', got "
                                           f"{json.dumps(request.get('method'))}.", line, "method")
    url = request.get("url")
    if url != endpoint:
        known = "" if url in OPENAI_ENDPOINTS else f" (batchgen serves {', '.join(OPENAI_ENDPOINTS)})"
        return out.fail("url_mismatch", f"Line {line}: the url {json.dumps(url)} does not match the batch's "
                                        f"endpoint {endpoint}{known}.", line, "url")
    body = request.get("body")
    if not isinstance(body, dict):
        return out.fail("invalid_request", f"Line {line}: body must be a JSON object.", line, "body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return out.fail("invalid_request", f"Line {line}: body.model must be a non-empty string.", line,
                        "body.model")
    if out.model is None:
        out.model = model
    elif model != out.model:
        out.fail("model_mismatch", f"Line {line}: the model {model!r} is not the batch's model {out.model!r} "
                                   "(of its first request); a batch runs one model.", line, "body.model")


def custom_ids(path: str) -> list[str]:
    """The custom_ids of a checked input file, in order."""
    with open(path, "rb") as f:
        return [json.loads(raw.removeprefix(b"\xef\xbb\xbf"))["custom_id"] for raw in f if raw.strip()]


class Committed:
    """Jobs committed so far in a run's parts (`OUTPUT.parts/`), answered and failed: each part file
    is read once (its input positions only), as the manifest names it."""

    def __init__(self, parts_dir: str) -> None:
        self.dir = parts_dir
        self._seen: dict[str, int] = {}

    def counts(self) -> tuple[int, int]:
        import pyarrow.parquet as pq  # (here: the CLI reads this module's limits at its start)

        try:
            with open(os.path.join(self.dir, "manifest.json")) as f:
                names = [n for part in json.load(f)["parts"] for n in part["files"]]
        except (OSError, ValueError, KeyError, TypeError):
            names = []  # none yet, or the run just finished and removed them
        for name in names:
            if name not in self._seen:
                try:
                    orders = pq.read_table(os.path.join(self.dir, name), columns=[ORDER])[ORDER]
                except (OSError, ValueError):
                    continue  # removed under us: the run ended; its output files count from now on
                self._seen[name] = len(set(orders.to_pylist()))  # a job's samples share its position
        done = sum(v for k, v in self._seen.items() if k.startswith("part-"))
        return done, sum(v for k, v in self._seen.items() if k.startswith("errors-"))


@dataclass
class Outcome:
    completed: int  # requests answered
    failed: int  # requests that failed (not those the batch ended before they ran)
    usage: dict[str, Any]
    problem: str | None  # a custom_id missing or repeated across the two files: never expected


def read_outcome(output: str, errors: str, wanted: list[str]) -> Outcome:
    """The counts, the token usage and the exactly-once check of a run's output and error files."""
    seen: dict[str, int] = {}
    completed = failed = 0
    usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    for path, answered in ((output, True), (errors, False)):
        if not os.path.exists(path):
            continue
        with open(path, "rb") as f:
            for raw in f:
                line = json.loads(raw)
                seen[line["custom_id"]] = seen.get(line["custom_id"], 0) + 1
                if answered:
                    completed += 1
                    u = line["response"]["body"]["usage"]
                    usage["input_tokens"] += u["prompt_tokens"]
                    usage["output_tokens"] += u["completion_tokens"]
                    usage["total_tokens"] += u["total_tokens"]
                    usage["input_tokens_details"]["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
                elif line["error"]["code"] not in NOT_RUN:
                    failed += 1
    problem = None
    missing = [c for c in wanted if c not in seen]
    repeated = [c for c, n in seen.items() if n > 1]
    if missing or repeated or len(seen) != len(wanted):
        problem = (f"the output and error files hold {len(seen)} custom_ids for {len(wanted)} requests "
                   f"(missing: {missing[:3]}, repeated: {repeated[:3]})")
    return Outcome(completed, failed, usage, problem)


def lines_in(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())
