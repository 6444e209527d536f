"""OpenAI Batch API output: the output file (one line per request) and the error file (one line
per failed request), in the shapes the Batch API documents.

Output line: ``{id, custom_id, response: {status_code, request_id, body}, error: null}`` with a
``chat.completion`` or ``text_completion`` body. Error line: ``{id, custom_id, response: null,
error: {code, message}}``. Line ids are random per line (``batch_req_…``), so two runs never
share one; ``created`` is when the request's last sample finished; ``model`` echoes an OpenAI
request's ``body.model`` (else the model batchgen ran; a plain job's ``model`` column is data, not
a request's model); ``system_fingerprint`` names batchgen's version, the model and its precision.
Rows carry what only this writer reads, set by the runner from the job (:func:`openai_fields`):
``endpoint``, ``custom_id``, ``prompt_index`` (an element of a completions request's list prompt),
``request_model``, and ``request``, the request a row belongs to (:func:`request_key`): custom_ids
are the user's and may repeat in an input (the repeat is an error line), so rows are grouped and
failed by ``request``, never by custom_id.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any, Container, Iterable, Mapping, Sequence

from .atomic import AtomicWriter, WrittenIfAny
from .schema import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, InvalidRow, Job
from .columns import CREATED, RESULT_COLUMNS, check_required, dumps

GENERATION_FAILED = "generation failed: "  # how the runner words a job that failed while generating
# requests a Batch service ended before they ran (`batchgen serve`'s cancel and expiry): the code
# of their error line, and its message, as the Batch API words an expired request
NOT_RUN = {"batch_cancelled": "this request was not executed: the batch was cancelled",
           "batch_expired": "this request could not be executed before the completion window expired"}


def not_run_reason(code: str) -> str:
    """The reason an error row carries for a request ended before it ran (a NOT_RUN code)."""
    return f"{code}: {NOT_RUN[code]}"


def _rid(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def request_key(order: int, prompt_index: int | None) -> int:
    """The request an input item belongs to: its input position, or for an element of a list
    prompt the position of the request's first element (a record's items are consecutive)."""
    return order - (prompt_index or 0)


def openai_fields(job: Job, prompt_tokens: list[str] | None = None) -> dict[str, Any]:
    """What an OpenAI output line needs of a row's job beyond its result columns; with ``echo``
    (prompt_logprobs on /v1/completions), its prompt, and its tokens' texts when it has logprobs."""
    echo = job.prompt_logprobs and job.openai_endpoint == COMPLETIONS_ENDPOINT and job.prompt is not None
    return {"endpoint": job.openai_endpoint, "custom_id": job.custom_id or str(job.id),
            "prompt_index": job.prompt_index, "request_model": job.request_model,
            "echo": job.prompt if echo else None, "echo_tokens": prompt_tokens if echo else None}


def chat_logprobs(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """A chat choice's logprobs, as the chat API has them: each token with its bytes (the
    runner's, `results.content_logprobs`: the token's own, also of part of a character; else its
    text's) and its alternatives."""
    if row.get("logprobs") is None:
        return None

    def entry(t: Mapping[str, Any]) -> dict[str, Any]:
        raw = t.get("bytes")
        return {"token": t["token"], "logprob": t["logprob"],
                "bytes": list(raw if raw is not None else t["token"].encode("utf-8"))}

    return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in t["top"]]} for t in row["logprobs"]],
            "refusal": None}


