"""The engine: a model, the configuration it runs requests with, and the counters of its runs.

`run` plans the requests (schedule.py) and executes the plan as one `Pass` (loop.py), whose state
(the requests, the plan, its cached prefixes, its step size) lives for that run only.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

import torch

from pipeline.model import attention

from pipeline.model import kernels
from pipeline.model.attention import EngineError, layer_shapes  # noqa: F401  (EngineError: part of the engine's API)
from pipeline.model.decoder import Decoder
from pipeline.engine.loop import Pass
from pipeline.engine.schedule import Plan, plan, tree_of
from pipeline.model.step import Step
from pipeline.engine.types import Completion, Request, RunStats


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Iterable[int] = (),
        min_shared_tokens: int = 16,
        max_batch_tokens: int = 65536,
        default_seed: int = 0,
        step_tokens: int = 2048,
        cascade: bool = True,
        join: bool = True,
        static_decode: bool | None = None,
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
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
        self.own_decoder = isinstance(model, Decoder)  # batchgen's forward, else transformers' model code
        self.layers = model.layer_shapes() if self.own_decoder else layer_shapes(model)
        # float32 on CPU: oneDNN's GEMM, not MKL's (the decoder packs its own)
        self.linears = [] if self.own_decoder else kernels.fast_linears(model)
        if self.device.type == "cpu":
            kernels.keep_freed_memory()  # activations reuse memory instead of faulting in fresh pages
        self.stats = RunStats()

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return list(self.run(requests))

    def plan(self, requests: Sequence[Request]) -> Plan:
        tree, shapes = tree_of((r.key, r.prompt_ids[: r.shared_len], r.fed_len, r.params.max_new_tokens,
                                r.params.n) for r in requests)
        return plan(tree, shapes, min_shared_tokens=self.min_shared_tokens, max_batch_tokens=self.max_batch_tokens,
                    cascade=self.cascade)

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], should_stop: Callable[[], bool] = lambda: False) -> Iterator[Completion]:
        """Yield every sample of every request as it finishes (prefix order, not input order).

        Returns early, between steps, once `should_stop()` is true (preemption): rows in flight are
        dropped, everything yielded so far is complete. The run's state is its own (`loop.Pass`)."""
        yield from Pass(self, requests, self.plan(requests)).run(should_stop)

    def forward(self, step: Step, keep: list[int]) -> torch.Tensor:
        """One forward over the step's flat tokens: the logits (N, V) at the token indices `keep`."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        if self.own_decoder:
            logits = self.model.forward(step, index)
        else:
            with attention.selected(self.model), kernels.linears_on_onednn(self.linears):
                out = self.model(input_ids=step.input_ids, position_ids=step.positions, use_cache=False,
                                 logits_to_keep=index, **{attention.KWARG: step})
            logits = out.logits[0].float()
        self.stats.compiled_attention_layers += step.kernel_layers[0]
        self.stats.pytorch_attention_layers += step.kernel_layers[1]
        self.stats.own_decoder_forwards += self.own_decoder
        self.stats.transformers_forwards += not self.own_decoder
        return logits
