"""The seam between the runner and what computes: an executor takes a window of prefix-sorted
requests (with their jobs) and yields each sample's `Completion` as it finishes.

- `LocalExecutor`: batchgen's own engine in this process (an `Engine` per window, as always);
- `ServedExecutor`: OpenAI-compatible completions servers (`--server URL`, or the vLLM that
  `--engine vllm` starts: pipeline/run/served.py), the requests sent as token ids in the window's
  order (pipeline/serve/).

The runner sees only this interface: the work counters of the window in flight (`stats`), whether
a completion's cached tokens are the server's own count or must come from batchgen's plan
(`reports_cached`), what the summary says of the engine (`about`) and the output's fingerprint.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from batchgen.jobs import Job
from batchgen.pipeline.engine.turns import Conversations, Turn
from batchgen.pipeline.engine.types import Completion, Request, RunStats, TurnError
from batchgen.pipeline.text.expand import order_of

if TYPE_CHECKING:
    from batchgen.pipeline.model.forward import Forward
    from batchgen.pipeline.run.options import RunOptions
    from batchgen.pipeline.serve.client import Servers

ShouldStop = Callable[[], bool]


class Executor(Protocol):
    name: str  # the summary's `engine`: local, vllm, server
    model_name: str
    reports_cached: bool  # a completion's cached_tokens are its own (a server's count), not the plan's
    stats: RunStats  # the work of the window in flight (or the last one)

    def run(self, jobs: Mapping[int, Job], requests: Sequence[Request], should_stop: ShouldStop
            ) -> Iterator[Completion]:
        """Every sample of the window's `requests` (prefix-sorted; `jobs` by input position) as it
        finishes; returns early once `should_stop()`, everything yielded complete."""

    def about(self, stats: RunStats) -> dict[str, Any]:
        """What the summary reports of the engine, given the work of the run's finished windows."""

    def fingerprint(self) -> str:
        """OpenAI's system_fingerprint of the output."""


class LocalExecutor:
    """batchgen's own engine: exact (greedy output equals `model.generate`)."""

    name = "local"
    reports_cached = False  # the engine's cached tokens are the window's tree's: the plan's count is the job's

    def __init__(self, model: Forward, model_name: str, eos_token_ids, options: RunOptions) -> None:
        self.model, self.model_name, self.eos, self.options = model, model_name, list(eos_token_ids), options
        self.stats = RunStats()
        self._engine = None

    def new_engine(self):
        from batchgen.pipeline.engine.engine import Engine

        return Engine.for_model(self.model, self.eos, min_shared_tokens=self.options.min_shared_tokens,
                                max_batch_tokens=self.options.max_batch_tokens)

    def run(self, jobs: Mapping[int, Job], requests: Sequence[Request], should_stop: ShouldStop
            ) -> Iterator[Completion]:
        # an engine per window: nothing of the last window stays referenced while this one is built
        self._engine = self.new_engine()
        self.stats = self._engine.stats
        yield from self._engine.run(requests, should_stop=should_stop)

    def about(self, stats: RunStats) -> dict[str, Any]:
        from batchgen.pipeline.model.native_build import build_error  # torch-free; loaded already by the prepack
        from batchgen.pipeline.run.summary import used

        return {"engine": self.name,
                "attention_path": (self._engine or self.new_engine()).attention_path,
                "attention_kernels": used(compiled=stats.compiled_attention_layers,
                                          pytorch=stats.pytorch_attention_layers),
                "model_code": used(batchgen=stats.own_decoder_forwards, transformers=stats.transformers_forwards),
                "decoder_declined": self.model.decoder_declined,
                "kernels_build_error": build_error(),
                "packed_weights": self.model.packed_weights}

    def fingerprint(self) -> str:
        return fingerprint(self.model, self.model_name)


