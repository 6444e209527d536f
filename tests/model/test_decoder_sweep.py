"""A generated sweep of Llama-family configs on tiny random models: rope types (default, linear,
yarn, llama3, longrope, dynamic; `rope_scaling` beside `rope_parameters`, legacy top-level keys),
sliding windows and `layer_types`, attention and MLP biases, head sizes (stated or not), key/value
heads, tied embeddings, missing and unknown keys, tensors whose shapes disagree with the config,
`is_causal`. For each, batchgen (`load_model` as the CLI calls it, then the engine) either gives
plain uncached `generate`'s greedy tokens (float32) on the model transformers loads from the same
directory, or refuses the model with a one-line ModelLoadError, never anything else. Which of the
two model codes ran it, or that it was refused, is asserted per kind of config, so a decoder that
refused everything would fail too; every model the decoder runs is also run on transformers'
model code through the engine (`own_decoder=False`), which packs rows the same way.

The bases are drawn by a seeded generator; each mutation is tried on two of them.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
import transformers as T

from batchgen.pipeline.model.decoder import Decoder
from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.model.load import ModelLoadError, load_model
from batchgen.pipeline.engine.types import Request, SamplingParams
from tests.helpers.reference import reference_generate

EOS = [2]
WINDOW = 12  # Mistral's and Qwen's sliding window: the prompts cross it
ORIGINAL = 24  # original_max_position_embeddings of the scaled rope types: the prompts cross it too
DROP = object()
CLASSES = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config}


def _bases(rng: random.Random, family: str, n: int) -> list[dict]:
    """Random architectures of one family: (config class kwargs), each valid for transformers."""
    out = []
    for _ in range(n):
        heads = rng.choice([4, 8]) if family != "qwen3" else 4
        kw = dict(vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64,
                  intermediate_size=rng.choice([96, 128]), num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
                  max_position_embeddings=512, tie_word_embeddings=rng.random() < 0.4)
        if family == "qwen3" or rng.random() < 0.3:
            kw["head_dim"] = rng.choice([8, 16, 32])
        if family in ("llama", "qwen3"):
            kw["attention_bias"] = rng.random() < 0.4
        if family == "llama":
            kw["mlp_bias"] = rng.random() < 0.4
        if family == "mistral":
            kw["sliding_window"] = rng.choice([WINDOW, None])
        out.append(kw)
    return out


def _yarn(**extra):
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, **extra}


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": ORIGINAL}
# (name, families, config.json edits, expected: decoder | transformers | refused)
MUTATIONS = [
    ("plain", "all", {}, "decoder"),
    ("theta 5e5", "all", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "decoder"),
    # transformers prefers rope_scaling whole: its type, and the top-level theta (else 10000)
    ("rope_scaling linear beside rope_parameters", "all",
     {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "decoder"),
    ("rope_scaling yarn beside rope_parameters", "all", {"rope_scaling": _yarn()}, "decoder"),
    ("Qwen2.5 card's YaRN block", ("qwen2", "qwen3"),
     {"rope_scaling": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL, "type": "yarn"}}, "decoder"),
    ("rope_scaling default over theta 5e5", "all",
     {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": {"rope_type": "default"}},
     "decoder"),
    ("legacy rope_theta and rope_scaling llama3", ("llama",),
     {"rope_parameters": DROP, "rope_theta": 5e5, "rope_scaling": _LLAMA3}, "decoder"),
    ("llama3, top-level original_max_position_embeddings wins", ("llama",),
     {"rope_parameters": {**_LLAMA3, "rope_theta": 1e4, "original_max_position_embeddings": 8},
      "original_max_position_embeddings": 16}, "decoder"),
    ("yarn with mscale", ("llama", "qwen2"),
     {"rope_parameters": {**_yarn(mscale=0.7, mscale_all_dim=1.0, beta_fast=16), "rope_theta": 1e4}}, "decoder"),
    ("linear", ("mistral", "qwen3"), {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4}},
     "decoder"),
    # NTK rescales only past max_position_embeddings, which batchgen never runs
    ("dynamic", ("llama", "qwen2"), {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                                     "max_position_embeddings": 64}, "decoder"),
    ("longrope", ("llama", "qwen3"), {"rope_parameters": "longrope"}, "refused"),
    ("linear without factor", ("llama",), {"rope_scaling": {"rope_type": "linear"}}, "refused"),
    ("partial rotary, default rope", ("llama",), {"partial_rotary_factor": 0.5}, "transformers"),
    ("mistral layer_types full, full", ("mistral",), {"sliding_window": WINDOW,
                                                      "layer_types": ["full_attention", "full_attention"]}, "decoder"),
    ("mistral layer_types sliding, full", ("mistral",),
     {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}, "decoder"),
    ("mistral layer_types null", ("mistral",), {"sliding_window": WINDOW, "layer_types": None}, "decoder"),
    ("mistral layer_types without head_dim", ("mistral",),
     {"head_dim": DROP, "layer_types": ["full_attention", "full_attention"]}, "refused"),
    ("qwen sliding above max_window_layers", ("qwen2", "qwen3"),
     {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, "decoder"),
    ("qwen layer_types", ("qwen2", "qwen3"),
     {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
     "decoder"),
    ("is_causal true", "all", {"is_causal": True}, "decoder"),
    ("is_causal false", "all", {"is_causal": False}, "refused"),
    ("an unknown key", ("llama", "qwen2"), {"logits_scaling": 2.0}, "transformers"),  # their model code ignores it
    # generate's cache windows these at decode steps, where the model's masks do not
    ("a key only generate's cache reads", ("llama",), {"attention_chunk_size": 8}, "refused"),
    ("attention_chunk_size beside layer_types", ("qwen2",), {"attention_chunk_size": 8}, "transformers"),
    ("sliding_window on a Llama", ("llama",), {"sliding_window": WINDOW}, "refused"),
    ("missing rms_norm_eps", ("llama",), {"rms_norm_eps": DROP}, "transformers"),
    ("missing tie_word_embeddings", "all", {"tie_word_embeddings": DROP}, "any"),
    ("missing num_key_value_heads", "all", {"num_key_value_heads": DROP}, "any"),
    ("missing head_dim", ("llama", "qwen2", "qwen3"), {"head_dim": DROP}, "any"),
    ("intermediate_size off", "all", {"intermediate_size": "+32"}, "refused"),
    ("num_key_value_heads off", "all", {"num_key_value_heads": "kv"}, "refused"),
    ("head_dim off", "all", {"head_dim": "hd"}, "refused"),
    ("vocab_size off", "all", {"vocab_size": 250}, "refused"),
]


def _cases() -> list[tuple[str, str, dict, dict, str]]:
    rng = random.Random(23)
    cases = []
    for name, families, edits, expected in MUTATIONS:
        picks = list(CLASSES) if families == "all" else list(families)
        for family in rng.sample(picks, min(2, len(picks))) if len(picks) > 2 else picks:
            for base in _bases(rng, family, 1 if len(picks) > 1 else 2):
                if edits.get("tie_word_embeddings") is DROP:  # untied is the default: a tied checkpoint
                    base["tie_word_embeddings"] = False  # would load a random head on both sides
                cases.append((name, family, base, edits, expected))
    return cases


def _edit(raw: dict, base: dict, edits: dict) -> dict:
    raw = dict(raw)
    head_dim = base.get("head_dim") or base["hidden_size"] // base["num_attention_heads"]
    for key, value in edits.items():
        if value is DROP:
            raw.pop(key, None)
        elif value == "+32":
            raw[key] = base[key] + 32
        elif value == "kv":  # another divisor of the query heads
            raw[key] = next(k for k in (2, 1, 4) if k != base["num_key_value_heads"])
        elif value == "hd":
            raw[key] = head_dim // 2
        elif value == "longrope":
            raw[key] = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": ORIGINAL,
                        "short_factor": [1.0 + i / 8 for i in range(head_dim // 2)],
                        "long_factor": [2.0 + i for i in range(head_dim // 2)]}
        else:
            raw[key] = value
    return raw


def _requests() -> list[Request]:
    """Prompts below and above the window and the scaled ropes' original length, packed together,
    with nested shared prefixes; lengths stay below the dynamic case's 64 positions."""
    g = random.Random(5)
    head = [g.randrange(3, 250) for _ in range(18)]
    prompts = [head + [g.randrange(3, 250) for _ in range(k)] for k in (3, 9, 30)]
    prompts += [[7], [g.randrange(3, 250) for _ in range(40)], head[:6]]
    return [Request(i, p, SamplingParams(max_new_tokens=6)) for i, p in enumerate(prompts)]


