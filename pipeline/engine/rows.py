"""The rows in flight, as the engine's loop sees them: rows prefilling their suffix, samples
decoding in their slots, and which logits a step computes for whom."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.pipeline.engine.sampling import RowState
from batchgen.pipeline.engine.schedule import Row
from batchgen.pipeline.engine.types import Request, TokenLogprob


@dataclass
class Fill:
    """A row prefilling its suffix into its first slot; its other samples' slots wait for the fork.
    A row that scores its prompt collects the logprob of each scored token as its logits go by."""

    row: Row
    request: Request
    slots: list[int]
    fed: int = 0  # suffix tokens already fed
    scores: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)

    @property
    def suffix(self) -> list[int]:
        return self.request.prompt_ids[self.row.cached : self.request.fed_len]

    @property
    def generates(self) -> bool:
        return self.request.params.max_new_tokens > 0

    def scored(self, start: int, end: int) -> range:
        """Positions in [start, end) whose logits score the next prompt token."""
        first = self.request.score_from
        if first is None:
            return range(0)
        lo, hi = max(start, first - 1), min(end, len(self.request.prompt_ids) - 1)
        return range(lo, max(lo, hi))


def token_scores(logits: torch.Tensor, targets: list[int]) -> tuple[torch.Tensor, list[float], list[bool]]:
    """Each row's log-softmax, the logprob of its target token, and whether that was the argmax."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    index = torch.tensor(targets, device=logprobs.device, dtype=torch.long)
    chosen = logprobs.gather(1, index[:, None])[:, 0].tolist()
    return logprobs, chosen, (logprobs.argmax(dim=-1) == index).tolist()


@dataclass
class Wanted:
    """Which logits a step computes, in order: one per decoding row, one per fill it completes
    that goes on to generate (its last prompt token's), then one per scored prompt token."""

    decode: int = 0
    done: list[Fill] = field(default_factory=list)
    scored: list[tuple[Fill, int]] = field(default_factory=list)  # (fill, the token its logits score)
    keep: list[int] = field(default_factory=list)  # token indices, in that order

    @property
    def first(self) -> list[Fill]:
        return [f for f in self.done if f.generates]


@dataclass
class Live:
    """One sample decoding in its slot."""

    row: Row
    request: Request
    sample: int
    slot: int
    state: RowState  # how its tokens are chosen, and the tokens so far
    logprobs: list[TokenLogprob] | None = None  # when the request asks for them
    prompt: Fill | None = None  # its fill, when it scored its prompt too (echo)

    @property
    def tokens(self) -> list[int]:
        return self.state.tokens


def record_logprobs(logits: torch.Tensor, chosen: torch.Tensor, running: list[Live]) -> None:
    """For the rows that ask: the chosen token's logprob and the top alternatives, under the
    unprocessed distribution (the model's logits as they are)."""
    rows = [i for i, r in enumerate(running) if r.logprobs is not None]
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # (R, V)
    mine = logprobs.gather(1, chosen.index_select(0, index)[:, None])[:, 0].tolist()
    k = max(running[i].request.params.logprobs for i in rows)
    top_v, top_i = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    for j, i in enumerate(rows):
        r, n = running[i], running[i].request.params.logprobs
        top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
        r.logprobs.append(TokenLogprob(int(chosen[i]), mine[j], top))
