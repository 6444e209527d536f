"""Which models batchgen's own decoder (`batchgen.pipeline.model.decoder`) runs, read straight from the files of
a model directory: `config.json`, `generation_config.json` and the safetensors headers.

Torch-free, and free of transformers' config classes: importing a Llama config class pulls in
`torch.distributed.tensor`, sympy and `torch._dynamo`, and the model classes more (BENCHMARKS.md). A process that runs a model through the decoder reads its context window,
vocabulary and end-of-sequence ids here instead.

The decoder runs a model exactly as transformers 5.24 does, or not at all. Acceptance is an
allow-list: every `config.json` key is one the forward reads here (as transformers' config
classes and model code read it), one transformers never reads in a forward (token ids, metadata,
generation settings), or a reason to send the model to transformers' own code, which stays the
reference path. So is a value left to a config class's default (which differs between classes
and releases), and anything the forward does not implement: another rope type, an activation
other than SiLU, quantized weights, custom code, a layer type other than full and sliding
attention, or a checkpoint holding tensors it would not use. A model that neither model code
runs as transformers would (`rope.refusal`), or whose tensors' shapes disagree with its config
(transformers refuses those too), raises `Refused`.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from batchgen.pipeline.model import rope
from batchgen.pipeline.errors import BatchgenError

# model_type -> the one architecture class its checkpoints name
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names of the dtypes the decoder reads
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
# the keys read below, by every model type and by some
_READ = frozenset(_REQUIRED) | {"model_type", "architectures", "head_dim", "hidden_act", "is_causal", "rope_parameters",
                                "rope_scaling", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings"}
_READ_BY_TYPE = {"llama": {"attention_bias", "mlp_bias"}, "mistral": {"sliding_window", "layer_types"},
                 "qwen2": {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
                 "qwen3": {"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}}
# keys no forward of these models reads in transformers 5.24: metadata, settings for training or
# for the module's start, and keys SmolLM2's and transformers.js' exports write (every key ending
# in `_token_id` is harmless too: the end-of-sequence ids are read apart, from the generation config)
_HARMLESS = frozenset({"transformers_version", "torch_dtype", "dtype", "_name_or_path", "_model_name_or_path",
                       "initializer_range", "use_cache", "attention_dropout", "pretraining_tp", "is_llama_config",
                       "rope_interleaved", "transformers.js_config", "tokenizer_class"})
# generation settings, which transformers' configs drop on load (`GenerationConfig._get_default_generation_params`)
_GENERATION = frozenset({
    "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids", "begin_suppress_tokens",
    "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size", "encoder_repetition_penalty",
    "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty", "length_penalty", "max_length",
    "min_length", "no_repeat_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule", "num_beam_groups",
    "num_beams", "num_return_sequences", "output_scores", "remove_invalid_values", "repetition_penalty",
    "return_dict_in_generate", "suppress_tokens", "target_lookbehind", "temperature", "top_k", "top_p", "typical_p"})
_FULL, _SLIDING = "full_attention", "sliding_attention"


class Refused(BatchgenError):
    """A model no model code of batchgen's runs as transformers does, or a checkpoint whose tensors
    disagree with its config; the message says which, in one line."""


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
    rope_parameters: dict  # standardized as transformers holds them (`rope.parameters`)
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_windows: tuple[int | None, ...]  # each layer's sliding window, or None for full attention
    qk_norm: bool  # Qwen3: RMSNorm over each query and key head before rotary embeddings
    qkv_bias: bool  # Qwen2's always; Llama's and Qwen3's where `attention_bias`
    o_bias: bool  # Llama's and Qwen3's where `attention_bias`
    mlp_bias: bool  # Llama's where `mlp_bias`
    eos_token_id: int | list[int] | None  # the generation config's, as transformers reads it
    files: tuple[str, ...]  # the safetensors files holding the weights

    @property
    def _name_or_path(self) -> str:  # as a transformers config names its model
        return self.path

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensors the forward reads, every one of them, with the shapes
        transformers' modules give them for this config."""
        h, i, d, v = self.hidden_size, self.intermediate_size, self.head_dim, self.vocab_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, h)
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
            for part, x, rows, cols, on in (("self_attn", "q", q, h, self.qkv_bias), ("self_attn", "k", kv, h, self.qkv_bias),
                                            ("self_attn", "v", kv, h, self.qkv_bias), ("self_attn", "o", h, q, self.o_bias),
                                            ("mlp", "gate", i, h, self.mlp_bias), ("mlp", "up", i, h, self.mlp_bias),
                                            ("mlp", "down", h, i, self.mlp_bias)):
                shapes[f"{p}{part}.{x}_proj.weight"] = (rows, cols)
                if on:
                    shapes[f"{p}{part}.{x}_proj.bias"] = (rows,)
            if self.qk_norm:
                shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        return shapes

    def tensor_names(self) -> set[str]:
        return set(self.tensor_shapes())

    def linears(self) -> list[tuple[str, tuple[str, ...], bool]]:
        """The decoder's linear layers: (key, the checkpoint's weights it stacks by output, whether
        they have biases), in the order the decoder builds them (`decoder.Layer` says why queries,
        keys and values are one layer and gate and up two). `batchgen.pipeline.model.prepack` packs the same."""
        out = []
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            for key, part, names, bias in (("qkv", "self_attn", ("q", "k", "v"), self.qkv_bias),
                                           ("o", "self_attn", ("o",), self.o_bias),
                                           ("gate", "mlp", ("gate",), self.mlp_bias), ("up", "mlp", ("up",), self.mlp_bias),
                                           ("down", "mlp", ("down",), self.mlp_bias)):
                out.append((p + key, tuple(f"{p}{part}.{x}_proj.weight" for x in names), bias))
        head = "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"
        return out + [("lm_head", (head,), False)]


