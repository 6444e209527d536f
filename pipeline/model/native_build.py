"""Building and loading batchgen's compiled kernels (`cpu_attention.c` and the files it includes),
without torch: `batchgen.pipeline.model.native` wraps them for torch tensors; `batchgen.pipeline.model.prepack` packs
weights with them before torch is imported.

Built on first use with the machine's C compiler (`$CC`, else `cc`), one small library per head
layout (query heads per key head, head size: a model has one), into batchgen's cache, keyed by
the source, the flags, the layout and the CPU's instruction set (`-march=native`: a cache shared
by machines of different CPUs gets one library per CPU); loaded with ctypes. Plain C with no
Python or torch headers compiles in well under a second, where a torch extension takes a minute.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from batchgen.pipeline.model.files import cache_dir

SOURCE = Path(__file__).with_name("cpu_attention.c")
# #included by SOURCE: part of the cache key too
INCLUDED = [Path(__file__).with_name(n) for n in ("cpu_vectors.c", "cpu_threads.c", "cpu_tiles.c", "cpu_decode.c",
                                                  "cpu_anchors.c", "cpu_amx_anchors.c", "cpu_prefill.c", "cpu_bf16.c",
                                                  "cpu_amx_prefill.c", "cpu_layer_ops.c", "cpu_step_ops.c", "cpu_gemm.c")]
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-pthread"]
# -fopenmp: the kernel's threads are torch's (the loader shares the libgomp.so.1 torch has loaded),
# which still spin after torch's last op; new pthreads would fight them for the cores (slower:
# BENCHMARKS.md). A compiler without OpenMP builds the pthreads version.
THREADING = (["-fopenmp"], ["-fopenmp-simd"])
MAX_FOLD, MAX_HEAD = 8, 128

_libs: dict[tuple[int, int], ctypes.CDLL | None] = {}
_errors: dict[tuple[int, int], str] = {}
_building = threading.Lock()  # a layout's library is built and loaded once (the packing thread asks too)


def enabled() -> bool:
    """`BATCHGEN_NATIVE=0` runs PyTorch's kernels everywhere (the reference path)."""
    return os.environ.get("BATCHGEN_NATIVE", "1") != "0"


def gemm_enabled() -> bool:
    """`BATCHGEN_GEMM=0` runs the float32 linear layers on oneDNN's GEMM instead of batchgen's."""
    return enabled() and os.environ.get("BATCHGEN_GEMM", "1") != "0"


def layout_ok(hq: int, hkv: int, d: int) -> bool:
    """Whether the kernels are built for this head layout (1-8 query heads per key head, head size
    16-128 in steps of 16)."""
    return hkv >= 1 and hq % hkv == 0 and 1 <= hq // hkv <= MAX_FOLD and d % 16 == 0 and 16 <= d <= MAX_HEAD


def _cpu_key() -> str:
    """The CPU's feature flags (what -march=native compiles for), else its name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(fold: int, head: int) -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    layout = [f"-DBATCHGEN_G={fold}", f"-DBATCHGEN_D={head}"]
    source = b"".join(p.read_bytes() for p in [SOURCE, *INCLUDED])
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, *layout, _cpu_key()]).encode())
    target = cache_dir() / "native" / f"cpu_attention-g{fold}-d{head}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # another process may build it too
        os.close(fd)
        try:
            for i, threading in enumerate(THREADING):
                try:
                    subprocess.run([compiler, *FLAGS, *threading, *layout, "-o", tmp, str(SOURCE)], check=True,
                                   capture_output=True, timeout=120)
                    break
                except subprocess.CalledProcessError:
                    if i == len(THREADING) - 1:
                        raise
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return declare(ctypes.CDLL(str(target)))


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The library's entry points with their C signatures (also for a build of another revision's
    sources, bench_kernel_turns', which may lack the newer ones): ctypes would pass the 64-bit
    arguments as ints and crash."""
    i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    for name, args in (("batchgen_decode_attention", [i32] * 5 + [ptr, i64, i64, ptr, ptr, i64] + [ptr] * 5
                        + [f32, ptr, i32, i32, i32]),
                       ("batchgen_prefill_attention", [i32] * 5 + [ptr, i64, i64] + [ptr] * 10 + [f32, ptr] + [i32] * 3),
                       ("batchgen_supports", [i32] * 5), ("batchgen_amx", []), ("batchgen_bf16_dots", [i32]),
                       ("batchgen_add_rms_norm", [i64, i64, i32, ptr, ptr, ptr, f32, ptr, i32]),
                       ("batchgen_silu_mul", [i64, i64, i32, ptr, ptr, i64, i32]),
                       ("batchgen_rotary", [i64, i64, i64, i32, ptr, i64, i64, ptr, ptr, i32]),
                       ("batchgen_greedy", [i64, i64, ptr, ptr, ptr, i32]),
                       ("batchgen_layer_ops", []),
                       ("batchgen_store_rows", [i64, i64, i64, i32, ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64,
                                                i64, ptr, ptr, ptr, i32]),
                       ("batchgen_gemm_ok", []),
                       ("batchgen_gemm_pack_parts", [i64, ptr, ptr, ptr, i64, ptr, i32]),
                       ("batchgen_gemm", [i64, i64, i64, ptr, i64, ptr, ptr, ptr, i32]),
                       ("batchgen_gemm_glu", [i64, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i32])):
        f = getattr(lib, name, None)
        if f is not None:
            f.argtypes = args
            f.restype = i32
    return lib


