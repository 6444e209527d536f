"""CPU kernel choices (the measurements behind them are in BENCHMARKS.md):

- Threads: torch's default is the host's core count, and under foreign load oversubscription
  made runs several times slower. batchgen uses the cores this process may actually run on: its CPU
  affinity, capped by a cgroup CPU quota (containers, SLURM, Kubernetes).
- Freed memory stays with the process: glibc serves large allocations (above its mmap
  threshold) with mmap and returns them on free, so every forward's activations were fresh
  pages, faulted in and zeroed by the kernel, which made elementwise ops such as SiLU*mul and
  rotary embeddings several times slower. With glibc's mmap and trim thresholds raised,
  the same memory is reused forward after forward (as jemalloc/tcmalloc would).
- Linear layers: torch sends float32 `F.linear` to MKL's sgemm, which on an AMD CPU ran slower
  than oneDNN's kernel on the same weights, and both libraries reorder a plain weight into their
  blocked layout on every call. For batchgen's own forwards only, the model's `nn.Linear` layers
  call oneDNN on weights packed once (float32 and bfloat16), where a one-time probe finds it
  present and in agreement with `F.linear`: faster most of all at decode's few rows
  (`bench/bench_profile.py` prints the rates).
"""
from __future__ import annotations

import os
import weakref
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from batchgen.pipeline.model.cpus import available_cpus


def set_threads(threads: int | None = None) -> int:
    """Use `threads` intra-op threads, else one per available core (unless OMP_NUM_THREADS says)."""
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        # ASCII digits only: isdigit() also says yes to "²", which int() refuses
        threads = int(env) if env.isascii() and env.isdigit() and int(env) > 0 else available_cpus()
    torch.set_num_threads(threads)
    return threads


# ATen's elementwise transcendental ops (cos, sin, exp, log, ...) on a CPU split a tensor of more
# than this many elements across threads and call MKL's vector math on each part.
_ELEMENTWISE_GRAIN = 2048


def on_this_thread(op, x: torch.Tensor) -> torch.Tensor:
    """`op(x)` for an elementwise op, computed in parts small enough that ATen runs each on the
    calling thread. Why: the first call of MKL's vector math on one of torch's worker threads in a
    process sometimes comes out far less accurate than the high-accuracy mode ATen asks for (a
    race inside MKL, out of our reach); the calling thread's results are right, the same bits as
    a good parallel call (BENCHMARKS.md, "A wrong rotary table once in a few processes")."""
    if x.device.type != "cpu" or x.numel() <= _ELEMENTWISE_GRAIN:
        return op(x)
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    for a in range(0, flat.numel(), _ELEMENTWISE_GRAIN):
        out[a : a + _ELEMENTWISE_GRAIN] = op(flat[a : a + _ELEMENTWISE_GRAIN])
    return out.view(x.shape)


_VECTOR_MATH_WARM = False


def warm_vector_math() -> None:
    """Once per process, before the first forward on a CPU: ATen's MKL-backed elementwise ops
    (cos, sin, exp, log, float32 and float64) run once on every torch thread, the results dropped,
    so that no first call on a worker thread (`on_this_thread`) is one whose results are used;
    measured in BENCHMARKS.md. The rotary tables do not rely on it (`on_this_thread`); the PyTorch
    attention path's exp and log do."""
    global _VECTOR_MATH_WARM
    if _VECTOR_MATH_WARM:
        return
    _VECTOR_MATH_WARM = True
    n = 2 * _ELEMENTWISE_GRAIN * max(1, torch.get_num_threads())  # a part for every thread
    for dtype in (torch.float32, torch.float64):
        x = torch.linspace(-600.0, 600.0, n, dtype=dtype)
        for op in (torch.cos, torch.sin, torch.exp, torch.log):
            op(x)


_MALLOC_TUNED = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (1 GiB) for this process; False where that is not glibc."""
    global _MALLOC_TUNED
    if not _MALLOC_TUNED:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
            _MALLOC_TUNED = bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30))
        except (OSError, AttributeError):
            _MALLOC_TUNED = False
    return _MALLOC_TUNED


def _onednn_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered once into oneDNN's blocked layout (an opaque mkldnn tensor), so no
    call reorders it again; the row-count hint barely matters (measured over the engine's row counts)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


_PACKED: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple]" = weakref.WeakKeyDictionary()


def _packed_weight(m: torch.nn.Linear) -> torch.Tensor:
    """The layer's packed weight, made once per model (engines come and go: one per window, per
    lm-eval request batch), and made again if the weight was replaced or changed in place."""
    w = m.weight
    try:
        version = w._version
    except RuntimeError:  # an inference tensor keeps no version counter (and cannot be changed in place)
        version = -1
    stamp = (w.data_ptr(), version, w.dtype, tuple(w.shape))
    held = _PACKED.get(m)
    if held is None or held[0] != stamp:
        held = (stamp, _pack(w.detach()))
        _PACKED[m] = held
    return held[1]


def _packed_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return forward


_ONEDNN_OK: dict[tuple[torch.dtype, bool], bool] = {}


def onednn_ok(dtype: torch.dtype = torch.float32, packed: bool = False) -> bool:
    """oneDNN's linear (on packed weights, or plain ones) is present in this torch build and
    agrees with `F.linear` in `dtype`; checked once."""
    key = (dtype, packed)
    if key not in _ONEDNN_OK:
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((2, 37, 96), (80, 96), (80,)))
            want = F.linear(x.float(), w.float(), b.float())
            if packed:
                got = _packed_linear(_pack(w), b)(x)
            else:
                lin = torch.nn.Linear(96, 80, dtype=dtype)
                lin.weight.data, lin.bias.data = w, b
                got = _onednn_linear(lin, x)
            tol = 1e-4 if dtype == torch.float32 else 0.1
            _ONEDNN_OK[key] = got.dtype == dtype and bool(torch.allclose(got.float(), want, atol=tol, rtol=0.02))
        except (RuntimeError, AttributeError, NotImplementedError):
            _ONEDNN_OK[key] = False
    return _ONEDNN_OK[key]


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


PACK_SHARE = 4  # packed copies may take at most a quarter of the memory available when the engine starts


def _cpu_dtype_ok(model: torch.nn.Module) -> torch.dtype | None:
    p = next(model.parameters(), None)
    return p.dtype if p is not None and p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16) else None


def _linears(model: torch.nn.Module, dtype: torch.dtype) -> list[torch.nn.Linear]:
    """The model's `nn.Linear` layers on the CPU in `dtype` (not, say, an offloaded or upcast one)."""
    return [m for m in model.modules()
            if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == dtype]


