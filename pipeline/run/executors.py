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

from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from batchgen.jobs import Job
from batchgen.pipeline.engine.types import Completion, Request, RunStats
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

        def items():
            for r in requests:
                order = order_of(r.key)
                server = self.server_of(order)
                yield server, r, request_body(r, jobs[order], self._served_model(r, server))

        for request, answer in self.servers.run(items(), should_stop):
            if isinstance(answer, Failed):
                out = _failed(request, f"the server answered {answer.status}: {answer.message}")
            else:
                try:
                    out = completions(request, answer)
                except (AnswerError, KeyError, TypeError, ValueError) as e:
                    raise ServerAnswerError(f"{self.servers.urls[self.server_of(order_of(request.key))]} answered "
                                            f"in a shape batchgen cannot use: {e}") from None
            first = out[0]
            if first.error is None:  # a refused request computed nothing
                stats.jobs += 1
                stats.rows += len(out)
                stats.prompt_tokens += first.prompt_tokens
                stats.cached_tokens += first.cached_tokens
                stats.prefill_tokens += first.prompt_tokens - first.cached_tokens
            for c in out:
                stats.completion_tokens += len(c.token_ids)
                if self.sample is not None:
                    self.sample.offer(request, c)
                yield c

    def about(self, stats: RunStats) -> dict[str, Any]:
        return {"engine": self.name, **self._about}

    def fingerprint(self) -> str:
        from batchgen.pipeline import __version__

        return f"batchgen-{__version__}:{self.model_name}:{self.name}"


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
