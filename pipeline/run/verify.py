"""`--verify K`: batchgen's exactness promise as a number on any engine. While a served run runs,
`Sample` keeps K of its greedy jobs' requests and the server's token ids (a bottom-K sample by a
hash of the job's input position: the same jobs whatever order they finish in). After the run,
batchgen's own engine runs those requests in this process; the summary reports how many agree
token for token, and where each other one first differs.

A conversation is verified turn by turn: batchgen's engine runs the whole conversation from its
first request, and it agrees when every turn does; one that differs is reported at its first
differing turn (whose prompt, the turns before it being equal, is the same on both engines).
"""
from __future__ import annotations

import hashlib
import heapq
from typing import Any, Sequence

from batchgen.pipeline.engine.types import Completion, Request
from batchgen.pipeline.text.expand import order_of


class Sample:
    """The K greedy single-sample generating requests with the smallest hashes of their job's
    input position, each with the server's token ids."""

    def __init__(self, k: int) -> None:
        self.k = k
        # (-hash, order, request, each turn's ids): a max-heap
        self._heap: list[tuple[int, int, Request, list[list[int]]]] = []

    @staticmethod
    def eligible(request: Request) -> bool:
        p = request.params
        return p.greedy and p.n == 1 and p.max_new_tokens > 0 and not isinstance(request.key, tuple)

    def offer(self, request: Request, completion: Completion) -> None:
        if not self.k or not self.eligible(request) or completion.error:
            return
        order = order_of(request.key)
        h = int.from_bytes(hashlib.blake2b(str(order).encode(), digest_size=8).digest(), "big")
        item = (-h, order, request, turn_ids(completion))
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, item)
        elif -h > self._heap[0][0]:
            heapq.heapreplace(self._heap, item)

    def items(self) -> list[tuple[int, Request, list[list[int]]]]:
        return sorted((order, r, ids) for _, order, r, ids in self._heap)


def verify(sample: Sample, options, eos_token_ids, stop, adapters: Sequence[Any] = ()) -> dict[str, Any]:
    """Run the sampled requests on batchgen's own engine; agreement with the server's token ids.
    `adapters`: the run's LoRA adapters (`Adapters.infos`, a request's `adapter` index i + 1 is
    infos[i]): a sampled job runs with the adapter it ran with on the server."""
    from batchgen.pipeline.model.hf import as_forward
    from batchgen.pipeline.model.load import load_model
    from batchgen.pipeline.run.executors import LocalExecutor

    items = sample.items()
    if not items:
        return {"jobs": 0, "agree": 0, "differ": []}
    model = as_forward(load_model(options.model, options.device, options.dtype, options.trust_remote_code)[0])
    if adapters:
        model.set_adapters(list(adapters))
    executor = LocalExecutor(model, "", eos_token_ids, options)
    ours = {c.key: turn_ids(c) for c in executor.run({}, [r for _, r, _ in items], stop.requested)}
    differ = []
    for order, request, theirs in items:
        mine_turns = ours.get(request.key)
        if mine_turns is None:  # stopped by a signal before it ran
            continue
        turns = max(len(mine_turns), len(theirs))  # (equal, unless one engine's conversation failed early)
        turn = next((t for t in range(turns) if _at(mine_turns, t) != _at(theirs, t)), None)
        if turn is not None:
            mine, their = _at(mine_turns, turn) or [], _at(theirs, turn) or []
            first = next((i for i, (a, b) in enumerate(zip(mine, their)) if a != b), min(len(mine), len(their)))
            entry = {"input_position": order, "first_difference": first, "tokens": [len(mine), len(their)]}
            if request.next_turn is not None:
                entry["turn"] = turn + 1
            differ.append(entry)
    checked = sum(1 for _, r, _ in items if r.key in ours)
    return {"jobs": checked, "agree": checked - len(differ), "differ": differ}


def turn_ids(completion: Completion) -> list[list[int]]:
    """A sample's generated ids per turn (one turn unless it is a conversation's)."""
    return [list(t.token_ids) for t in completion.turns or [completion]]


def _at(turns: list[list[int]], t: int) -> list[int] | None:
    return turns[t] if t < len(turns) else None
