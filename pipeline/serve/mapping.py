"""A request as a `/v1/completions` body, and the server's answer as the engine's completions.

The prompt goes as token ids, so the server computes exactly the prompt batchgen planned (chat
template, special tokens and all). Every sampling field is sent explicitly, even at its neutral
value: vLLM fills fields left out from the model's generation_config.json (`--generation-config
auto`), which batchgen's own engine never reads. The answer must carry the generated token ids
(vLLM's `return_token_ids`): batchgen detokenizes them itself, as for its own engine, so text,
stop-string cuts and logprob token texts are the same code on every engine. Logprob entries come
back keyed "token_id:N" (`return_tokens_as_token_ids`), never as texts that two tokens may share.

Each sample of a conversation is its own branch: its turns are requests of one sample (keyed
`Turn`: executors.ServedConversations), each seeded as that sample of an n-sample request would
be (`sample_seed`) from its turn's seed (pipeline/text/turns.py's `turn_seed`).

A scoring request (nothing generated, `Request.score_from`) asks for the prompt's logprobs
(vLLM's `prompt_logprobs`) and one generated token, which it drops: vLLM generates at least one.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any, Mapping

from batchgen.jobs import Job
from batchgen.jobs.errors import BatchgenError
from batchgen.pipeline.engine.turns import Turn
from batchgen.pipeline.engine.types import Completion, Request, TokenLogprob


class AnswerError(BatchgenError):
    """The server's answer lacks what batchgen needs (token ids, logprobs): a server that cannot
    serve batchgen at all, never a job's own fault."""


def request_body(request: Request, job: Job, model: str) -> dict[str, Any]:
    """The `/v1/completions` body of one request of `job` for the served model name `model`."""
    p = request.params
    scoring = p.max_new_tokens == 0
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_ids),
        "max_tokens": 1 if scoring else p.max_new_tokens,
        # greedy samples are one sample n times (vLLM refuses greedy n > 1): one is asked, `completions` repeats it
        "n": 1 if scoring or p.greedy else p.n,
        "temperature": 0.0 if scoring else p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,  # vLLM: -1 considers every token
        "min_p": 0.0,
        "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "min_tokens": 0 if scoring else p.min_tokens,
        "stop_token_ids": list(p.stop_token_ids),
        "stop": [] if scoring else list(job.stop),
        "logit_bias": {str(t): b for t, b in p.logit_bias},
        "ignore_eos": False,
        "skip_special_tokens": True,
        "echo": False,
        "stream": False,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if p.seed is not None and not p.greedy:
        body["seed"] = sample_seed(p.seed, request.key.sample) if isinstance(request.key, Turn) else p.seed
    if p.logprobs is not None and not scoring:
        body["logprobs"] = p.logprobs
    if request.score_from is not None:
        body["prompt_logprobs"] = 0  # the prompt token's own logprob and its rank (greedy when 1)
    if job.constraint is not None and not scoring:
        body["structured_outputs"] = structured_outputs(job.constraint.kind, job.constraint.spec)
    return body


def sample_seed(seed: int, sample: int) -> int:
    """The seed of one sample's request: vLLM seeds sample i of a request of n samples `seed + i`
    (its parallel sampling's children), so a conversation's later turn of sample i, a request of
    its own, draws as that sample of an n-sample request would (kept within vLLM's int64)."""
    return (seed + sample) & (2**63 - 1)


def structured_outputs(kind: str, spec: str) -> dict[str, Any]:
    """vLLM's structured outputs for a job's constraint (jobs/params.py's kinds)."""
    if kind == "json_schema":
        return {"json": json.loads(spec)}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "regex":
        return {"regex": spec}
    if kind == "choice":
        return {"choice": json.loads(spec)}
    raise ValueError(f"no structured output for a constraint of kind {kind!r}")


def completions(request: Request, answer: Mapping[str, Any]) -> list[Completion]:
    """Each sample of `request` from the server's answer, with the prompt tokens the server
    reports it served from its prefix cache (0 where it reports none)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        raise AnswerError("the answer has no choices")
    usage = answer.get("usage") or {}
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    prompt_len = len(request.prompt_ids)
    out = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        index = int(choice.get("index", 0))
        if request.params.max_new_tokens == 0:  # a scoring request: its prompt's logprobs only
            scores, greedy = _prompt_scores(request, choice)
            out.append(Completion(request.key, index, [], "scored", prompt_len, cached,
                                  prompt_logprobs=scores, prompt_greedy=greedy))
            continue
        ids = choice.get("token_ids")
        if not isinstance(ids, list):
            raise AnswerError("the answer carries no token ids (vLLM's `return_token_ids`); batchgen needs the "
                              "exact generated tokens")
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise AnswerError(f"finish_reason {reason!r}")
        scores = greedy = None
        if request.score_from is not None:
            scores, greedy = _prompt_scores(request, choice)
        logprobs = _token_logprobs(choice, ids, request.params.logprobs) if request.params.logprobs is not None \
            else None
        out.append(Completion(request.key, index, [int(t) for t in ids], reason, prompt_len, cached,
                              logprobs=logprobs, prompt_logprobs=scores, prompt_greedy=greedy))
    p = request.params
    if len(out) != (1 if p.max_new_tokens == 0 or p.greedy else p.n):
        raise AnswerError(f"{len(out)} choices for a request of n={p.n}")
    if p.greedy and p.max_new_tokens:  # greedy: every sample is the one decoded (request_body asked n = 1)
        out = [replace(out[0], sample_index=i, logprobs=list(out[0].logprobs) if out[0].logprobs else out[0].logprobs)
               for i in range(p.n)]
    return out


def _prompt_scores(request: Request, choice: Mapping[str, Any]) -> tuple[list[float], list[bool]]:
    """The logprob of each prompt token from `score_from` on, and whether it ranked first."""
    listed = choice.get("prompt_logprobs")
    ids = request.prompt_ids
    if not isinstance(listed, list) or len(listed) != len(ids):
        raise AnswerError("the answer carries no prompt logprobs for every prompt token")
    scores, greedy = [], []
    for i in range(request.score_from, len(ids)):
        entry = (listed[i] or {}).get(str(ids[i]))
        if entry is None:
            raise AnswerError(f"prompt token {i} has no logprob")
        scores.append(float(entry["logprob"]))
        greedy.append(int(entry.get("rank", 0)) == 1)
    return scores, greedy


def _token_logprobs(choice: Mapping[str, Any], ids: list[int], k: int) -> list[TokenLogprob]:
    """Each generated token's logprob and its k most likely alternatives, most likely first."""
    lp = choice.get("logprobs") or {}
    values, tops = lp.get("token_logprobs"), lp.get("top_logprobs")
    if not isinstance(values, list) or len(values) != len(ids):
        raise AnswerError("the answer carries no logprob for every generated token")
    out = []
    for i, token in enumerate(ids):
        top: list[tuple[int, float]] = []
        if k:
            listed = (tops[i] if isinstance(tops, list) and i < len(tops) else None) or {}
            ranked = sorted(((_token_id(t), float(v)) for t, v in listed.items()), key=lambda e: -e[1])
            top = ranked[:k]  # the sampled token comes along when it is not among them
        value = values[i]
        out.append(TokenLogprob(int(token), -math.inf if value is None else float(value), top))
    return out


def _token_id(text: str) -> int:
    if not text.startswith("token_id:"):
        raise AnswerError(f"logprob token {text!r} is not an id (vLLM's `return_tokens_as_token_ids`)")
    return int(text[len("token_id:"):])