def read(model_dir: str | Path) -> tuple[DecoderConfig | None, str | None]:
    """`(config, None)` if the decoder runs this model directory, else `(None, why not)`: then
    transformers' model code runs it. Raises `Refused` (see the module's docstring)."""
    d = Path(model_dir)
    try:
        raw = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        return None, f"no readable config.json in {d} ({e})"
    if not isinstance(raw, dict):
        return None, "config.json is not an object"
    mt = raw.get("model_type")
    if mt not in ARCHITECTURES:
        return None, f"model type {mt!r} (the decoder runs {', '.join(ARCHITECTURES)})"
    params = rope.parameters(raw)
    refused = rope.refusal(raw.get("is_causal", True), params)
    if refused:
        raise Refused(refused)
    why = _unsupported(raw) or (params if isinstance(params, str) else rope.unsupported(params))
    if why:
        return None, why
    head_dim, windows = _head_dim(raw), _windows(raw)
    for why in (head_dim, windows):
        if isinstance(why, str):
            return None, why
    try:
        files, tensors = _checkpoint(d)
    except (OSError, ValueError, struct.error) as e:
        return None, f"cannot read its safetensors headers ({e})"
    if not files:
        return None, "its weights are not in safetensors files"
    attention_bias = mt in ("llama", "qwen3") and raw["attention_bias"]
    config = DecoderConfig(
        path=str(d), model_type=mt, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"], num_key_value_heads=raw["num_key_value_heads"],
        head_dim=head_dim, rms_norm_eps=float(raw["rms_norm_eps"]), rope_parameters=params,
        max_position_embeddings=raw["max_position_embeddings"], tie_word_embeddings=raw["tie_word_embeddings"],
        layer_windows=windows, qk_norm=mt == "qwen3", qkv_bias=mt == "qwen2" or attention_bias,
        o_bias=attention_bias, mlp_bias=mt == "llama" and raw["mlp_bias"], eos_token_id=_eos(d, raw),
        files=tuple(files))
    want = config.tensor_shapes()
    extra = {n for n in tensors.keys() - want.keys() if not n.endswith("rotary_emb.inv_freq")}
    missing = want.keys() - tensors.keys()
    if missing or extra:
        which = f"lacks {sorted(missing)[0]}" if missing else f"holds {sorted(extra)[0]}, which it would not use"
        return None, f"its checkpoint {which}"
    wrong = sorted(n for n in want if tuple(tensors[n]["shape"]) != want[n])
    if wrong:
        n, more = wrong[0], f" (and {len(wrong) - 1} more tensors)" if len(wrong) > 1 else ""
        raise Refused(f"its checkpoint's {n} has shape {list(tensors[n]['shape'])}, but config.json makes it "
                      f"{list(want[n])}{more}: the config does not match the weights")
    odd = sorted(n for n in want if tensors[n]["dtype"] not in FLOAT_DTYPES)
    if odd:
        return None, f"its checkpoint stores {odd[0]} as {tensors[odd[0]]['dtype']}, not a floating-point type"
    return config, None


