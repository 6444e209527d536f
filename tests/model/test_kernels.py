"""CPU kernel choices: threads from the cores really available, oneDNN linears that equal F.linear."""
import os

import pytest
import torch

from batchgen.pipeline.model import cpus, kernels
from tests.helpers.tiny_models import make_model


def test_a_cgroup_quota_caps_the_threads(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    assert cpus._cgroup_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpus._cgroup_quota(str(tmp_path)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cpus._cgroup_quota(str(v1)) == 3.0
    monkeypatch.setattr(cpus, "_cgroup_quota", lambda: 1.5)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpus.available_cpus() == 2  # a quota of 1.5 CPUs rounds up to 2 threads


def test_threads_follow_omp_num_threads_then_the_available_cores(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert kernels.set_threads() == 1 == torch.get_num_threads()
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(kernels, "available_cpus", lambda: 2)
        assert kernels.set_threads() == 2
        assert kernels.set_threads(1) == 1
        for junk in ("²", "٣", "0", "x"):  # isdigit() says yes to the first two; no thread count either way
            monkeypatch.setenv("OMP_NUM_THREADS", junk)
            assert kernels.set_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype,pack", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_onednn_linears_equal_f_linear_and_are_put_back(dtype, pack):
    model = make_model("qwen2", dtype=dtype)  # q/k/v projections with a bias, the rest without
    if not kernels.onednn_ok(dtype, packed=pack):
        pytest.skip("oneDNN's linear is not available in this torch build")
    layers = kernels.fast_linears(model, pack=pack)
    assert layers and all(type(m) is torch.nn.Linear for m, _ in layers)
    assert any(m.bias is not None for m, _ in layers) and any(m.bias is None for m, _ in layers)
    xs = [torch.randn(3, 5, m.in_features, dtype=dtype) for m, _ in layers]
    want = [m(x).float() for (m, _), x in zip(layers, xs)]
    with kernels.linears_on_onednn(layers):
        assert all("forward" in vars(m) for m, _ in layers)
        got = [m(x) for (m, _), x in zip(layers, xs)]
    assert all("forward" not in vars(m) for m, _ in layers)  # the model's own forward again, for plain generate
    tol = 1e-4 if dtype == torch.float32 else 0.05
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w, atol=tol, rtol=0.02)


def test_packed_weights_are_made_once_and_again_when_the_weight_changes():
    model = make_model("llama")
    if not kernels.onednn_ok(torch.float32, packed=True):
        pytest.skip("oneDNN's linear is not available in this torch build")
    lin = next(m for m in model.modules() if type(m) is torch.nn.Linear)
    first = kernels._packed_weight(lin)
    assert kernels._packed_weight(lin) is first  # a second engine on the same model reuses it
    x = torch.randn(4, lin.in_features)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # changed in place: the packed copy must follow
    again = kernels._packed_weight(lin)
    assert again is not first
    got = kernels._packed_linear(again, lin.bias)(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-4)


def test_no_packing_where_memory_is_short_and_none_off_cpu_dtypes(monkeypatch):
    model = make_model("llama")
    monkeypatch.setattr(kernels, "_available_memory", lambda: 1024)  # far less than the weights
    layers = kernels.fast_linears(model)
    if kernels.onednn_ok():  # float32 still goes to oneDNN, on the plain weights
        assert layers and all(f.__func__ is kernels._onednn_linear for _, f in layers)
    assert kernels.fast_linears(make_model("llama", dtype=torch.bfloat16)) == []  # F.linear is oneDNN's already
    assert kernels.fast_linears(make_model("llama", dtype=torch.float16)) == []
    model.lm_head.to(torch.bfloat16)  # a layer in another dtype than the model's keeps its own forward
    assert model.lm_head not in [m for m, _ in kernels.fast_linears(model, pack=True)]
    assert kernels.pack_in_place(model) == 0  # short of memory: no packing in place either
    monkeypatch.setattr(kernels, "_available_memory", lambda: None)
    assert kernels.pack_in_place(model) and not model.lm_head.weight.is_mkldnn


def test_freed_memory_stays_with_the_process():
    assert kernels.keep_freed_memory() in (True, False)  # False only where libc is not glibc
    x = torch.empty(8 << 20, dtype=torch.uint8)  # allocations still work after the thresholds move
    x.fill_(1)
    assert int(x.sum()) == 8 << 20


def test_packing_in_place_frees_the_plain_weights_and_keeps_the_model_running():
    model = make_model("llama")  # tied output head: it stays plain, for the embedding
    model.config.tie_word_embeddings = True
    model.tie_weights()
    if not kernels.onednn_ok(torch.float32, packed=True):
        pytest.skip("oneDNN's linear is not available in this torch build")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert kernels.pack_in_place(model) == len(linears) - 1
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_mkldnn
    assert all(m.weight.is_mkldnn for m in linears if m is not model.lm_head)
    assert kernels.pack_in_place(model) == 0  # once
    # the engine's per-forward list leaves packed layers alone (their forward is theirs for good)
    # and makes no packed copy of the one plain layer left beside a model packed in place
    assert [m for m, _ in kernels.fast_linears(model)] == [model.lm_head]
    assert kernels.fast_linears(model)[0][1].__func__ is kernels._onednn_linear
    with torch.inference_mode():
        got = model(input_ids=ids).logits
        with kernels.linears_on_onednn(kernels.fast_linears(model)):
            model(input_ids=ids)
        assert all("forward" in vars(m) for m in linears if m is not model.lm_head)  # still packed after
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