def build_error() -> str | None:
    """Why a layout's library could not be built in this process (the first one that failed), or None:
    where it could not, their work ran on PyTorch's kernels instead, slower, and a run says so."""
    return next(iter(_errors.values()), None)


def _lib(fold: int, head: int) -> ctypes.CDLL | None:
    """The library for this layout, built on the first call; None if it cannot be built."""
    key = (fold, head)
    if key not in _libs:
        with _building:
            if key not in _libs:
                try:
                    _libs[key] = _build(fold, head)
                except (OSError, subprocess.SubprocessError) as e:
                    _libs[key] = None
                    stderr = getattr(e, "stderr", b"") or b""
                    _errors[key] = f"{e} {stderr.decode(errors='replace')[-500:]}".strip()
    return _libs[key]


GEMM_PANEL = 48  # outputs per panel of a weight packed for `cpu_gemm.c` (its GEMM_NR)


def packed_size(n: int, k: int) -> int:
    """Floats of an (n, k) weight packed for `cpu_gemm.c`: whole panels of 48 outputs."""
    return -(-n // GEMM_PANEL) * GEMM_PANEL * k


def address(buffer) -> int:
    """Where a writable buffer's memory starts (a map's stays there while the map lives)."""
    anchor = ctypes.c_char.from_buffer(buffer)
    at = ctypes.addressof(anchor)
    del anchor  # releases the buffer's export: a map may close later
    return at


def pack_parts(lib: ctypes.CDLL, parts: list[tuple[int, int, int]], k: int, out: int, threads: int) -> None:
    """A weight stacked by output from `parts` ((address, rows, row stride in floats) each, k floats
    a row) packed at address `out` for `cpu_gemm.c` (ceil(rows / 48) * 48 * k floats)."""
    n = len(parts)
    addresses = (ctypes.c_void_p * n)(*(a for a, _, _ in parts))
    rows, strides = (ctypes.c_int64 * n)(*(r for _, r, _ in parts)), (ctypes.c_int64 * n)(*(s for _, _, s in parts))
    if lib.batchgen_gemm_pack_parts(n, addresses, rows, strides, k, out, threads):
        raise MemoryError("batchgen's linear kernel got no scratch memory")


def torch_openmp() -> bool:
    """Before torch is imported: loads the OpenMP runtime torch's own libraries load (the
    `libgomp.so.1` its wheel carries), so that a library of these kernels loaded now shares it
    with torch, as one loaded after torch does (one runtime, one pool of threads). False where
    that runtime is not found (another build of torch, none installed): then load nothing now."""
    if "torch" in sys.modules:
        return True
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    gomp = Path(list(spec.submodule_search_locations)[0]) / "lib" / "libgomp.so.1"
    if not gomp.is_file():
        return False
    try:
        ctypes.CDLL(str(gomp), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    return True
