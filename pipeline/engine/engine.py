"""The engine: a model, the configuration it runs requests with, and the counters of its runs.

`run` plans the requests (schedule.py) and executes the plan as one `Pass` (loop.py), whose state
(the requests, the plan, its cached prefixes, its step size) lives for that run only.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

import torch

from batchgen.pipeline.engine.loop import Pass
from batchgen.pipeline.engine.turns import Conversations
from batchgen.pipeline.model.forward import EngineError, Forward  # noqa: F401  (EngineError: part of the engine's API)
from batchgen.pipeline.model.hf import as_forward
from batchgen.pipeline.model.kernels import warm_vector_math
from batchgen.pipeline.engine.schedule import MAX_BATCH_TOKENS, MIN_SHARED_TOKENS, Plan, plan, tree_of
from batchgen.pipeline.model.step import Step
from batchgen.pipeline.engine.types import Completion, Request, RunStats


class Engine:
    def __init__(
        self,
        model: Forward | torch.nn.Module,  # a transformers model runs behind `batchgen.pipeline.model.hf.HFModel`
        *,
        eos_token_ids: Iterable[int] = (),
        min_shared_tokens: int = MIN_SHARED_TOKENS,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        default_seed: int = 0,
        step_tokens: int = 2048,
        cascade: bool = True,
        join: bool = True,
        static_decode: bool | None = None,
    ) -> None:
        self.model = as_forward(model)
        self.device, self.dtype = self.model.device, self.model.dtype
        self.eos = frozenset(eos_token_ids)
        self.min_shared_tokens = min_shared_tokens
        self.max_batch_tokens = max_batch_tokens
        self.default_seed = default_seed
        self.step_tokens = step_tokens  # tokens per forward; a run halves its own copy on out-of-memory
        self.cascade = cascade  # rows read shared prefixes once per step; else each row copies its prefix
        self.join = join  # rows planned next take the slots of finished rows (continuous batching)
        # decode steps on static shapes (capturable as a CUDA graph); on a CPU the dynamic ones,
        # which read each run of slots only as far as its longest row, are faster
        self.static_decode = self.device.type == "cuda" if static_decode is None else static_decode
        self.attention_path = "cascade" if cascade else "copy"
        self.layers = self.model.layer_shapes()
        self.stats = RunStats()
        if self.device.type == "cpu":
            warm_vector_math()  # before any forward: see its docstring

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return list(self.run(requests))

    def plan(self, requests: Sequence[Request]) -> Plan:
        tree, shapes = tree_of((r.key, r.prompt_ids[: r.shared_len], r.fed_len, r.params.max_new_tokens,
                                r.params.n, r.adapter, r.reserve) for r in requests)
        return plan(tree, shapes, min_shared_tokens=self.min_shared_tokens, max_batch_tokens=self.max_batch_tokens,
                    cascade=self.cascade)

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], should_stop: Callable[[], bool] = lambda: False) -> Iterator[Completion]:
        """Yield every sample of every request as it finishes (prefix order, not input order).

        Returns early, between steps, once `should_stop()` is true (preemption): rows in flight are
        dropped, everything yielded so far is complete. The run's state is its own (`loop.Pass`).

        A conversation (`Request.next_turn`) is yielded once per sample, with all its turns; a turn
        that outgrew its row's slot reruns from its prompt in a later pass (`turns.py`)."""
        conversations = Conversations()
        pending, first = list(requests), True
        while pending:
            one = Pass(self, pending, self.plan(pending), conversations, first)
            yield from one.run(should_stop)
            if should_stop():
                return
            pending, first = one.later, False

    def forward(self, step: Step, keep: list[int]) -> torch.Tensor:
        """One forward over the step's flat tokens: the logits (N, V) at the token indices `keep`."""
        logits = self.model.forward(step, keep)
        self.stats.compiled_attention_layers += step.kernel_layers[0]
        self.stats.pytorch_attention_layers += step.kernel_layers[1]
        self.stats.own_decoder_forwards += self.model.model_code == "batchgen"
        self.stats.transformers_forwards += self.model.model_code == "transformers"
        return logits

    @classmethod
    def for_model(cls, model: Forward | torch.nn.Module, fallback_eos_ids: Iterable[int], *,
                  min_shared_tokens: int = MIN_SHARED_TOKENS, max_batch_tokens: int = MAX_BATCH_TOKENS) -> "Engine":
        """An engine for `model` whose samples end at the model's EOS ids (its generation config's,
        as `model.generate` reads them, else `fallback_eos_ids`, the tokenizer's): how the runner,
        the Ray workers, the Python API and the lm-eval backend all build theirs."""
        forward = as_forward(model)
        eos = list(fallback_eos_ids) if forward.eos_token_ids is None else list(forward.eos_token_ids)
        return cls(forward, eos_token_ids=eos, min_shared_tokens=min_shared_tokens, max_batch_tokens=max_batch_tokens)