def _reference(directory):
    try:
        return T.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                      attn_implementation="sdpa").eval()
    except Exception as e:  # noqa: BLE001 - transformers refusing it is an outcome of the sweep
        return e


def _run(model) -> dict:
    return {c.key: c.token_ids for c in Engine(model, eos_token_ids=EOS, min_shared_tokens=4,
                                               max_batch_tokens=96).run(_requests())}


CASES = _cases()


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_batchgen_equals_generate_or_refuses_in_one_line(case, tmp_path):
    name, family, base, edits, expected = CASES[case]
    config = CLASSES[family](**base)
    config.initializer_range = 0.3  # wide weights: greedy choices are no near-ties
    torch.manual_seed(case)
    T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_edit(json.loads(path.read_text()), base, edits)))

    reference = _reference(tmp_path)
    try:
        model, _ = load_model(str(tmp_path), "cpu", "float32")
    except ModelLoadError as e:
        assert "\n" not in str(e) and "Traceback" not in str(e), str(e)
        assert expected in ("refused", "any"), f"{name}: refused ({e}); transformers: {reference!r:.200}"
        return
    code = "decoder" if isinstance(model, Decoder) else "transformers"
    assert not isinstance(reference, Exception), f"{name}: batchgen ran what transformers refuses: {reference}"
    assert expected in (code, "any"), f"{name}: ran on {code}, expected {expected} " \
                                      f"({getattr(model, 'batchgen_decoder_declined', None)})"
    want = {r.key: reference_generate(reference, r, EOS) for r in _requests()}
    assert _run(model) == want, f"{name} on {code}"
    if code == "decoder":  # transformers' model code through the engine, packed the same way
        assert _run(load_model(str(tmp_path), "cpu", "float32", own_decoder=False)[0]) == want, f"{name}"