def completion_logprobs(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """A text completion's logprobs, the legacy shape: parallel lists of tokens, their logprobs,
    their alternatives ({token: logprob}) and their offsets in the choice's text. With echo the
    prompt's tokens come first: the first has no logprob, none has alternatives (batchgen scores
    each prompt token, it does not rank the others there)."""
    if row.get("logprobs") is None:
        return None
    tokens, logprobs, tops = [], [], []
    if row.get("echo") is not None:
        tokens += row["echo_tokens"]
        logprobs += row["prompt_logprobs"]
        tops += [None] * len(row["echo_tokens"])
    for t in row["logprobs"]:
        tokens.append(t["token"])
        logprobs.append(t["logprob"])
        tops.append({a["token"]: a["logprob"] for a in t["top"]})
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def whole_requests(rows: list[dict[str, Any]], failed: Container[int]) -> list[dict[str, Any]]:
    """The result rows of requests that did not fail (`failed`: the ``request`` of each error
    row): a request whose list prompt had one element fail is an error line only, as the API
    fails a request whole. Another request with the same custom_id is not this one."""
    return [r for r in rows if r["request"] not in failed]


class OpenAIBatchWriter(AtomicWriter):
    """One line per request, its samples (and list-prompt elements) as choices. Samples of one
    request may arrive in separate write() calls, so rows are held until close (memory ~ output
    size), then written in first-seen order."""

    def __init__(self, path: str | os.PathLike[str], schema: Any = None, overwrite: bool = False, *, model: str,
                 endpoint: str = CHAT_ENDPOINT, fingerprint: str | None = None) -> None:
        super().__init__(path, overwrite)
        if endpoint not in (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT):
            raise ValueError(f"unknown endpoint {endpoint!r}")
        self.schema, self.model, self.endpoint = schema, model, endpoint
        self.fingerprint = fingerprint or f"batchgen:{model}"
        self._requests: dict[Any, list[Mapping[str, Any]]] = {}

    _allow_gzip = True

    def write(self, rows: Sequence[Mapping[str, Any]]) -> None:
        check_required(rows, RESULT_COLUMNS)
        for r in rows:
            key = r.get("request")
            self._requests.setdefault(("custom_id", _custom_id(r)) if key is None else key, []).append(r)

    def _finish(self) -> None:
        for samples in self._requests.values():
            line = response_line(_custom_id(samples[0]), samples, self.model, self.endpoint, self.fingerprint)
            self._file.write((dumps(line) + "\n").encode("utf-8"))  # type: ignore[union-attr]
        self._requests.clear()


def response_line(custom_id: str, samples: list[Mapping[str, Any]], model: str, default_endpoint: str,
                  fingerprint: str) -> dict[str, Any]:
    samples = sorted(samples, key=lambda r: (r.get("prompt_index") or 0, r["sample_index"]))
    chat = samples[0].get("endpoint", default_endpoint) == CHAT_ENDPOINT
    choices = []
    for index, s in enumerate(samples):  # element i, sample k: index i * n + k, as the API numbers them
        choice: dict[str, Any] = {"index": index}
        if chat:
            choice["message"] = {"role": "assistant", "content": s["completion"], "refusal": None, "annotations": []}
            choice["logprobs"] = chat_logprobs(s)
        else:
            choice["text"] = (s.get("echo") or "") + s["completion"]  # echo: the prompt, then the completion
            choice["logprobs"] = completion_logprobs(s)
        # a prompt scored without generating: the API's max_tokens 0 ends at its length
        choice["finish_reason"] = "length" if s["finish_reason"] == "scored" else s["finish_reason"]
        choices.append(choice)
    # a prompt is counted once per request (each list element's once), its samples' tokens all
    firsts = [s for s in samples if s["sample_index"] == 0] or samples[:1]
    prompt_tokens = sum(int(s["prompt_tokens"]) for s in firsts)
    completion_tokens = sum(int(s["completion_tokens"]) for s in samples)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(int(s["cached_tokens"]) for s in firsts)}}
    if chat:  # the chat API's breakdown; batchgen has no reasoning, audio or predicted tokens
        usage["prompt_tokens_details"]["audio_tokens"] = 0
        usage["completion_tokens_details"] = {"reasoning_tokens": 0, "audio_tokens": 0,
                                              "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    echoed = samples[0].get("request_model")
    created = max((int(s[CREATED]) for s in samples if s.get(CREATED) is not None), default=int(time.time()))
    body = {
        "id": _rid("chatcmpl-" if chat else "cmpl-"),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": echoed if isinstance(echoed, str) and echoed else model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": fingerprint,
    }
    if samples[0].get("prompt_logprobs") is not None and samples[0].get("echo") is None:
        body["prompt_logprobs"] = samples[0]["prompt_logprobs"]  # as vLLM adds them (first: null)
    return {"id": _rid("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": _rid("req_"), "body": body}, "error": None}


def _custom_id(row: Mapping[str, Any]) -> str:
    return str(row.get("custom_id") or row["id"])


def error_line(row: Mapping[str, Any]) -> dict[str, Any]:
    """A failed request: ``invalid_request`` when its line could not run as written (the
    message names the line and field), ``generation_failed`` when it failed while generating,
    ``batch_cancelled`` or ``batch_expired`` when the run ended before it ran (``NOT_RUN``)."""
    reason = str(row["reason"])
    code = "generation_failed" if reason.startswith(GENERATION_FAILED) else "invalid_request"
    ended = next((c for c in NOT_RUN if reason == not_run_reason(c)), None)
    if ended is not None:  # not run at all: the code says why, the message is the API's
        code, reason = ended, NOT_RUN[ended]
    return {"id": _rid("batch_req_"), "custom_id": row.get("custom_id") or row.get("id"), "response": None,
            "error": {"code": code, "message": f"{row['location']}: {reason}"}}


class OpenAIErrorWriter(WrittenIfAny):
    """The error file beside OpenAI output: one line per failed request (the first reason of a
    request whose list prompt failed in several elements). No errors, no file; with ``overwrite``
    an error file of an earlier run goes, as with the Parquet errors file."""

    _allow_gzip = True

    def __init__(self, path: str | os.PathLike[str], overwrite: bool = False) -> None:
        super().__init__(path, overwrite)
        self._lines: dict[Any, dict[str, Any]] = {}

    def write(self, rows: Iterable[InvalidRow | Mapping[str, Any]]) -> None:
        for r in rows:
            row = r.to_row() if isinstance(r, InvalidRow) else r
            key = row.get("request")  # the elements of one request: one line; else a line each
            self._lines.setdefault(("line", len(self._lines)) if key is None else key, error_line(row))

    def _empty(self) -> bool:
        return not self._lines

    def _finish(self) -> None:
        text = "".join(dumps(x) + "\n" for x in self._lines.values())
        self._file.write(text.encode("utf-8"))  # type: ignore[union-attr]
