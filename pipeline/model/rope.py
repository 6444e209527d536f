"""Rotary position embeddings as transformers 5.24 runs them, for batchgen's own decoder and for the
one refusal that holds on both model codes.

`parameters` reads a `config.json` the way transformers' configs standardize it
(`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` and `standardize_rope_params`): a
truthy `rope_scaling` replaces `rope_parameters` whole, `rope_theta` comes from that dict, else
the top-level key, else 10000, and a top-level `original_max_position_embeddings` wins over the
dict's (the model's rotary module standardizes again once the config has it as an attribute).
`inv_freq` then computes the frequencies with transformers' own functions (`ROPE_INIT_FUNCTIONS`),
so the decoder's tables are transformers' to the bit.

transformers chooses longrope's short or long factors per forward, from the longest position in
that forward (`dynamic_rope_update`). In one uncached `generate` the prompt's keys get the factors
of the prompt's length, and each later token those of its own position; batchgen packs rows of
different lengths into one forward and prefills a shared prefix once for rows of every length, so
no forward of it can match, on either model code: `refusal` refuses longrope models. "dynamic"
(NTK) rescales only once a forward reaches past `max_position_embeddings`, which batchgen never
runs (a row longer than the context window is an error row), so its frequencies stay those of
the model's start, the same in every forward: it runs.
Torch-free at import (`decoder_config` reads rope here for `validate`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_THETA = 10_000.0  # `RotaryEmbeddingConfigMixin.default_theta` of Llama, Mistral, Qwen2, Qwen3
TYPES = ("default", "linear", "dynamic", "yarn", "llama3")  # what the decoder computes
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")  # types transformers gives `original_max_position_embeddings`
# per type: the keys transformers' validation requires, then the optional ones its function reads
_REQUIRED = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
             "yarn": ("factor", "original_max_position_embeddings"),
             "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}
_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
LONGROPE = ("rope type longrope: transformers picks its short or long factors per forward from that "
            "forward's longest position, which batchgen's packed, prefix-shared forwards cannot reproduce "
            "for each row; batchgen does not run longrope models")
NOT_CAUSAL = ("its config sets is_causal to false (attention in both directions), and batchgen only "
              "generates causally; batchgen does not run this model")


def parameters(raw: dict) -> dict | str:
    """The rope parameters transformers runs this `config.json` with (a fresh dict), or why the
    decoder cannot tell (nested per layer type, not a dict)."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return f"rope parameters {params!r}"
    if any(isinstance(v, dict) for v in params.values()):
        return "rope parameters per layer type"
    params = dict(params)
    params.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_THETA))  # a stated null stays None
    if raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _NEEDS_ORIGINAL:
        if "original_max_position_embeddings" in raw:
            params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return params


def unsupported(params: dict) -> str | None:
    """Why the decoder does not compute these (standardized) parameters, or None."""
    kind = params["rope_type"]
    if kind not in TYPES:
        return f"rope type {kind!r}"
    if not _number(params["rope_theta"]):
        return f"rope_theta {params['rope_theta']!r}"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    for key in _REQUIRED[kind]:
        if not _number(params.get(key)) and not (kind == "yarn" and key == "factor" and key in params
                                                 and params[key] is None):  # yarn: max/original
            return f"rope parameter {key} {params.get(key)!r}" if key in params else f"rope parameters lack {key}"
    for key in _OPTIONAL.get(kind, ()):
        if params.get(key) is not None and not _number(params[key]):
            return f"rope parameter {key} {params[key]!r}"
    if kind == "yarn" and not isinstance(params.get("truncate", True), bool):
        return f"rope parameter truncate {params['truncate']!r}"
    return None


def refusal(is_causal: Any, params: Any) -> str | None:
    """Why no model code of batchgen's runs a model as transformers' uncached `generate` would
    (a config's `is_causal` and its standardized rope parameters, flat or per layer type), or None."""
    if not is_causal:  # transformers' masks turn bidirectional for any false value
        return NOT_CAUSAL
    groups = [params] + list(params.values()) if isinstance(params, dict) else []
    if any(isinstance(g, dict) and g.get("rope_type", g.get("type")) == "longrope" for g in groups):
        return LONGROPE
    return None


@dataclass
class _Config:
    """What transformers' rope functions read of a config; its parameters are standardized already."""

    rope_parameters: dict
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    max_position_embeddings: int

    def standardize_rope_params(self) -> None:
        pass


def inv_freq(params: dict, hidden_size: int, heads: int, head_dim: int, max_positions: int):
    """(inverse frequencies (D/2,) float32 on the CPU, the factor on cos and sin), as the model's
    rotary module computes them at its start."""
    import torch

    if params["rope_type"] == "default":  # the model classes' own `compute_default_rope_parameters`
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _Config(dict(params), hidden_size, heads, head_dim, max_positions)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