def pack_in_place(model: torch.nn.Module) -> int:
    """For a model batchgen loaded and owns (`batchgen.pipeline.model.load.load_model`): each linear layer's weight
    is replaced by its packed oneDNN copy, the plain one freed, and the layer's forward calls
    oneDNN for good, as IPEX's `optimize` does: the speed of packing at no extra memory once loaded
    (while it packs, the checkpoint's pages and the packed copies are both held, so it packs only
    where twice the weights fit in the available memory). The other weights are copied out of the
    checkpoint's memory map, so the map is released. The model still runs forward and `generate`;
    it is not for training, saving or moving to another device. A weight another module shares (a
    tied output head, which the embedding reads) stays plain. Returns the layers packed."""
    dtype = _cpu_dtype_ok(model)
    if dtype is None or not onednn_ok(dtype, packed=True):
        return 0
    holders = Counter(id(t) for m in model.modules() for t in m._parameters.values() if t is not None)
    todo = [m for m in _linears(model, dtype) if not m.weight.is_mkldnn and holders[id(m.weight)] == 1]
    free = _available_memory()
    if free is not None and 2 * sum(m.weight.nbytes for m in todo) > free:
        return 0  # while packing, the packed copies and the checkpoint's pages are both held
    for m in todo:
        m.weight = torch.nn.Parameter(_pack(m.weight.detach()), requires_grad=False)
        m.forward = _packed_linear(m.weight, m.bias)
    if todo:  # the rest leave the checkpoint's memory map too, so the map (all of the plain weights) goes
        for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
            if not t.is_mkldnn:
                t.data = t.data.clone()
    return len(todo)


def fast_linears(model: torch.nn.Module, pack: bool | None = None) -> list[tuple[torch.nn.Linear, object]]:
    """The model's plain linear layers that call oneDNN in batchgen's forwards, each with its forward
    (layers `pack_in_place` packed call it always, and are not listed).

    On a CPU in float32 or bfloat16, each weight is packed once into oneDNN's blocked layout
    (faster, most of all at decode's few rows: BENCHMARKS.md). For a model the user
    passed in, the packed copies sit beside its own weights (which its plain forward and tied
    embeddings keep using), so they are made only where they fit in a quarter of the available
    memory (`pack=None`), or as `pack` says; never beside a model packed in place, whose leftover
    plain layer is a tied head. Without packing, float32 layers still call oneDNN on their plain
    weights (MKL's sgemm is slower on AMD CPUs) and bfloat16 ones keep `F.linear`, which
    already goes to oneDNN. None off CPU, or where the probe fails."""
    dtype = _cpu_dtype_ok(model)
    if dtype is None:
        return []
    linears = _linears(model, dtype)
    layers = [m for m in linears if not m.weight.is_mkldnn]
    if pack is None:
        need, free = sum(m.weight.nbytes for m in layers), _available_memory()
        pack = len(layers) == len(linears) and (free is None or need * PACK_SHARE <= free)
    if pack and onednn_ok(dtype, packed=True):
        return [(m, _packed_linear(_packed_weight(m), m.bias)) for m in layers]
    if dtype == torch.float32 and onednn_ok():
        return [(m, _onednn_linear.__get__(m)) for m in layers]
    return []


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `linear` packs weights of this device and dtype (a copy) or uses them as they are."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn_ok(dtype, packed=True)


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """A linear layer's forward for batchgen's own decoder (`batchgen.pipeline.model.decoder`), which owns its
    weights, where batchgen's own GEMM does not serve it (`native.gemm`: float32 on AVX-512): on a
    CPU in float32 or bfloat16, oneDNN on the weight packed once (where the probe passes);
    elsewhere `F.linear`."""
    if packs(weight.device, weight.dtype):
        return _packed_linear(_pack(weight), bias)
    return lambda x: F.linear(x, weight, bias)


@contextmanager
def linears_on_onednn(layers: list[tuple[torch.nn.Linear, object]]) -> Iterator[None]:
    """For one forward: each layer's `forward` is its oneDNN one (an instance attribute over the class's)."""
    for m, forward in layers:
        m.forward = forward
    try:
        yield
    finally:
        for m, _ in layers:
            del m.forward
