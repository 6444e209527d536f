"""Which models transformers' model code runs in batchgen: an allow-list, from the config alone.

batchgen runs a model it does not decode itself through transformers' own model code, with
batchgen's attention function in transformers' attention registry (`batchgen.pipeline.model.hf`).
Everything outside attention (norms, MLPs, experts, rope, multipliers) is transformers' code and
runs as it does in `generate`; what can part is what batchgen does instead of transformers: the
attention over its KV buffers, the flat forward with positions of its own, and no transformers
cache. A model type is on this list only where a generated sweep (`tests/model/test_hf_sweep.py`)
found batchgen's greedy tokens equal to uncached `generate`'s in float32 on several random
configs of it, with nested shared prefixes, prompts equal to a shared prefix, one-token prompts,
n > 1 and sliding windows crossed. Every other model type is refused in one line, before any
weights load (`batchgen validate` and `plan` read the config too), with the reason where one is
known. The attention interface refuses, besides, any argument it does not implement
(`hf.check_call`), which the probe forward at load finds (`hf.layer_shapes`); the probe also
reads the rule each layer's mask would follow, and refuses one batchgen would not apply.

What a config may set within a listed family is checked too: its rope types and attention layer
types must be ones the sweep covers (`rope.refusal` words longrope and non-causal configs;
`runnable` the keys only transformers' cache reads).
"""
from __future__ import annotations

from batchgen.pipeline.errors import option

# model types the sweep proves (tests/model/test_hf_sweep.py runs each; tests/helpers/hf_families.py draws them)
SUPPORTED = frozenset({
    "llama", "mistral", "ministral", "qwen2", "qwen3", "smollm3", "granite", "glm", "glm4", "exaone4", "olmo2",
    "olmo3", "cohere", "cohere2", "phi", "phi3", "starcoder2",  # Llama and its kin
    "gemma", "gemma2", "gemma3_text", "gemma3n_text",
    "olmo", "ernie4_5", "seed_oss", "arcee", "apertus",
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "glm4_moe", "ernie4_5_moe",
    "deepseek_v3",  # mixtures of experts; deepseek_v3's latent attention
    "gpt_oss", "granite_swa",  # attention sinks
    "gpt2", "gpt_neox", "opt",
})

_SINKS = ("attention sinks (s_aux) on a model batchgen has not verified them on; batchgen runs "
          "them on gpt_oss and granite_swa only")
_NO_STEP = ("its decoder layers call attention without passing on the forward's keyword arguments, so "
            "batchgen's attention cannot receive the forward's layout")
# why known model types are refused: what the architecture probe of issue 48 found, or what the
# model code does that batchgen's flat forward does not reproduce
KNOWN = {
    "llama4": "Llama 4's temperature tuning on NoPE layers reads a token's index in the forward, not its "
              "position, and its chunked attention batchgen does not implement",
    "llama4_text": "Llama 4's temperature tuning on NoPE layers reads a token's index in the forward, not its "
                   "position, and its chunked attention batchgen does not implement",
    "granitemoe_swa": _SINKS, "deepseek_v4": _SINKS, "flint": _SINKS, "hy_v4": _SINKS,
    "mimo_v2_flash": _SINKS,
    "stablelm": _NO_STEP, "falcon": _NO_STEP, "nemotron": _NO_STEP,
    "lfm2": "its convolution layers mix tokens outside attention, over transformers' cache",
    "lfm2_moe": "its convolution layers mix tokens outside attention, over transformers' cache",
    "gemma3n": "its multimodal model is not verified (its text model, gemma3n_text, is)",
    "phimoe": "its sliding window is in its attention mask only, not in its attention calls, and batchgen "
              "masks by the window the calls pass",
    "bloom": "its attention (ALiBi) bypasses transformers' attention interface",
    "mpt": "its attention (ALiBi) bypasses transformers' attention interface",
}
ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "llama3"})
LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def refused(model_type: str | None, reason: str) -> str:
    """The one line of a refusal, with the way to run the model anyway."""
    return f"model type {model_type!r} is not supported: {reason}; run it with {option('engine', 'vllm')}"


def unlisted(model_type: str | None) -> str | None:
    """Why a model type is off the list (None: it is on it)."""
    if model_type in SUPPORTED:
        return None
    return KNOWN.get(model_type, "not on the list of model types verified on transformers' model code in "
                                 "batchgen (docs/models.md)")


def knob_problem(config) -> str | None:
    """Why a listed model type's config sets a knob the sweep does not cover (None: it does not)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None)
    groups = [params, *params.values()] if isinstance(params, dict) else []
    for group in groups:
        if isinstance(group, dict) and ("rope_type" in group or "type" in group):
            kind = group.get("rope_type", group.get("type"))
            if kind not in ROPE_TYPES:
                return f"rope type {kind!r} is not verified (verified: {', '.join(sorted(ROPE_TYPES))})"
    other = sorted({t for t in getattr(text, "layer_types", None) or () if t not in LAYER_TYPES}, key=str)
    if other:
        return (f"layer_types {', '.join(map(repr, other))}: batchgen's attention runs "
                f"{' and '.join(sorted(LAYER_TYPES))} layers only")
    return None


def problem(config) -> str | None:
    """Why transformers' model code in batchgen does not run this config, in one line (None: it does)."""
    model_type = getattr(config, "model_type", None)
    why = unlisted(model_type) or foreign(config) or knob_problem(config)
    return None if why is None else refused(model_type, why)


def foreign(obj) -> str | None:
    """A config or model class from a model's own code (`trust_remote_code`), not transformers':
    the sweep verified transformers' model code of a model type, not another code of that name."""
    module = type(obj).__module__
    if module.startswith(("transformers.", "torch.")):
        return None
    return f"{type(obj).__name__} comes from the model's own code ({module}), which batchgen has not verified"
