"""CPU kernel choices: threads from the cores really available, oneDNN linears that equal F.linear."""
import os

import pytest
import torch

from pipeline import kernels
from tiny_models import make_model


def test_a_cgroup_quota_caps_the_threads(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    assert kernels._cgroup_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert kernels._cgroup_quota(str(tmp_path)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert kernels._cgroup_quota(str(v1)) == 3.0
    monkeypatch.setattr(kernels, "_cgroup_quota", lambda: 1.5)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert kernels.available_cpus() == 2  # a quota of 1.5 CPUs rounds up to 2 threads


def test_threads_follow_omp_num_threads_then_the_available_cores(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert kernels.set_threads() == 1 == torch.get_num_threads()
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(kernels, "available_cpus", lambda: 2)
        assert kernels.set_threads() == 2
        assert kernels.set_threads(1) == 1
    finally:
        torch.set_num_threads(before)


def test_onednn_linears_equal_f_linear_and_are_put_back():
    model = make_model("llama")
    layers = kernels.fast_linears(model)
    if not kernels.onednn_ok():
        pytest.skip("oneDNN's linear is not available in this torch build")
    assert layers and all(type(m) is torch.nn.Linear for m in layers)
    x = torch.randn(3, 5, 64)
    want = [m(x if m.in_features == 64 else torch.randn(3, 5, m.in_features)) for m in layers[:1]]
    with kernels.linears_on_onednn(layers):
        assert "forward" in vars(layers[0])
        got = [layers[0](x)]
    assert "forward" not in vars(layers[0])  # the model's own forward again, for plain generate
    assert torch.allclose(got[0], want[0], atol=1e-5)
    assert kernels.fast_linears(make_model("llama", dtype=torch.bfloat16)) == []  # bfloat16 already goes to oneDNN


def test_freed_memory_stays_with_the_process():
    assert kernels.keep_freed_memory() in (True, False)  # False only where libc is not glibc
    x = torch.empty(8 << 20, dtype=torch.uint8)  # allocations still work after the thresholds move
    x.fill_(1)
    assert int(x.sum()) == 8 << 20
