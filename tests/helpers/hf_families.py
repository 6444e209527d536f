"""Random tiny configs of every model family on transformers' model code's allow-list
(`batchgen.pipeline.model.hf_support.SUPPORTED`), and of families refused, for the sweeps
(tests/model/test_hf_sweep.py) and the refusal tests.

A family's draw varies the knobs its model code reads (key/value heads, head sizes, biases, QK
norms, sliding windows and layer types, rope types, MoE routing, multipliers, NoPE layers, MLA
ranks); `randomize` then moves every 1-D weight (norm weights and biases, biases, attention
sinks, router biases) off its initial value, so that no knob is a no-op on the tiny model.
"""
from __future__ import annotations

import random

import torch
import transformers as T

from tests.helpers.tiny_models import COMMON, CONFIGS

WINDOW = (5, 8, 12)  # sliding windows: the sweep's prompts and generations cross them


def _base(rng: random.Random, heads=(4, 8)) -> dict:
    h = rng.choice(heads)
    return dict(**COMMON, hidden_size=64, intermediate_size=rng.choice([96, 128]), num_hidden_layers=2,
                num_attention_heads=h, num_key_value_heads=rng.choice([k for k in (1, 2, 4) if h % k == 0]),
                max_position_embeddings=512, tie_word_embeddings=rng.random() < 0.4)


def _rope(rng: random.Random) -> dict:
    kind = rng.choice(["default", "default", "linear", "yarn", "llama3", "dynamic"])
    extra = {"default": {}, "linear": {"factor": 2.0},
             "yarn": {"factor": 4.0, "original_max_position_embeddings": 24},
             "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 24},
             "dynamic": {"factor": 2.0}}[kind]
    return {"rope_parameters": {"rope_type": kind, "rope_theta": rng.choice([1e4, 5e5]), **extra}}


def _sliding(rng: random.Random, layers: int = 2) -> dict:
    """A window, and layer types with a sliding layer at least (the first, or the last)."""
    types = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers - 1)]
    types.insert(rng.choice([0, layers - 1]), "sliding_attention")
    return {"sliding_window": rng.choice(WINDOW), "layer_types": types}


