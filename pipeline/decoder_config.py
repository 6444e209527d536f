"""Which models batchgen's own decoder (`pipeline.decoder`) runs, read straight from the files of
a model directory: `config.json`, `generation_config.json` and the safetensors headers.

Torch-free, and free of transformers' config classes: on this machine importing a Llama config
class pulls in `torch.distributed.tensor`, sympy and `torch._dynamo` (about 1 s), and the model
classes another second. A process that runs a model through the decoder reads its context window,
vocabulary and end-of-sequence ids here instead.

The decoder takes a model only when these files state every value its forward depends on: a
value left to a config class's default (which differs between classes and releases) sends the
model to transformers' own code, which stays the reference path. So does anything the forward
does not implement: another rope type, an activation other than SiLU, quantized weights, custom
code, a sliding window on only some layers, or a checkpoint holding tensors it would not use.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# model_type -> the one architecture class its checkpoints name
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names of the dtypes the decoder reads
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only Llama-family model as the decoder runs it (names as in transformers' configs,
    so `preflight.context_window` and `vocab_size` read it as they read a transformers config)."""

    path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None  # every layer's, or None
    qk_norm: bool  # Qwen3: RMSNorm over each query and key head before rotary embeddings
    qkv_bias: bool  # Qwen2's always; Llama's and Qwen3's where `attention_bias`
    o_bias: bool  # Llama's and Qwen3's where `attention_bias`
    mlp_bias: bool  # Llama's where `mlp_bias`
    eos_token_id: int | list[int] | None  # the generation config's, as transformers reads it
    files: tuple[str, ...]  # the safetensors files holding the weights

    @property
    def _name_or_path(self) -> str:  # as a transformers config names its model
        return self.path

    def tensor_names(self) -> set[str]:
        """The checkpoint's tensors the forward reads, every one of them."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            names |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
            names |= {f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
            if self.qk_norm:
                names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
            for on, part, xs in ((self.qkv_bias, "self_attn", "qkv"), (self.o_bias, "self_attn", "o"),
                                 (self.mlp_bias, "mlp", ("gate", "up", "down"))):
                if on:
                    names |= {f"{p}{part}.{x}_proj.bias" for x in xs}
        return names


def read(model_dir: str | Path) -> tuple[DecoderConfig | None, str | None]:
    """`(config, None)` if the decoder runs this model directory, else `(None, why not)`."""
    d = Path(model_dir)
    try:
        raw = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        return None, f"no readable config.json in {d} ({e})"
    if not isinstance(raw, dict):
        return None, "config.json is not an object"
    why = _unsupported(raw)
    if why:
        return None, why
    try:
        files, dtypes = _checkpoint(d)
    except (OSError, ValueError, struct.error) as e:
        return None, f"cannot read its safetensors headers ({e})"
    if not files:
        return None, "its weights are not in safetensors files"
    heads, mt = raw["num_attention_heads"], raw["model_type"]
    attention_bias = mt in ("llama", "qwen3") and bool(raw["attention_bias"])
    window = raw.get("sliding_window") if mt == "mistral" else None
    config = DecoderConfig(
        path=str(d), model_type=mt, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, rms_norm_eps=float(raw["rms_norm_eps"]),
        rope_theta=float(_rope(raw)[1]), max_position_embeddings=raw["max_position_embeddings"],
        tie_word_embeddings=bool(raw["tie_word_embeddings"]), sliding_window=window,
        qk_norm=mt == "qwen3", qkv_bias=mt == "qwen2" or attention_bias, o_bias=attention_bias,
        mlp_bias=mt == "llama" and bool(raw["mlp_bias"]), eos_token_id=_eos(d, raw), files=tuple(files))
    want = config.tensor_names()
    extra = {n for n in dtypes.keys() - want if not n.endswith("rotary_emb.inv_freq")}
    missing = want - dtypes.keys()
    if missing or extra:
        which = f"lacks {sorted(missing)[0]}" if missing else f"holds {sorted(extra)[0]}, which it would not use"
        return None, f"its checkpoint {which}"
    odd = sorted(n for n in want if dtypes[n] not in FLOAT_DTYPES)
    if odd:
        return None, f"its checkpoint stores {odd[0]} as {dtypes[odd[0]]}, not a floating-point type"
    return config, None


def _unsupported(raw: dict) -> str | None:
    mt = raw.get("model_type")
    if mt not in ARCHITECTURES:
        return f"model type {mt!r} (the decoder runs {', '.join(ARCHITECTURES)})"
    if raw.get("architectures") not in (None, [ARCHITECTURES[mt]]):
        return f"architectures {raw.get('architectures')}"
    for key in ("quantization_config", "auto_map"):
        if key in raw:
            return f"config.json has {key}"
    missing = [k for k in _REQUIRED if not (isinstance(raw.get(k), bool) if k == "tie_word_embeddings"
                                            else _number(raw.get(k)))]
    if missing:
        return f"config.json does not state {missing[0]}"
    if raw.get("hidden_act", None) != "silu":
        return f"hidden_act {raw.get('hidden_act')!r}"
    head_dim = raw.get("head_dim")
    if head_dim is None and (mt == "qwen3" or raw["hidden_size"] % raw["num_attention_heads"]):
        return "config.json does not state head_dim"
    if raw["num_attention_heads"] % raw["num_key_value_heads"]:
        return "query heads are not a multiple of key/value heads"
    rope_type, theta = _rope(raw)
    if rope_type != "default" or not isinstance(theta, (int, float)):
        return f"rope type {rope_type!r}" if rope_type != "default" else "config.json does not state rope_theta"
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    if mt == "mistral":
        if "sliding_window" not in raw:
            return "config.json does not state sliding_window"
        if raw["sliding_window"] is not None and not isinstance(raw["sliding_window"], int):
            return f"sliding_window {raw['sliding_window']!r}"
    if mt in ("qwen2", "qwen3"):
        types = raw.get("layer_types")
        full = raw.get("use_sliding_window") is False if types is None else \
            all(t == "full_attention" for t in types) and len(types) == raw["num_hidden_layers"]
        if not full:
            return "sliding windows on some layers" if types is not None else "config.json does not state use_sliding_window"
    if mt in ("llama", "qwen3") and not isinstance(raw.get("attention_bias"), bool):
        return "config.json does not state attention_bias"
    if mt == "llama" and not isinstance(raw.get("mlp_bias"), bool):
        return "config.json does not state mlp_bias"
    return None


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rope(raw: dict) -> tuple[object, object]:
    """(rope type, theta) from transformers 5's `rope_parameters` or the older top-level keys."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        return params.get("rope_type", params.get("type")), params.get("rope_theta")
    scaling = raw.get("rope_scaling")
    if scaling:
        return scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling, None
    return "default", raw.get("rope_theta")


def _eos(d: Path, raw: dict) -> int | list[int] | None:
    """transformers' models take `eos_token_id` from `generation_config.json` where there is one,
    else from the model's config."""
    try:
        gen = json.loads((d / "generation_config.json").read_text())
    except (OSError, ValueError):
        return raw.get("eos_token_id")
    return gen.get("eos_token_id") if isinstance(gen, dict) else raw.get("eos_token_id")


def _checkpoint(d: Path) -> tuple[list[str], dict[str, str]]:
    """The safetensors files, and the tensors they hold with their dtypes (headers only)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return [], {}
    dtypes: dict[str, str] = {}
    for f in files:
        dtypes |= {k: v["dtype"] for k, v in header(d / f)[1].items() if k != "__metadata__"}
    return [str(d / f) for f in files], dtypes


def header(path: str | Path) -> tuple[int, dict]:
    """A safetensors file's header: (where its data starts, {tensor name: dtype, shape and byte
    offsets into the data}); the file starts with the header's length, then the header as JSON."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return 8 + n, json.loads(fh.read(n))
