"""Tiny random causal LMs built from configs (no downloads), one per architecture family.

Weights are drawn wide (initializer_range) so greedy choices are not near-ties that float
noise between batched and unbatched kernels could flip.
"""
from __future__ import annotations

import torch
import transformers as T

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)

CONFIGS = {
    "llama": lambda: T.LlamaConfig(**COMMON, **LLAMA_LIKE),
    "qwen2": lambda: T.Qwen2Config(**COMMON, **LLAMA_LIKE),
    # a short window so prompts and generations cross it
    "mistral": lambda: T.MistralConfig(**COMMON, **LLAMA_LIKE, sliding_window=12),
    "gemma2": lambda: T.Gemma2Config(**COMMON, **LLAMA_LIKE, head_dim=16,
                                     sliding_window=10, query_pre_attn_scalar=16),
    "phi3": lambda: T.Phi3Config(**COMMON, **LLAMA_LIKE, partial_rotary_factor=0.5),
    "gpt2": lambda: T.GPT2Config(**COMMON, n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "gpt_neox": lambda: T.GPTNeoXConfig(**COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=512),
    "opt": lambda: T.OPTConfig(**COMMON, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                               num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=512),
}
ARCHS = list(CONFIGS)
# more layouts batchgen's own decoder (pipeline/model/decoder.py) runs: Qwen3's per-head norms, Llama's biases
EXTRA = {
    "qwen3": lambda: T.Qwen3Config(**COMMON, **LLAMA_LIKE, head_dim=16),
    "llama_bias": lambda: T.LlamaConfig(**COMMON, **LLAMA_LIKE, attention_bias=True, mlp_bias=True),
    # heads of 32: the size AMX tiles take (pipeline/cpu_anchors.c), which the others' 16 is not
    "llama_head32": lambda: T.LlamaConfig(**COMMON, **LLAMA_LIKE, head_dim=32),
}


def make_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return model_from_config((CONFIGS.get(arch) or EXTRA[arch])(), seed, dtype)


def model_from_config(config: T.PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random model of `config` (its weights drawn wide, from `seed`), in eval mode."""
    config.initializer_range = 0.3
    torch.manual_seed(seed)
    try:
        model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    except ValueError:  # e.g. Gemma2 (logit soft-capping) only runs eager attention
        model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    return model.eval()


def make_decoder(arch: str, directory, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The tiny model saved to `directory` and loaded into batchgen's own decoder: (transformers'
    model, the decoder), the same weights."""
    from batchgen.pipeline.model.decoder import Decoder
    from batchgen.pipeline.model.decoder_config import read

    model = make_model(arch, seed=seed, dtype=dtype)
    model.save_pretrained(directory)
    config, why = read(directory)
    assert why is None, why
    return model, Decoder(config, torch.device("cpu"), dtype)
