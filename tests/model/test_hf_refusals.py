"""transformers' model code fails closed: a model type off the allow-list is refused in one line
from its config (what `validate` and `plan` read) and at load, with the way to run it anyway; the
attention interface and the probe forward at load refuse any attention argument batchgen does not
implement (attention sinks on an unverified model, a mask of the model's own, a missing
per-forward argument), so no model fails at its first real forward or runs without a knob.

Before issue 48 stablelm, falcon and nemotron loaded and then raised KeyError at the first
forward, and `interface` dropped arguments it did not know: those tests fail on that code.
"""
from __future__ import annotations

import pytest
import torch
import transformers as T

from batchgen.pipeline.model import hf, hf_support
from batchgen.pipeline.model.forward import EngineError
from batchgen.pipeline.model.hf import HFModel
from batchgen.pipeline.model.load import ModelLoadError, load_config, load_model
from tests.helpers import hf_families
from tests.helpers.tiny_models import model_from_config

REFUSED = sorted(hf_families.REFUSED)


def _saved(family: str, directory, **edits):
    config = hf_families.config(family, 0)
    for key, value in edits.items():
        setattr(config, key, value)
    model_from_config(config).save_pretrained(directory)
    return directory


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "Traceback" not in text, text
    return text


@pytest.mark.parametrize("family", REFUSED)
def test_an_unlisted_model_type_is_refused_from_its_config_and_at_load(family, tmp_path):
    d = _saved(family, tmp_path)
    model_type = T.AutoConfig.from_pretrained(d).model_type
    for load in (lambda: load_config(str(d)), lambda: load_model(str(d), "cpu", "float32")):
        with pytest.raises(ModelLoadError) as e:
            load()
        text = _one_line(e.value)
        assert f"model type {model_type!r} is not supported" in text and "--engine vllm" in text, text
        assert str(d) in text, text


def test_an_unverified_rope_type_or_layer_type_is_refused(tmp_path):
    config = hf_families.config("llama", 0)
    config.rope_parameters = {"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0}
    assert "rope type 'proportional' is not verified" in hf_support.problem(config)
    config = hf_families.config("olmo3", 0)
    config.layer_types = ["full_attention", "linear_attention"]
    assert "layer_types 'linear_attention'" in hf_support.problem(config)
    assert hf_support.problem(hf_families.config("olmo3", 0)) is None


@pytest.mark.parametrize("family", ["stablelm", "falcon", "nemotron"])
def test_the_probe_refuses_layers_that_drop_the_per_forward_argument(family, tmp_path, monkeypatch):
    """Were one of them on the list, the probe forward at load would still refuse it (before, the
    probe did not pass the argument and the first real forward raised KeyError)."""
    d = _saved(family, tmp_path)
    model_type = T.AutoConfig.from_pretrained(d).model_type
    monkeypatch.setattr(hf_support, "SUPPORTED", hf_support.SUPPORTED | {model_type})
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d), "cpu", "float32")
    assert "without the forward's keyword arguments" in _one_line(e.value)
    with pytest.raises(EngineError, match="without the forward's keyword arguments"):  # in memory, as the engine asks
        HFModel(model_from_config(hf_families.config(family, 0))).layer_shapes()


def test_the_probe_refuses_an_attention_argument_batchgen_does_not_implement():
    model = model_from_config(hf_families.config("llama", 0))

    def extra(module, args, kwargs):
        return args, {**kwargs, "temperature_scale": 2.0}

    handle = model.model.layers[1].self_attn.register_forward_pre_hook(extra, with_kwargs=True)
    with pytest.raises(EngineError, match="arguments batchgen does not implement: temperature_scale"):
        hf.layer_shapes(model)
    handle.remove()
    assert len(hf.layer_shapes(model)) == 2


class _Layer(torch.nn.Module):
    layer_idx = 0


def test_the_interface_refuses_what_it_would_otherwise_drop():
    q, k, v = torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8)
    step = object()
    with pytest.raises(EngineError, match="without the forward's keyword arguments"):
        hf.interface(_Layer(), q, k, v)
    with pytest.raises(EngineError, match="attention mask of its own"):  # ALiBi rides in the mask
        hf.interface(_Layer(), q, k, v, torch.zeros(1, 2, 3, 3), **{hf.KWARG: step})
    with pytest.raises(EngineError, match="do not implement|does not implement: cu_seq_lens_q"):
        hf.interface(_Layer(), q, k, v, cu_seq_lens_q=torch.zeros(2), **{hf.KWARG: step})
    with pytest.raises(EngineError, match="is_causal false"):
        hf.interface(_Layer(), q, k, v, is_causal=False, **{hf.KWARG: step})
    with pytest.raises(EngineError, match="dropout"):
        hf.interface(_Layer(), q, k, v, dropout=0.1, **{hf.KWARG: step})


class _OwnLlama(T.LlamaForCausalLM):
    """Stands in for a model's own code (`trust_remote_code`) under a listed model type."""


def test_a_listed_model_type_on_the_models_own_code_is_refused():
    config = hf_families.config("llama", 0)
    model = _OwnLlama(config).eval()
    with pytest.raises(EngineError, match="_OwnLlama comes from the model's own code"):
        HFModel(model)

    class OwnConfig(T.LlamaConfig):
        pass

    assert "OwnConfig comes from the model's own code" in hf_support.problem(OwnConfig(**config.to_dict()))


@pytest.mark.parametrize("family,says", [
    ("phimoe", "PhimoeAttention's attention mask has a window of 8 keys but its attention call passes "
               "sliding_window=None"),  # before issue 48: attended past its window, silently
    ("llama4_text", "Llama4TextAttention's attention mask is chunked"),
])
def test_the_probe_refuses_a_mask_batchgen_would_not_apply(family, says, monkeypatch):
    """The probe forward reads the rule each layer's mask would follow, and compares it with what
    batchgen applies: causal, windowed by the attention call's sliding_window."""
    model = model_from_config(hf_families.config(family, 0))
    if family == "llama4_text":
        model.config.attention_chunk_size = 4
        model.config.layer_types = ["chunked_attention", "full_attention"]
    monkeypatch.setattr(hf_support, "SUPPORTED", hf_support.SUPPORTED | {model.config.model_type})
    monkeypatch.setattr(hf_support, "KNOWN", {})
    with pytest.raises(EngineError, match=says):
        hf.layer_shapes(model)