def _unsupported(raw: dict) -> str | None:
    mt = raw["model_type"]
    if raw.get("architectures") not in (None, [ARCHITECTURES[mt]]):
        return f"architectures {raw.get('architectures')}"
    known = _READ | _READ_BY_TYPE[mt] | _HARMLESS | _GENERATION
    unknown = sorted(k for k in raw if k not in known and not k.endswith("_token_id"))
    if unknown:
        return f"config.json has {unknown[0]}, which the decoder does not read"
    missing = [k for k in _REQUIRED if not (isinstance(raw.get(k), bool) if k == "tie_word_embeddings"
                                            else _number(raw.get(k)))]
    if missing:
        return f"config.json does not state {missing[0]}"
    if raw.get("hidden_act", None) != "silu":
        return f"hidden_act {raw.get('hidden_act')!r}"
    if raw["num_attention_heads"] % raw["num_key_value_heads"]:
        return "query heads are not a multiple of key/value heads"
    if mt in ("llama", "qwen3") and not isinstance(raw.get("attention_bias"), bool):
        return "config.json does not state attention_bias"
    if mt == "llama" and not isinstance(raw.get("mlp_bias"), bool):
        return "config.json does not state mlp_bias"
    return None


def _head_dim(raw: dict) -> int | str:
    """The head size transformers' modules use, or why the decoder does not run it."""
    mt, value, hidden, heads = raw["model_type"], raw.get("head_dim"), raw["hidden_size"], raw["num_attention_heads"]
    if mt == "llama" and hidden % heads:  # LlamaConfig refuses it, whatever head_dim says
        return "hidden_size is not a multiple of num_attention_heads"
    if _count(value):
        return value
    if value is not None:
        return f"head_dim {value!r}"
    # a missing head_dim is hidden // heads, except: Qwen3's class default (128); Mistral with layer_types
    # runs as Ministral, whose modules read a stated null as it is; Qwen2's modules read a stated null too
    if mt == "qwen3" or (mt == "mistral" and "layer_types" in raw) or (mt == "qwen2" and "head_dim" in raw) \
            or hidden % heads:
        return "config.json does not state head_dim"
    return hidden // heads


def _windows(raw: dict) -> tuple[int | None, ...] | str:
    """Each layer's sliding window as transformers' model code applies it, or why the decoder does
    not run it. Mistral with `layer_types` (even null) runs as Ministral: windows per layer."""
    mt, n = raw["model_type"], raw["num_hidden_layers"]
    if mt == "llama":
        return (None,) * n
    if mt in ("qwen2", "qwen3") and not isinstance(raw.get("use_sliding_window"), bool):
        return "config.json does not state use_sliding_window"
    used = mt == "mistral" or raw["use_sliding_window"]  # Qwen2Config and Qwen3Config drop an unused window
    if used and "sliding_window" not in raw:
        return "config.json does not state sliding_window"
    window = raw["sliding_window"] if used else None
    if window is not None and not _count(window):
        return f"sliding_window {window!r}"
    types = raw.get("layer_types")
    if types is None:
        if mt == "mistral" or window is None:
            types = [_FULL if window is None else _SLIDING] * n
        elif not (isinstance(raw.get("max_window_layers"), int) and not isinstance(raw["max_window_layers"], bool)):
            return "config.json does not state max_window_layers"
        else:
            types = [_SLIDING if i >= raw["max_window_layers"] else _FULL for i in range(n)]
    if not (isinstance(types, list) and len(types) == n and all(t in (_FULL, _SLIDING) for t in types)):
        return f"layer_types {types!r}"
    if _SLIDING in types and window is None:
        return "sliding layers without a sliding window"
    return tuple(window if t == _SLIDING else None for t in types)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _eos(d: Path, raw: dict) -> int | list[int] | None:
    """transformers' models take `eos_token_id` from `generation_config.json` where there is one,
    else from the model's config."""
    try:
        gen = json.loads((d / "generation_config.json").read_text())
    except (OSError, ValueError):
        return raw.get("eos_token_id")
    return gen.get("eos_token_id") if isinstance(gen, dict) else raw.get("eos_token_id")


def _checkpoint(d: Path) -> tuple[list[str], dict[str, dict]]:
    """The safetensors files, and the tensors they hold with their dtypes and shapes (headers only)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return [], {}
    tensors: dict[str, dict] = {}
    for f in files:
        tensors |= {k: v for k, v in header(d / f)[1].items() if k != "__metadata__"}
    return [str(d / f) for f in files], tensors


def header(path: str | Path) -> tuple[int, dict]:
    """A safetensors file's header: (where its data starts, {tensor name: dtype, shape and byte
    offsets into the data}); the file starts with the header's length, then the header as JSON."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return 8 + n, json.loads(fh.read(n))