def _draw(family: str, rng: random.Random) -> T.PretrainedConfig:
    kw = _base(rng)
    hd = {"head_dim": rng.choice([8, 16, 32])}
    if family in ("gpt2", "gpt_neox", "opt"):
        config = CONFIGS[family]()
        if family == "gpt_neox":
            config.use_parallel_residual = rng.random() < 0.5
        return config
    if family == "llama":
        kw |= hd | _rope(rng) | {"attention_bias": rng.random() < 0.5, "mlp_bias": rng.random() < 0.5}
    elif family == "mistral":
        kw |= hd | {"sliding_window": rng.choice(WINDOW)}
    elif family == "ministral":  # Mistral with layer types (transformers loads a Mistral that has them as one)
        kw |= hd | _sliding(rng)
    elif family in ("qwen2", "qwen3"):
        kw |= hd | _rope(rng) | {"use_sliding_window": True, "sliding_window": rng.choice(WINDOW),
                                 "max_window_layers": rng.choice([0, 1])}
    elif family == "qwen3_moe":
        kw |= hd | {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "decoder_sparse_step": rng.choice([1, 2]), "norm_topk_prob": rng.random() < 0.5}
    elif family == "mixtral":
        kw |= hd | {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": rng.choice(WINDOW)}
    elif family == "gemma":
        kw |= {"head_dim": 16}
    elif family == "gemma2":
        kw |= {"head_dim": 16, "query_pre_attn_scalar": rng.choice([16, 24]), "sliding_window": rng.choice(WINDOW),
               "attn_logit_softcapping": rng.choice([50.0, 5.0]), "final_logit_softcapping": rng.choice([30.0, None])}
    elif family == "gemma3_text":
        kw |= {"head_dim": 16, "query_pre_attn_scalar": rng.choice([16, 24]), **_sliding(rng),
               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    elif family == "gemma3n_text":  # its last layers reuse the keys and values of the last ones that store them
        kw |= {"head_dim": 16, "num_hidden_layers": 4, "vocab_size_per_layer_input": 256,
               "layer_types": [rng.choice(["sliding_attention", "full_attention"]), "full_attention"] * 2,
               "num_kv_shared_layers": 2, "sliding_window": rng.choice(WINDOW), "hidden_size_per_layer_input": 16,
               "laurel_rank": 8, "altup_num_inputs": 2,
               "activation_sparsity_pattern": [rng.choice([0.0, 0.95]), 0.0, 0.0, 0.0]}
    elif family in ("olmo2",):
        kw |= {"attention_bias": rng.random() < 0.5}
    elif family == "olmo3":
        kw |= _sliding(rng)
    elif family in ("granite", "granite_swa"):
        if family == "granite_swa":
            kw |= _sliding(rng)
        kw |= {"embedding_multiplier": rng.choice([2.0, 12.0]), "residual_multiplier": rng.choice([0.2, 0.5]),
               "attention_multiplier": rng.choice([0.05, 0.2]), "logits_scaling": rng.choice([2.0, 8.0])}
    elif family == "cohere":
        kw |= {"use_qk_norm": rng.random() < 0.5, "logit_scale": rng.choice([0.5, 1.0])}
    elif family == "cohere2":
        kw |= {"sliding_window": rng.choice(WINDOW), "layer_types": ["sliding_attention", "full_attention"]}
    elif family == "phi":
        kw |= {"partial_rotary_factor": rng.choice([0.5, 1.0]), "qk_layernorm": rng.random() < 0.5}
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    elif family == "phi3":
        kw |= {"partial_rotary_factor": rng.choice([0.5, 1.0]), "sliding_window": rng.choice(WINDOW + (None,))}
    elif family == "starcoder2":
        kw |= {"sliding_window": rng.choice(WINDOW), "use_bias": rng.random() < 0.5}
    elif family == "smollm3":
        kw |= {"no_rope_layers": [rng.choice([0, 1]) for _ in range(2)]}
    elif family in ("glm", "glm4"):
        kw |= {"head_dim": 16, "partial_rotary_factor": 0.5, "attention_bias": rng.random() < 0.5}
    elif family == "deepseek_v3":
        kw |= {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
               "moe_intermediate_size": 32, "first_k_dense_replace": rng.choice([0, 1]), "n_shared_experts": 1,
               "q_lora_rank": rng.choice([None, 32]), "kv_lora_rank": 16, "qk_rope_head_dim": 8,
               "qk_nope_head_dim": rng.choice([8, 16]), "v_head_dim": rng.choice([8, 16]),
               "rope_interleave": rng.random() < 0.5,
               "rope_parameters": rng.choice([
                   {"rope_type": "default", "rope_theta": 1e4},
                   {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 24,
                    "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}])}
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    elif family == "exaone4":
        kw |= hd | {"sliding_window": rng.choice(WINDOW), "sliding_window_pattern": 2,
                    "layer_types": ["sliding_attention", "full_attention"]}
    elif family == "gpt_oss":
        kw |= {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": rng.choice(WINDOW),
               "layer_types": ["sliding_attention", "full_attention"],
               "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24,
                                   "rope_theta": 1.5e5, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}}
    elif family in ("ernie4_5", "seed_oss", "arcee", "apertus"):  # Llama's layout, other MLPs and biases
        kw |= hd | _rope(rng) | {"attention_bias": rng.random() < 0.5}
    elif family == "olmo":
        kw |= {"clip_qkv": rng.choice([None, 0.5])}
    elif family in ("qwen2_moe", "olmoe"):
        kw |= {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": rng.random() < 0.5}
        if family == "qwen2_moe":
            kw |= {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
        else:
            kw |= {"clip_qkv": rng.choice([None, 0.5])}
    elif family == "granitemoe":
        kw |= {"num_local_experts": 4, "num_experts_per_tok": 2, "embedding_multiplier": 6.0,
               "residual_multiplier": 0.3, "attention_multiplier": 0.1, "logits_scaling": 4.0}
    elif family == "glm4_moe":
        kw |= {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "n_group": 1, "topk_group": 1, "first_k_dense_replace": rng.choice([0, 1]), "partial_rotary_factor": 0.5,
               "use_qk_norm": rng.random() < 0.5, "attention_bias": rng.random() < 0.5}
    elif family == "ernie4_5_moe":
        kw |= {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 1,
               "moe_layer_start_index": rng.choice([0, 1])}
    elif family in REFUSED:
        kw |= REFUSED[family]
    else:
        raise KeyError(family)
    return T.AutoConfig.for_model(family, **kw)


# families refused, with what their draw needs (tests/model/test_hf_sweep.py; the CLI test)
REFUSED = {
    "stablelm": {}, "falcon": {"new_decoder_architecture": True}, "nemotron": {}, "lfm2": {},
    "granitemoe_swa": {"sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    "llama4_text": {"head_dim": 16}, "bloom": {},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
}


def config(family: str, seed: int) -> T.PretrainedConfig:
    """A random config of `family`, drawn from `seed`."""
    return _draw(family, random.Random(f"{family}-{seed}"))


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every 1-D parameter (norm weights and biases, linear biases, attention sinks, router
    biases) moved off its initial value: a norm weight of ones or a zero bias would make the knob
    that reads it a no-op."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            spread = 1.0 if "sinks" in name else 0.3  # sinks start at zero: spread them past the scores
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * spread)
    return model
