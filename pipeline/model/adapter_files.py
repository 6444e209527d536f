"""PEFT LoRA adapters read from their files: what an adapter is and whether batchgen applies it.

Torch-free (validate and plan check adapters without importing torch), and free of peft's config
classes, which import torch: `adapter_config.json` is parsed here with peft's field names, and of
`adapter_model.safetensors` only the header is read (names, dtypes, shapes, byte offsets).

`inspect_adapter(path, base)` returns an `AdapterInfo` or raises `AdapterError`, whose one-line
message names the adapter's path and what is refused. `base` is the base model's config as the
model layer has it without torch: the parsed `config.json` dict, a `DecoderConfig`, or a
transformers config (what `batchgen.pipeline.model.load.load_config` returns, or a `Forward`'s `config`);
its `hidden_size`, `num_attention_heads`, `num_key_value_heads`, `head_dim`, `intermediate_size`
and `num_hidden_layers` give each projection's shape (missing key/value heads and head size
default as transformers' Llama-family configs default them).

Acceptance is an allow-list, as for the decoder's models (`decoder_config`): a plain LoRA (no
DoRA, no bias, no `modules_to_save`, no per-module rank or alpha patterns, no variant configs)
on any subset of the Llama-family projections `TARGETS`, with each tensor's shape the base model's
and the config's rank. The tensors decide which layers and modules an adapter updates
(`layers_to_transform` and regex target lists only choose which tensors were written).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.pipeline.errors import BatchgenError
from batchgen.pipeline.model.decoder_config import FLOAT_DTYPES

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PART = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# peft's key for a LoRA matrix of a decoder layer's projection, as `save_pretrained` writes it
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# config keys that change nothing in an inference forward whatever their value (metadata, training
# settings, which modules were chosen: the tensors say that; fan_in_fan_out, which peft turns off
# for nn.Linear), or that are checked one by one below; any other key set is refused
_READ = frozenset({"peft_type", "peft_version", "auto_mapping", "base_model_name_or_path", "revision", "task_type",
                   "inference_mode", "lora_dropout", "fan_in_fan_out", "target_modules", "exclude_modules",
                   "layers_to_transform", "layers_pattern", "r", "lora_alpha", "use_rslora", "init_lora_weights",
                   "bias", "lora_bias", "use_dora", "modules_to_save", "rank_pattern", "alpha_pattern",
                   "megatron_core", "qalora_group_size", "loftq_config", "eva_config", "corda_config",
                   "lora_ga_config"})
# initialisations that leave the base weights as they are (pissa, olora, corda, loftq and lora_ga
# rewrite them, so their adapters need a residual base model; mica is a variant with its own forward)
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
_ITEMSIZE = dict(zip(FLOAT_DTYPES, (4, 2, 2, 8)))


class AdapterError(BatchgenError):
    """An adapter batchgen cannot apply to this base model; the message names its path and why."""


@dataclass(frozen=True)
class AdapterInfo:
    path: str  # the adapter directory, absolute
    digest: str  # sha256 over adapter_config.json and adapter_model.safetensors (the resume fingerprint)
    rank: int
    alpha: float
    scaling: float  # alpha / rank, or alpha / sqrt(rank) with use_rslora (peft's `scaling`)
    targets: tuple[str, ...]  # the projections it updates (in some layer), a sorted subset of TARGETS


@dataclass(frozen=True)
class BaseShape:
    """Per projection of the base model (in features, out features), and its layer count."""

    shapes: dict[str, tuple[int, int]]
    layers: int


def base_shape(base: Any, where: str = "an adapter") -> BaseShape:
    """The base model's projection shapes, from a config dict or a config object (module docstring)."""
    def get(name: str) -> Any:
        return base.get(name) if isinstance(base, dict) else getattr(base, name, None)

    need = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    missing = [n for n in need if not (isinstance(get(n), int) and get(n) > 0)]
    if missing:
        raise AdapterError(f"{where}: the base model's config does not state {missing[0]}: batchgen applies "
                           f"LoRA adapters to Llama-family models only")
    h, heads, i = get("hidden_size"), get("num_attention_heads"), get("intermediate_size")
    kv_heads, d = get("num_key_value_heads") or heads, get("head_dim") or h // heads
    q, kv = heads * d, kv_heads * d
    return BaseShape({"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                      "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}, get("num_hidden_layers"))


