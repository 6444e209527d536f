"""pipeline/model/prepack.py: the float32 layers packed before torch's import, and their file in
the cache, give the decoder the bits it packs itself; a file that is not the model's as it is now
(other weights, truncated, damaged) is not used; without room or with the cache off they pack in
memory; what the decoder cannot take (another dtype or device) it packs itself."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.pipeline.model import native, prepack
from batchgen.pipeline.model.decoder import Decoder
from batchgen.pipeline.model.decoder_config import read
from batchgen.pipeline.model.kv import PrefixKV
from batchgen.pipeline.model.step import Segment, build
from tests.helpers.tiny_models import make_model

needs_gemm = pytest.mark.skipif(native.gemm(torch.float32, 4, 2, 16) is None,
                                reason="batchgen's GEMM needs AVX-512 and a C compiler")
pytestmark = needs_gemm


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))


def _model(directory, arch="llama", seed=0):
    make_model(arch, seed=seed).save_pretrained(directory)
    return read(directory)[0]


def _logits(dec: Decoder, ids: list[int]) -> torch.Tensor:
    kv = PrefixKV(dec.layer_shapes(), len(ids), torch.float32, torch.device("cpu"))
    step = build([], [], [(Segment(0, 0, kv.k, kv.v, 0, 0, 0), ids)], None, torch.device("cpu"))
    with torch.inference_mode():
        return dec.forward(step, torch.arange(len(ids)))


def _decoder(config, packed: prepack.Packed | None) -> Decoder:
    tensors = {k: torch.frombuffer(packed.buffer, dtype=torch.float32, count=n, offset=at)
               for k, (at, n) in packed.layers.items()} if packed is not None else None
    return Decoder(config, torch.device("cpu"), torch.float32, packed=tensors)


IDS = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama_bias"])
def test_packed_ahead_and_cached_are_the_decoders_own_bits(arch, tmp_path):
    """Packed by this module (the first run), then read from its file (the next): every layer
    taken packed, and every logit the same bits as the decoder packing its own."""
    config = _model(tmp_path / "m", arch)
    want = _logits(_decoder(config, None), IDS)
    first = prepack._packed(config)
    assert first is not None and not first.cached
    assert len(list((tmp_path / "cache" / "packed").glob("*.bin"))) == 1
    again = prepack._packed(config)
    assert again is not None and again.cached
    for packed in (first, again):
        dec = _decoder(config, packed)
        assert dec.prepacked == len(config.linears())
        assert torch.equal(_logits(dec, IDS), want)


def test_a_file_that_is_not_the_models_now_is_packed_again(tmp_path):
    """New weights in the same directory, and a file cut short or overwritten: packed again
    from the checkpoint, never read from the stale or broken file."""
    directory = tmp_path / "m"
    config = _model(directory)
    assert not prepack._packed(config).cached
    [cached] = (tmp_path / "cache" / "packed").glob("*.bin")
    _model(directory, seed=1)  # other weights, same shapes
    config = read(directory)[0]
    got = prepack._packed(config)
    assert not got.cached and torch.equal(_logits(_decoder(config, got), IDS), _logits(_decoder(config, None), IDS))
    assert prepack._packed(config).cached
    for damage in ("truncate", "magic"):
        data = cached.read_bytes()
        cached.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"XXXXXXXX" + data[8:])
        got = prepack._packed(config)
        assert not got.cached and torch.equal(_logits(_decoder(config, got), IDS), _logits(_decoder(config, None), IDS))


@pytest.mark.parametrize("why", ["off", "no room"])
def test_without_the_cache_it_packs_in_memory(why, tmp_path, monkeypatch):
    config = _model(tmp_path / "m")
    if why == "off":
        monkeypatch.setenv("BATCHGEN_PACKED_CACHE", "0")
    else:
        monkeypatch.setattr(prepack, "SPARE", 1 << 60)
    for _ in range(2):
        got = prepack._packed(config)
        assert not got.cached and torch.equal(_logits(_decoder(config, got), IDS), _logits(_decoder(config, None), IDS))
    assert not list((tmp_path / "cache").rglob("*.bin"))


def test_older_files_go_past_the_cap(tmp_path, monkeypatch):
    """Packed files of other model directories are removed, used longest ago first, once the
    cache holds more than its cap; the one just written stays."""
    monkeypatch.setattr(prepack, "KEEP", 1)
    for i in range(3):
        prepack._packed(_model(tmp_path / f"m{i}", seed=i))
    assert len(list((tmp_path / "cache" / "packed").glob("*.bin"))) == 1
    assert prepack._packed(read(tmp_path / "m2")[0]).cached


def test_what_the_decoder_would_not_take(tmp_path):
    """A bfloat16 checkpoint, another device or dtype, another model: nothing is taken."""
    make_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert prepack._packed(read(tmp_path / "bf16")[0]) is None  # its weights are not float32
    config, other = _model(tmp_path / "m"), _model(tmp_path / "o", "qwen2")

    class Done:  # a finished packing thread
        def __init__(self, value):
            self.value = value

        def result(self):
            return self.value

    for device, float32, cfg in (("cuda", True, config), ("cpu", False, config), ("cpu", True, other),
                                 ("cpu", True, config)):
        p = prepack.Prepack.__new__(prepack.Prepack)
        p._future = Done(prepack._packed(config))
        got = p.take(cfg, device, float32)
        assert (got is not None) == (device == "cpu" and float32 and cfg is config)
        assert p.take(cfg, device, float32) is None  # once


def test_it_starts_only_where_the_run_packs_as_it_does(tmp_path, monkeypatch):
    """The decisions taken before torch is imported: a CPU (or `auto` without a GPU), float32 (asked,
    or `auto` over float32 weights), batchgen's decoder and GEMM on; in a process that has not
    imported torch (here it has: `_planned` is asked as that process would ask)."""
    _model(tmp_path / "m")
    monkeypatch.delitem(sys.modules, "torch")
    try:
        plan = lambda device="cpu", dtype="auto": prepack._planned(str(tmp_path / "m"), device, dtype)  # noqa: E731
        assert plan() is not None and plan("cpu", "float32") is not None
        assert plan("cuda") is None and plan("cpu", "bfloat16") is None
        for env in ("BATCHGEN_DECODER", "BATCHGEN_GEMM", "BATCHGEN_NATIVE"):
            monkeypatch.setenv(env, "0")
            assert plan() is None
            monkeypatch.delenv(env)
    finally:
        sys.modules["torch"] = torch
    assert prepack._planned(str(tmp_path / "m"), "cpu", "auto") is None  # torch imported: nothing to overlap


@pytest.mark.slow
def test_it_packs_without_importing_torch(tmp_path, model_dir):
    """In a fresh process the packing runs to its end with torch never imported (so it overlaps
    torch's import); `batchgen process` runs pack ahead, then read the file, with the output of a
    run with the cache off, whose decoder packs its own at load."""
    import pyarrow.parquet as pq

    code = f"""if True:
        import sys
        from batchgen.pipeline.model.prepack import Prepack
        p = Prepack({str(model_dir)!r}, "auto", "auto")
        assert p.started
        packed = p._future.result()
        assert packed is not None and "torch" not in sys.modules
        print("ok")"""
    env = {**os.environ, "BATCHGEN_CACHE_DIR": str(tmp_path / "cache0")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    src = tmp_path / "jobs.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"one shared start of a prompt, then {i}"}) + "\n" for i in range(3)))
    outputs = []
    for run, (cache, want) in enumerate((("1", "ahead"), ("1", "cache"), ("0", "ahead"))):
        out = tmp_path / f"out{run}.parquet"
        env = {**os.environ, "BATCHGEN_CACHE_DIR": str(tmp_path / "cache"), "BATCHGEN_PACKED_CACHE": cache}
        proc = subprocess.run([sys.executable, "-m", "batchgen", "process", str(src), "-o", str(out), "--model",
                               str(model_dir), "--max-new-tokens", "6", "--device", "cpu"],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(out.with_name(out.name + ".summary.json").read_text())["packed_weights"] == want
        outputs.append(pq.read_table(out).to_pylist())
    env = {**os.environ, "BATCHGEN_CACHE_DIR": str(tmp_path / "cache"), "BATCHGEN_GEMM": "0"}
    out = tmp_path / "oneDNN.parquet"
    proc = subprocess.run([sys.executable, "-m", "batchgen", "process", str(src), "-o", str(out), "--model",
                           str(model_dir), "--max-new-tokens", "6", "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and json.loads(out.with_name(out.name + ".summary.json").read_text())["packed_weights"] is None
    assert outputs[0] == outputs[1] == outputs[2]
