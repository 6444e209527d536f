"""Random PEFT LoRA adapters for the tiny models (tests/helpers/tiny_models.py), made and saved by
peft itself, and peft's merged model for one: the reference the segmented path is checked against.

peft initialises lora_B to zeros (an adapter that changes nothing); here every LoRA matrix is drawn
at random (scaled by its fan-in, so an update is a fraction of the layer's output at any rank)
so that every adapter changes the logits far beyond float rounding.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model: torch.nn.Module, directory: str | Path, rank: int = 8, targets=ALL, alpha: float | None = None,
                 rslora: bool = False, seed: int = 0, size: float = 0.5, **config) -> Path:
    """A LoRA adapter of `rank` on `targets` of (a copy of) `model`, saved by peft to `directory`."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets),
        use_rslora=rslora, lora_dropout=0.0, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name and p.dim() == 2:  # not a DoRA magnitude
                p.copy_(torch.randn(p.shape, generator=g) * (size / p.shape[1] ** 0.5))  # (out, in)
    peft_model.save_pretrained(directory)
    return Path(directory)


def merged(model: torch.nn.Module, directory: str | Path) -> torch.nn.Module:
    """peft's merged model for the adapter at `directory` on (a copy of) `model`: its weights
    W + scaling B A, loaded back from the adapter's files."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(model), str(directory)).merge_and_unload().eval()
