"""What the engine needs of a loaded model: one packed forward over a step's flat tokens.

Two model codes implement it: batchgen's own decoder (`batchgen.pipeline.model.decoder.Decoder`) and
transformers' model code behind `batchgen.pipeline.model.hf.HFModel`. The engine sees only this protocol,
so it never asks which model code it has; `batchgen.pipeline.model.hf.as_forward` is where a transformers
model a caller passes in (the tests, the Python API's `batchgen.Engine(model, tokenizer)`) becomes one.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from batchgen.pipeline.errors import BatchgenError
from batchgen.pipeline.model.adapter_files import AdapterInfo
from batchgen.pipeline.model.kv import LayerShape
from batchgen.pipeline.model.step import Step


class EngineError(BatchgenError):
    """The model cannot run on this engine; the message says why."""


class Forward(Protocol):
    device: torch.device
    dtype: torch.dtype
    config: Any  # what the checks before a run read: `DecoderConfig`, or transformers' config
    model_code: str  # whose model code runs the forward: "batchgen" or "transformers" (the summary's `model_code`)
    # the end-of-sequence ids of the model's generation config; None where it states none (the
    # tokenizer's then apply)
    eos_token_ids: list[int] | None
    decoder_declined: str | None  # why batchgen's own decoder does not run it (the summary's `decoder_declined`)
    # where batchgen's GEMM got its packed float32 layers: "cache" (`batchgen.pipeline.model.prepack`'s file),
    # "ahead" (packed under torch's import), "load" (packed loading the model); None: not that GEMM
    # (the summary's `packed_weights`)
    packed_weights: str | None

    def layer_shapes(self) -> list[LayerShape]:
        """Per layer, the key/value heads and sizes the engine's KV buffers are made for."""
        ...

    def forward(self, step: Step, keep: list[int] | torch.Tensor) -> torch.Tensor:
        """The step's flat tokens through the model: float32 logits (len(keep), V) at the token indices `keep`."""
        ...

    def set_adapters(self, infos: list[AdapterInfo]) -> None:
        """Load these LoRA adapters (`batchgen.pipeline.model.adapter_files.inspect_adapter`) as indices
        1..len(infos), which a step's `Decode.adapter` / `Segment.adapter` name; 0 is the base
        model. Raises `AdapterError` for an adapter this model cannot apply."""
        ...


def eos_list(eos: int | list[int] | tuple[int, ...] | None) -> list[int] | None:
    """A generation config's `eos_token_id` (an id, a list, or None) as a list, or None."""
    if eos is None:
        return None
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]
