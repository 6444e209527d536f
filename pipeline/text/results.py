"""A finished job's result rows, or its one error row: the dicts at the output's edge, from the
engine's completions. One row per sample of a generating job (with its `logprobs` and
`prompt_logprobs` when asked); one row for a job that generates nothing (a scoring job's `scores`
and `best_continuation`, or a prompt scored alone). Used by the streaming runner, the Python API
and the Ray workers alike.
"""
from __future__ import annotations

import time
from typing import Any

from batchgen.jobs import InvalidRow, Job
from batchgen.jobs.openai_batch import GENERATION_FAILED, openai_fields, request_key
from batchgen.jobs.schema import CHAT_ENDPOINT
from batchgen.jobs.columns import CREATED, ORDER
from batchgen.pipeline.text.scoring import continuation_scores, prompt_scores
from batchgen.pipeline.text.tokenize import Tokenizer
from batchgen.pipeline.engine.types import Completion, TokenLogprob


def result_rows(job: Job, completions: list[Completion], tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """A finished job's rows: one per sample; one for a job that generates nothing (a scoring job,
    a prompt scored alone), whose token counts sum over its requests (continuations, windows)."""
    if job.is_scoring or job.max_new_tokens == 0:
        return [{**job.extra, "id": job.id, "prompt_index": job.prompt_index, "adapter": job.adapter,
                 "sample_index": 0, "completion": "",
                 "finish_reason": completions[0].finish_reason,
                 "prompt_tokens": sum(c.prompt_tokens for c in completions),
                 "cached_tokens": sum(c.cached_tokens for c in completions), "completion_tokens": 0,
                 **(score_columns(job, completions) if job.is_scoring else
                    {"prompt_logprobs": [None, *prompt_scores(completions)[0]]})}]
    rows = []
    for c in sorted(completions, key=lambda c: c.sample_index):
        text, stopped = tokenizer.completion_text(c.token_ids, job.stop)
        rows.append({
            **job.extra,
            "id": job.id,
            "prompt_index": job.prompt_index,
            "adapter": job.adapter,
            "sample_index": c.sample_index,
            "completion": text,
            "finish_reason": "stop" if stopped else c.finish_reason,
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "completion_tokens": len(c.token_ids),
            # the first prompt token has no logprob (nothing comes before it): null, so that
            # entry i is prompt token i's
            "prompt_logprobs": [None, *c.prompt_logprobs] if job.prompt_logprobs else None,
            "logprobs": token_logprobs(c.logprobs, tokenizer) if job.logprobs else None,
        })
        if job.then is not None:
            rows[-1].update(turn_columns(job, c, tokenizer))
    return rows


def turn_columns(job: Job, completion: Completion, tokenizer: Tokenizer) -> dict[str, Any]:
    """A conversation's sample: each turn's text as written (as the next turn read it), why it
    ended, and its tokens; the row's `completion` is the last turn's."""
    texts = [tokenizer.completion_text(t.token_ids, job.stop) for t in completion.turns]
    return {"turns": [text for text, _ in texts],
            "turn_finish_reasons": ["stop" if stopped else t.finish_reason for (_, stopped), t in zip(texts, completion.turns)],
            "turn_completion_tokens": [len(t.token_ids) for t in completion.turns]}


def token_logprobs(logprobs: list[TokenLogprob], tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """The logprobs column of a sample: each generated token, its logprob and its alternatives."""
    texts = iter(tokenizer.token_texts([t for lp in logprobs for t in [lp.token_id, *(i for i, _ in lp.top)]]))
    return [{"token": next(texts), "id": lp.token_id, "logprob": lp.logprob,
             "top": [{"token": next(texts), "id": i, "logprob": v} for i, v in lp.top]} for lp in logprobs]


def score_columns(job: Job, completions: list[Completion]) -> dict[str, Any]:
    """A scoring job's scores, and its best continuation: the highest summed logprob, the first
    of equal ones (lm-eval's argmax)."""
    scores = continuation_scores(completions)
    best = max(range(len(scores)), key=lambda i: (scores[i].logprob, -i))
    return {"scores": [{"continuation": text, "logprob": s.logprob, "tokens": s.tokens, "is_greedy": s.is_greedy}
                       for text, s in zip(job.continuations, scores)],
            "best_continuation": job.continuations[best]}


def job_rows(order: int, job: Job, completions: list[Completion],
             tokenizer: Tokenizer) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A finished job's result rows, or its one error row: a job fails alone and whole, never
    with partial samples in the output. Rows carry the job's input position."""
    failed = next((c for c in completions if c.error), None)
    if failed is not None or not completions:
        reason = f"{GENERATION_FAILED}{failed.error if failed else 'no output'}"
        return [], [{**InvalidRow(job.location, job.id, reason).to_row(), ORDER: order}]
    created = int(time.time())  # the job's completion time (OpenAI output reports it)
    return [{**r, ORDER: order, CREATED: created} for r in result_rows(job, completions, tokenizer)], []


def add_openai_fields(row: dict[str, Any], order: int, job: Job | None, tokenizer: Tokenizer) -> None:
    """What only the OpenAI writers read, added to a result or error row at input position
    `order`: `openai_fields` of its job (with its prompt's token texts where echo lists their
    logprobs), the request it belongs to (`request_key`), and a chat sample's logprobs as the
    message's tokens (`content_logprobs`). A row without a job (a line that made none) is its
    own request."""
    if job is None:
        row["request"] = order
        return
    echoed = job.prompt_logprobs and job.logprobs and job.prompt is not None
    row.update(openai_fields(job, tokenizer.token_texts(tokenizer.encode_prompt(job.prompt)) if echoed else None),
               request=request_key(order, job.prompt_index))
    if row["endpoint"] == CHAT_ENDPOINT and row.get("logprobs") is not None:
        row["logprobs"] = content_logprobs(row["logprobs"], row["completion"], tokenizer)


def content_logprobs(logprobs: list[dict[str, Any]], completion: str, tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """A chat sample's logprobs as the chat API lists them: the tokens of the message's content
    only (not the special token that ended it, such as EOS; not the tokens past a stop string,
    which the content is cut before: a token that the cut splits stays), each with its own bytes
    (joined, the content's bytes) and its alternatives with theirs."""
    ids = [t["id"] for t in logprobs]
    pieces = tokenizer.text_bytes(ids)
    cut = None if tokenizer.decode(ids) == completion else len(completion.encode())
    alternatives = iter(tokenizer.token_bytes([a["id"] for t in logprobs for a in t["top"]]))
    out, at = [], 0
    for t, piece in zip(logprobs, pieces):
        top = [{**a, "bytes": next(alternatives)} for a in t["top"]]
        if piece is None or (cut is not None and at >= cut):
            continue
        out.append({**t, "bytes": piece, "top": top})
        at += len(piece)
    return out
