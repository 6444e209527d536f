"""pipeline/model/adapter_files.py: what `inspect_adapter` reads of a PEFT adapter, and everything it
refuses, each by name with the adapter's path (adapters made and saved by peft itself)."""
import json
import math
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from batchgen.pipeline.model.adapter_files import AdapterError, base_shape, inspect_adapter
from batchgen.pipeline.model.decoder_config import read
from tests.helpers.tiny_adapters import make_adapter
from tests.helpers.tiny_models import make_model


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


@pytest.fixture(scope="module")
def base(llama):
    return llama.config.to_dict()


def _edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_it_reads_rank_alpha_scaling_targets_and_digest(llama, base, tmp_path):
    a = make_adapter(llama, tmp_path / "a", rank=8, alpha=16, targets=("v_proj", "q_proj", "down_proj"))
    info = inspect_adapter(a, base)
    assert (info.rank, info.alpha, info.scaling, info.targets) == (8, 16.0, 2.0, ("q_proj", "v_proj", "down_proj"))
    assert info.path == str(a.absolute()) and len(info.digest) == 64
    r = make_adapter(llama, tmp_path / "r", rank=4, alpha=6, rslora=True)
    assert inspect_adapter(r, base).scaling == 6 / math.sqrt(4) and inspect_adapter(r, base).targets == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # the digest follows the bytes: another adapter, or the same config with other weights, differs
    other = make_adapter(llama, tmp_path / "o", rank=8, alpha=16, targets=("v_proj", "q_proj", "down_proj"), seed=1)
    assert inspect_adapter(other, base).digest != info.digest
    assert inspect_adapter(a, base).digest == info.digest


def test_every_base_config_form_gives_the_same_shapes(llama, base, tmp_path):
    """A config dict, transformers' config and the decoder's `DecoderConfig` read alike."""
    llama.save_pretrained(tmp_path)
    config, why = read(tmp_path)
    assert why is None
    assert base_shape(base) == base_shape(llama.config) == base_shape(config)
    assert base_shape(base).shapes["k_proj"] == (64, 32) and base_shape(base).layers == 2


def test_importing_it_imports_no_torch():
    code = "import sys, batchgen.pipeline.model.adapter_files; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _refused(path, base, message):
    with pytest.raises(AdapterError) as e:
        inspect_adapter(path, base)
    text = str(e.value)
    assert str(path.absolute()) in text and message in text and "\n" not in text, text


def test_a_missing_path_or_file(llama, base, tmp_path):
    _refused(tmp_path / "nowhere", base, "no such directory")
    (tmp_path / "file").write_text("x")
    _refused(tmp_path / "file", base, "not a directory")
    a = make_adapter(llama, tmp_path / "a", rank=2)
    (a / "adapter_model.safetensors").unlink()
    _refused(a, base, "no adapter_model.safetensors")
    (a / "adapter_config.json").unlink()
    _refused(a, base, "cannot read adapter_config.json")
    (a / "adapter_config.json").write_text("{not json")
    _refused(a, base, "adapter_config.json is not JSON")


