"""pipeline/model/ahead.py: the model loaded on a worker thread while a run reads its jobs is the
model `load_model` loads, with `load_model`'s errors; models the own decoder does not take load on
the caller's thread; and a run refused before it takes the model leaves no loading thread."""
import json
import sys
import threading

import pytest
import torch

from batchgen.pipeline.errors import BatchgenError
from batchgen.pipeline.model.ahead import ModelAhead
from batchgen.pipeline.model.decoder import Decoder
from batchgen.pipeline.model.files import ModelLoadError
from batchgen.pipeline.model.kv import PrefixKV
from batchgen.pipeline.model.load import load_model
from batchgen.pipeline.model.step import Segment, build
from batchgen.pipeline.run.options import RunOptions
from batchgen.pipeline.run.runner import process
from tests.helpers.tiny_models import make_model


INTERVAL = sys.getswitchinterval()


@pytest.fixture(autouse=True)
def _interval_back():
    yield
    sys.setswitchinterval(INTERVAL)  # one failing test does not hide another's


def _loading_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("batchgen-load")]


def _logits(model, ids: list[int]) -> torch.Tensor:
    kv = PrefixKV(model.layer_shapes(), len(ids), torch.float32, torch.device("cpu"))
    step = build([], [], [(Segment(0, 0, kv.k, kv.v, 0, 0, 0), ids)], None, torch.device("cpu"))
    with torch.inference_mode():
        return model.forward(step, torch.arange(len(ids)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_loaded_ahead_is_load_models(dtype, tmp_path):
    make_model("llama").save_pretrained(tmp_path)
    ahead = ModelAhead(str(tmp_path), "cpu", dtype)
    assert ahead.ahead
    got, source = ahead.result()
    want, want_source = load_model(str(tmp_path), "cpu", dtype)
    assert isinstance(got, Decoder) and got.dtype == want.dtype and source == want_source
    ids = torch.randint(3, 250, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    assert torch.equal(_logits(got, ids), _logits(want, ids))
    assert sys.getswitchinterval() == INTERVAL and not _loading_threads()


@pytest.mark.parametrize("arch, decoder, device", [("gpt2", "1", "cpu"), ("llama", "0", "cpu"),
                                                   ("llama", "1", "no-such-device")])
def test_what_the_own_decoder_does_not_take_loads_when_asked(arch, decoder, device, tmp_path, monkeypatch):
    """transformers' model code, and a device load_model refuses: nothing starts early, and
    `result` gives (or raises) what load_model does, on the caller's thread."""
    monkeypatch.setenv("BATCHGEN_DECODER", decoder)
    make_model(arch).save_pretrained(tmp_path)
    ahead = ModelAhead(str(tmp_path), device, "float32")
    assert not ahead.ahead and not _loading_threads()
    if device != "cpu":
        with pytest.raises(BatchgenError, match="device"):
            ahead.result()
        return
    got = ahead.result()[0]
    assert not isinstance(got, Decoder) and type(got) is type(load_model(str(tmp_path), device, "float32")[0])


def test_a_loading_error_shows_when_the_model_is_taken(tmp_path):
    make_model("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 1000)
    ahead = ModelAhead(str(tmp_path), "cpu", "float32")  # the header still reads: it starts
    assert ahead.ahead
    with pytest.raises(ModelLoadError, match="damaged or truncated"):
        ahead.result()


@pytest.mark.parametrize("missing", [True, False])
def test_a_run_refused_while_the_model_loads_leaves_no_thread(missing, tmp_path, model_dir):
    """The jobs' file is not there (refused while it is read), or a row cannot run under
    `--on-error fail` (refused after): the run's error is the input's, and the loading thread has
    ended (and the switch interval is back) by the time it shows."""
    src = tmp_path / "jobs.jsonl"
    if not missing:
        src.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n{not json\n")
    with pytest.raises(BatchgenError, match="jobs.jsonl" if missing else "cannot run"):
        process([str(src)], str(tmp_path / "out.parquet"),
                RunOptions(model=str(model_dir), device="cpu", on_error="fail"))
    assert not _loading_threads() and sys.getswitchinterval() == INTERVAL