class ServedExecutor:
    """Completions servers: each request one POST of its token ids; the server's cached-token
    count is each job's. With several servers, each job goes to the server of its whole prefix
    group (`server_of`, as `--shard` assigns groups), so a prefix is prefilled on one server."""

    reports_cached = True

    def __init__(self, name: str, servers: Servers, model_names: Sequence[str], server_of: Callable[[int], int],
                 about: dict[str, Any], model_name: str, adapter_names: Sequence[str | None] = (),
                 sample: Any = None) -> None:
        self.name, self.servers, self.model_names, self.server_of = name, servers, list(model_names), server_of
        self.sample = sample  # --verify: greedy jobs kept with the server's token ids (verify.Sample)
        self._about, self.model_name = about, model_name
        self.adapter_names = list(adapter_names)  # served name of adapter index i + 1 (`Request.adapter`)
        self.stats = RunStats()

    def _served_model(self, request: Request, server: int) -> str:
        return self.adapter_names[request.adapter - 1] if request.adapter else self.model_names[server]

    def run(self, jobs: Mapping[int, Job], requests: Sequence[Request], should_stop: ShouldStop
            ) -> Iterator[Completion]:
        from batchgen.pipeline.serve.client import Failed, ServerAnswerError
        from batchgen.pipeline.serve.mapping import AnswerError, completions, request_body

        self.stats = stats = RunStats()
        talks = ServedConversations()
        urgent: deque = deque()  # conversations' next turns: sent before the window's requests not yet sent

        def item(r: Request) -> tuple[int, Request, dict[str, Any]]:
            order = order_of(r.key)
            server = self.server_of(order)
            return server, r, request_body(r, jobs[order], self._served_model(r, server))

        sent = (item(r) for request in requests for r in talks.split(request))
        for request, answer in self.servers.run(sent, should_stop, urgent):
            later = isinstance(request.key, Turn) and request.key.turn > 0
            if isinstance(answer, Failed):
                turn = f"turn {request.key.turn + 1}: " if later else ""
                out = _failed(request, f"{turn}the server answered {answer.status}: {answer.message}")
            else:
                try:
                    out = completions(request, answer)
                except (AnswerError, KeyError, TypeError, ValueError) as e:
                    raise ServerAnswerError(f"{self.servers.urls[self.server_of(order_of(request.key))]} answered "
                                            f"in a shape batchgen cannot use: {e}") from None
            first = out[0]
            if first.error is None:  # a refused request computed nothing
                stats.prefill_tokens += first.prompt_tokens - first.cached_tokens
                if later:  # a conversation's later turn: what the server kept of it is its history, carried
                    stats.turns += 1
                    stats.prompt_tokens += first.prompt_tokens
                    stats.carried_tokens += first.cached_tokens
                else:  # a job's first request (a conversation's of n samples: one per sample, counted once)
                    once = not isinstance(request.key, Turn) or request.key.sample == 0
                    stats.jobs += once
                    stats.rows += len(out)
                    stats.prompt_tokens += first.prompt_tokens if once else 0
                    stats.cached_tokens += first.cached_tokens if once else 0
            for c in out:
                stats.completion_tokens += len(c.token_ids)
                done = talks.ended(request, c)
                if done is None:
                    urgent.append(item(talks.next))
                    continue
                if self.sample is not None:
                    self.sample.offer(talks.first(request), done)
                yield done

    def about(self, stats: RunStats) -> dict[str, Any]:
        return {"engine": self.name, **self._about}

    def fingerprint(self) -> str:
        from batchgen.pipeline import __version__

        return f"batchgen-{__version__}:{self.model_name}:{self.name}"


class ServedConversations:
    """Conversations on a server, each turn one request: as a sample's turn is answered, the
    request's `next_turn` (pipeline/text/turns.py, the rendering batchgen's own engine uses) makes
    the next turn's whole prompt, which goes out as a request of its own; the server's prefix
    cache, not a slot, carries the history. Each sample is its own branch from turn 1 on: its
    turns are requests of one sample, keyed `Turn` as on the own engine (`split`), and its turns
    wait here (`Conversations`) until its last, which is yielded once with all of them."""

    def __init__(self) -> None:
        self.turns = Conversations()
        self.roots: dict[Hashable, Request] = {}  # a conversation's first request, by its key
        self.next: Request | None = None  # the turn `ended` made last

    def split(self, request: Request) -> list[Request]:
        """A request as sent: a conversation's first turn of n > 1 samples as one request per
        sample (keyed `Turn`, turn 0), seeded as vLLM seeds each sample of one n-sample request
        (mapping.sample_seed), so the draws are the same; vLLM refuses n > 1 when greedy."""
        if request.next_turn is None or request.params.n == 1:
            return [request]
        self.roots[request.key] = request
        one = replace(request.params, n=1)
        return [replace(request, key=Turn(request.key, i, 0), params=one) for i in range(request.params.n)]

    def first(self, request: Request) -> Request:
        """The first request of the conversation `request` is a turn of (or `request` itself)."""
        return self.roots[request.key.root] if isinstance(request.key, Turn) else request

    def ended(self, request: Request, turn: Completion) -> Completion | None:
        """A sample's turn answered: None when its conversation goes on (its next turn is
        `self.next`), else the completion to yield, with all its turns when it is a conversation's
        (under its first request's key and sample index, as the own engine yields it)."""
        root = (request.key.root, request.key.sample) if isinstance(request.key, Turn) else \
            (request.key, turn.sample_index)
        done = replace(turn, key=root[0], sample_index=root[1])
        if request.next_turn is not None and done.error is None:
            try:
                nxt = request.next_turn(root[1], list(done.token_ids), done.finish_reason)
            except TurnError as e:  # the sample fails, with its turns so far, as on the own engine
                nxt, done.finish_reason, done.error = None, "error", str(e)
            if nxt is not None:
                if not isinstance(request.key, Turn):
                    self.roots[request.key] = request
                self.turns.record(root, done)
                self.next = self.turns.keyed(root, nxt)
                return None
        return self.turns.last(request, done)


def fingerprint(model: Forward, model_name: str) -> str:
    """OpenAI's system_fingerprint: what produced the output (engine version, model, precision)."""
    from batchgen.pipeline import __version__

    dtype = str(model.dtype).replace("torch.", "")
    return f"batchgen-{__version__}:{model_name}:{dtype}"


def _failed(request: Request, reason: str) -> list[Completion]:
    """Each sample a request would have had, failed: its job becomes one located error row."""
    samples = request.params.n if request.params.max_new_tokens else 1
    return [Completion(request.key, i, [], "error", len(request.prompt_ids), 0, error=reason) for i in range(samples)]


def groups_to_servers(index, orders: np.ndarray, servers: int, min_shared: int) -> Callable[[int], int]:
    """Each job's server (by its input position): whole prefix groups, balanced by prefill work,
    the way `--shard` assigns them (windows.assign_shards)."""
    if servers == 1:
        return lambda order: 0
    from batchgen.pipeline.run.windows import assign_shards

    of_number = assign_shards(index, servers, min_shared)

    def server_of(order: int) -> int:
        return int(of_number[int(np.searchsorted(orders, order))])

    return server_of