@pytest.mark.parametrize("changes, message", [
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not a LoRA adapter"),
    ({"use_dora": True}, "a DoRA adapter (use_dora)"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']"),
    ({"target_modules": ["embed_tokens", "q_proj"]}, "an embedding adapter (target module embed_tokens)"),
    ({"target_modules": ["lm_head"]}, "an lm_head adapter (target module lm_head)"),
    ({"target_modules": ["q_proj", "fc1"]}, "target module 'fc1'"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern (a rank or alpha per module)"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
    ({"bias": "lora_only"}, "trained biases (bias 'lora_only')"),
    ({"lora_bias": True}, "trained biases (lora_bias)"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights 'pissa'"),
    ({"alora_invocation_tokens": [5, 6]}, "sets alora_invocation_tokens"),
    ({"some_future_key": 3}, "sets some_future_key"),
    ({"r": 0}, "r 0 is not a positive integer"),
    ({"lora_alpha": "big"}, "lora_alpha 'big' is not a number"),
])
def test_what_the_config_may_not_say(llama, base, tmp_path, changes, message):
    a = make_adapter(llama, tmp_path / "a", rank=2, targets=("q_proj",))
    _edit_config(a, **changes)
    _refused(a, base, message)


@pytest.mark.parametrize("kind, message", [
    (dict(use_dora=True), "a DoRA adapter (use_dora)"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save ['lm_head']"),
    (dict(targets=("embed_tokens",)), "an embedding adapter"),
    (dict(targets=("lm_head",)), "an lm_head adapter"),
])
def test_what_peft_writes_for_unsupported_kinds(llama, base, tmp_path, kind, message):
    """As peft saves them, not edited by hand."""
    _refused(make_adapter(llama, tmp_path / "a", rank=2, **kind), base, message)


@pytest.mark.parametrize("tensor, message", [
    ("base_model.model.model.embed_tokens.lora_embedding_A", "an embedding adapter"),
    ("base_model.model.lm_head.lora_A.weight", "an lm_head adapter"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "a DoRA magnitude"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", "a trained bias"),
    ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", "LoRA on module mlp.q_proj"),
])
def test_tensors_it_does_not_apply(llama, base, tmp_path, tensor, message):
    """Tensors decide (a regex `target_modules` names nothing): each foreign one is refused by name."""
    a = make_adapter(llama, tmp_path / "a", rank=2, targets=("q_proj",))
    _edit_config(a, target_modules=".*q_proj")
    weights = load_file(a / "adapter_model.safetensors")
    weights[tensor] = weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].clone()
    save_file(weights, a / "adapter_model.safetensors", metadata={"format": "pt"})
    _refused(a, base, message)


def test_a_lone_lora_matrix(llama, base, tmp_path):
    a = make_adapter(llama, tmp_path / "a", rank=2, targets=("q_proj",))
    weights = load_file(a / "adapter_model.safetensors")
    del weights["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    save_file(weights, a / "adapter_model.safetensors", metadata={"format": "pt"})
    _refused(a, base, "lacks base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight")


@pytest.mark.parametrize("cut", [4, 100, -10])
def test_a_truncated_file(llama, base, tmp_path, cut):
    a = make_adapter(llama, tmp_path / "a", rank=8)
    path = a / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    _refused(a, base, "adapter_model.safetensors is truncated")


def test_a_rank_mismatch(llama, base, tmp_path):
    a = make_adapter(llama, tmp_path / "a", rank=8, targets=("k_proj",))
    _edit_config(a, r=4)
    _refused(a, base, "rank mismatch: tensor base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight "
                      "has shape [8, 64], but adapter_config.json states r 4")


@pytest.mark.parametrize("other, message", [
    (dict(hidden_size=32), "an adapter for another base model"),
    (dict(intermediate_size=96),
     "gate_proj.lora_B.weight has shape [96, 8], but the base model's gate_proj makes it [128, 8]"),
    (dict(num_key_value_heads=4), "the base model's k_proj makes it [32, 8]"),
    (dict(num_hidden_layers=3), "is for layer 2, but the base model has 2 layers"),
])
def test_an_adapter_for_another_base_model(base, tmp_path, other, message):
    import transformers as T

    from tests.helpers.tiny_models import COMMON, LLAMA_LIKE

    model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON, **(LLAMA_LIKE | other)))
    targets = ("gate_proj",) if "intermediate_size" in other else ("k_proj",) if "num_key_value_heads" in other \
        else ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    a = make_adapter(model, tmp_path / "a", rank=8, targets=targets)
    _refused(a, base, message)


def test_a_base_model_it_applies_no_adapters_to(llama, tmp_path):
    a = make_adapter(llama, tmp_path / "a", rank=2)
    _refused(a, make_model("gpt2").config, "the base model's config does not state intermediate_size")