def inspect_adapter(path: str | os.PathLike, base: Any) -> AdapterInfo:
    """The adapter at `path` (a directory saved by peft's `save_pretrained`), checked against the
    base model's config `base`; raises `AdapterError` for anything batchgen would not apply as peft does."""
    d = Path(path).expanduser().absolute()
    where = f"adapter {d}"
    if not d.exists():
        raise AdapterError(f"{where}: no such directory")
    if not d.is_dir():
        raise AdapterError(f"{where}: not a directory (an adapter is a directory holding {CONFIG} and {WEIGHTS})")
    try:
        config_bytes = (d / CONFIG).read_bytes()
    except OSError as e:
        raise AdapterError(f"{where}: cannot read {CONFIG} ({e.strerror or e})") from e
    try:
        config = json.loads(config_bytes)
    except ValueError as e:
        raise AdapterError(f"{where}: {CONFIG} is not JSON ({e})") from e
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: {CONFIG} is not a JSON object")
    rank, alpha, scaling = _check_config(config, where)
    weights = d / WEIGHTS
    if not weights.is_file():
        old = " (adapter_model.bin is not read: save it with safe_serialization=True)" \
            if (d / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{where}: no {WEIGHTS}{old}")
    tensors = _header(weights, where)
    targets = _check_tensors(tensors, rank, base_shape(base, where), where)
    digest = hashlib.sha256()
    for part in (config_bytes, weights.read_bytes()):
        digest.update(len(part).to_bytes(8, "little"))  # lengths first: no two file pairs hash alike
        digest.update(part)
    return AdapterInfo(str(d), digest.hexdigest(), rank, alpha, scaling, targets)


def _check_config(config: dict, where: str) -> tuple[int, float, float]:
    """Rank, alpha and scaling of a plain LoRA config, or AdapterError naming what is not one."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise AdapterError(f"{where}: peft_type {kind!r} is not a LoRA adapter (batchgen applies peft_type LORA)")
    if config.get("use_dora"):
        raise AdapterError(f"{where}: a DoRA adapter (use_dora), which batchgen does not apply")
    if config.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save {config['modules_to_save']} (fully trained modules), "
                           f"which batchgen does not apply")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for name in targets:
            if name in ("embed_tokens", "lm_head"):
                what = "an embedding" if name == "embed_tokens" else "an lm_head"
                raise AdapterError(f"{where}: {what} adapter (target module {name}), which batchgen does not apply")
            if name not in TARGETS:
                raise AdapterError(f"{where}: target module {name!r}, which batchgen does not apply "
                                   f"(it applies {', '.join(TARGETS)})")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        which = "lora_bias" if config.get("lora_bias") else f"bias {config.get('bias')!r}"
        raise AdapterError(f"{where}: trained biases ({which}), which batchgen does not apply")
    for name in ("rank_pattern", "alpha_pattern"):
        if config.get(name):
            raise AdapterError(f"{where}: {name} (a rank or alpha per module), which batchgen does not apply")
    init = config.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise AdapterError(f"{where}: init_lora_weights {init!r} (it changes the base model's weights "
                           f"or its forward), which batchgen does not apply")
    other = sorted(k for k, v in config.items() if k not in _READ and v not in (None, False, {}, [], ""))
    if other:
        raise AdapterError(f"{where}: {CONFIG} sets {other[0]}, which batchgen does not apply")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0):
        raise AdapterError(f"{where}: r {rank!r} is not a positive integer")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha)):
        raise AdapterError(f"{where}: lora_alpha {alpha!r} is not a number")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(alpha), scaling


def _header(path: Path, where: str) -> dict[str, dict]:
    """The safetensors header's tensors, each one's bytes checked to lie inside the file."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if 8 + n > size:
                raise ValueError(f"its header claims {n} bytes")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (OSError, ValueError, struct.error) as e:
        raise AdapterError(f"{where}: {WEIGHTS} is truncated or not a safetensors file ({e})") from e
    data = size - 8 - n
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, meta in tensors.items():
        try:
            start, end = meta["data_offsets"]
            shape, kind = [int(x) for x in meta["shape"]], meta["dtype"]
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterError(f"{where}: {WEIGHTS}'s header is damaged at tensor {name}") from e
        if end > data:
            raise AdapterError(f"{where}: {WEIGHTS} is truncated: tensor {name} lies at bytes {start}-{end} of "
                               f"the data, past its end ({data} bytes): copy or save the adapter again")
        if kind not in FLOAT_DTYPES:
            raise AdapterError(f"{where}: tensor {name} is {kind}, not a floating-point type")
        if not 0 <= start <= end or end - start != math.prod(shape) * _ITEMSIZE[kind]:
            raise AdapterError(f"{where}: {WEIGHTS}'s header is damaged at tensor {name} (its bytes do not "
                               f"fit its shape {shape})")
    return tensors


def _check_tensors(tensors: dict[str, dict], rank: int, base: BaseShape, where: str) -> tuple[str, ...]:
    """Every tensor is a LoRA matrix of a projection of a layer the base model has, of its shape and
    the config's rank, in pairs (A and B); returns the projections updated."""
    seen: dict[tuple[int, str], set[str]] = {}
    for name, meta in sorted(tensors.items()):
        m = _KEY.fullmatch(name)
        if m is None:
            raise AdapterError(f"{where}: tensor {name}: {_unknown(name)}, which batchgen does not apply")
        layer, part, proj, ab = int(m[1]), m[2], m[3], m[4]
        if _PART.get(proj) != part:
            raise AdapterError(f"{where}: tensor {name}: LoRA on module {part}.{proj}, which batchgen does not "
                               f"apply (it applies {', '.join(TARGETS)})")
        if layer >= base.layers:
            raise AdapterError(f"{where}: tensor {name} is for layer {layer}, but the base model has "
                               f"{base.layers} layers: an adapter for another base model")
        shape, (fan_in, fan_out) = list(meta["shape"]), base.shapes[proj]
        if len(shape) != 2:
            raise AdapterError(f"{where}: tensor {name} has shape {shape}, not a matrix")
        if shape[0 if ab == "A" else 1] != rank:
            raise AdapterError(f"{where}: rank mismatch: tensor {name} has shape {shape}, but {CONFIG} "
                               f"states r {rank}")
        want = [rank, fan_in] if ab == "A" else [fan_out, rank]
        if shape != want:
            raise AdapterError(f"{where}: tensor {name} has shape {shape}, but the base model's {proj} makes "
                               f"it {want}: an adapter for another base model")
        seen.setdefault((layer, proj), set()).add(ab)
    if not seen:
        raise AdapterError(f"{where}: {WEIGHTS} holds no LoRA weights")
    for (layer, proj), parts in sorted(seen.items()):
        if parts != {"A", "B"}:
            lacks = "B" if "A" in parts else "A"
            raise AdapterError(f"{where}: {WEIGHTS} lacks base_model.model.model.layers.{layer}.{_PART[proj]}."
                               f"{proj}.lora_{lacks}.weight")
    return tuple(sorted({proj for _, proj in seen}, key=TARGETS.index))


def _unknown(name: str) -> str:
    """What a tensor that is not a projection's LoRA matrix is, in peft's words."""
    if "lora_magnitude_vector" in name:
        return "a DoRA magnitude"
    if "embed_tokens" in name or "lora_embedding" in name:
        return "an embedding adapter"
    if "lm_head" in name:
        return "an lm_head adapter"
    if name.endswith(".bias"):
        return "a trained bias"
    return "not a LoRA matrix of a decoder layer's projection"
