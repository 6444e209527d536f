"""The float32 linear layers packed for batchgen's GEMM before torch is imported, and kept packed
on disk for the next run.

Why (BENCHMARKS.md, "Start-up"): a run's start is torch's import (about a second, holding the GIL
throughout), then the weights. Packing them into `cpu_gemm.c`'s panels takes the GEMM's own C
code and no torch, so `Prepack` starts it on a thread before torch is imported (ctypes lets go of
the GIL during a C call): it runs on the second core under torch's import. And most of packing's
cost was never the packing: it is the fresh memory it writes (a page fault per 4 KB, 0.4 of the
0.6 s on the project's VMs). So the packed layers go to a file in batchgen's cache, one per model
directory, and a later run maps that file: its pages are the page cache's, already there, and
the load is a `mmap`. A run that cannot write the file (no room, a read-only cache,
`BATCHGEN_PACKED_CACHE=0`) packs into memory as before, still under torch's import.

Only where the run is sure to load batchgen's own decoder on a CPU in float32, from float32
safetensors, with its GEMM: the decisions `load_model` takes later, taken early from the options
and the files alone. The device is the one guess (`auto` without torch: no GPU device node);
where a guess or the model turns out otherwise, the decoder packs its own. Either way every
layer is packed by the same C function from the same weights: the same bits. A cached file is
the model's as long as its files' sizes and times and the packing's format say so; it is written
under a temporary name and renamed, so a reader sees a whole file or none.

Imports no torch; the kernels' library is loaded with torch's own OpenMP runtime first
(`native_build.torch_openmp`), as it is when loaded after torch.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from batchgen.pipeline.model import native_build
from batchgen.pipeline.model.decoder_config import DecoderConfig, header
from batchgen.pipeline.model.files import cache_dir

FORMAT = 1  # the packed file's layout: `native_build.packed_size` floats a layer, each layer page-aligned
MAGIC = b"BGPACK01"
GEMM_SOURCE = Path(__file__).with_name("cpu_gemm.c")  # what packs them: part of a file's key
SPARE = 2 << 30  # bytes of disk the cache leaves free after writing a file
KEEP = 8 << 30  # bytes of packed files kept: the most recently used, and always the one just written


@dataclass
class Packed:
    """What a `Prepack` made: each key of `config.linears()` packed at (offset, floats) in `buffer`
    (a map of the cached file, or memory), for the model of `config` in float32."""

    config: DecoderConfig
    lib: object  # the kernels' library that packed it (ctypes.CDLL)
    buffer: mmap.mmap
    layers: dict[str, tuple[int, int]]
    cached: bool  # read from the cache (not packed by this run)


class Prepack:
    """Started before torch's import; `take` gives the decoder its layers packed, or None."""

    def __init__(self, name_or_path: str | None, device: str = "auto", dtype: str = "auto") -> None:
        self._future: Future | None = None
        try:
            config = _planned(name_or_path, device, dtype)
        except Exception:  # noqa: BLE001  (only a head start: `load_model` decides and reports)
            config = None
        if config is not None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="batchgen-pack")
            self._future = pool.submit(_packed, config)
            pool.shutdown(wait=False)  # the thread ends with its one task

    @property
    def started(self) -> bool:
        return self._future is not None

    def take(self, config: DecoderConfig, device_type: str, float32: bool) -> Packed | None:
        """The packed layers for a decoder of `config` on this device type, if they are that
        model's in float32 (else None: the decoder packs its own). Once: later calls give None."""
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            packed = future.result()
        except Exception:  # noqa: BLE001  (the decoder reads the files again and says what is wrong)
            return None
        if packed is None or device_type != "cpu" or not float32 or packed.config != config \
                or native_build._libs.get(_layout(config)) is not packed.lib:
            return None
        return packed

    def discard(self) -> None:
        """Waits until the packing thread is done and drops its work (a run that stops early
        leaves no thread behind)."""
        if self._future is not None:
            wait([self._future])
            self._future = None


def _layout(config: DecoderConfig) -> tuple[int, int]:
    return config.num_attention_heads // config.num_key_value_heads, config.head_dim


def _planned(name_or_path: str | None, device: str, dtype: str) -> DecoderConfig | None:
    """The model's config where the run is sure to pack it as this module does, else None."""
    from batchgen.pipeline.model import default_model
    from batchgen.pipeline.model.decoder_config import Refused, read
    from batchgen.pipeline.model.precision import NAMES, stored_dtype

    if "torch" in sys.modules or not native_build.gemm_enabled() or os.environ.get("BATCHGEN_DECODER", "1") == "0":
        return None  # torch's import is done (nothing to overlap) or the decoder's GEMM is off
    if device != "cpu" and (device != "auto" or sys.platform == "darwin"
                            or any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))):
        return None  # a GPU may run it
    try:
        directory = default_model.converted_path() if name_or_path is None else Path(name_or_path).expanduser()
        if directory is None or not (directory / "config.json").is_file():
            return None  # converted on first use, or a hub id: `load_model` finds it
        if NAMES.get(dtype) != "float32" and not (dtype == "auto" and stored_dtype(directory) == "float32"):
            return None
        config, _ = read(directory)
    except (OSError, ValueError, Refused):
        return None  # `load_model` reports it
    if config is None or not native_build.layout_ok(config.num_attention_heads, config.num_key_value_heads,
                                                     config.head_dim):
        return None
    return config


def _packed(config: DecoderConfig) -> Packed | None:
    """`config`'s layers packed: from the cache, else packed now (into the cache where it can
    take them); None where the files or this CPU do not allow it."""
    if not native_build.torch_openmp():
        return None
    lib = native_build._lib(*_layout(config))
    if lib is None or not lib.batchgen_gemm_ok() or not lib.batchgen_supports(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.head_dim, 0):
        return None
    tensors = _tensors(config)
    if tensors is None:
        return None
    key, path = _identity(config, tensors)
    cached = _open(path, key) if path is not None else None
    if cached is not None:
        return Packed(config, lib, *cached, cached=True)
    return _pack(config, lib, tensors, key, path)


def _tensors(config: DecoderConfig) -> dict[str, tuple[str, int, dict]] | None:
    """Each linear weight's (file, where its data starts, its header entry), where all are float32
    matrices lying within their files; else None."""
    out = {}
    for path in config.files:
        start, entries = header(path)
        out |= {name: (path, start, meta) for name, meta in entries.items()}
    for _, names, _ in config.linears():
        for name in names:
            path, start, meta = out.get(name, (None, 0, {}))
            shape, (lo, hi) = meta.get("shape", ()), meta.get("data_offsets", (0, 0))
            if meta.get("dtype") != "F32" or len(shape) != 2 or hi - lo != 4 * shape[0] * shape[1] \
                    or start + hi > os.path.getsize(path):
                return None  # `load_model` says what is wrong
    return out


def _identity(config: DecoderConfig, tensors: dict) -> tuple[str, Path | None]:
    """The packed weights' key (the format, the layers, each file's size and time) and their
    cache file, one per model directory (None: `BATCHGEN_PACKED_CACHE=0`)."""
    stats = [(os.path.realpath(p), st.st_size, st.st_mtime_ns) for p, st in ((p, os.stat(p)) for p in config.files)]
    plan = [(key, [(n, tensors[n][2]["shape"], tensors[n][2]["data_offsets"]) for n in names])
            for key, names, _ in config.linears()]
    code = hashlib.sha256(GEMM_SOURCE.read_bytes()).hexdigest()  # the packing code itself
    key = hashlib.sha256(json.dumps([FORMAT, native_build.GEMM_PANEL, code, stats, plan]).encode()).hexdigest()
    if os.environ.get("BATCHGEN_PACKED_CACHE", "1") == "0":
        return key, None
    place = hashlib.sha256(os.path.realpath(config.path).encode()).hexdigest()[:24]
    return key, cache_dir() / "packed" / f"{place}.bin"


def _open(path: Path, key: str) -> tuple[mmap.mmap, dict[str, tuple[int, int]]] | None:
    """The cached file's map and index, if it is whole and `key`'s; else None."""
    try:
        with open(path, "rb") as f:
            magic, length = struct.unpack("<8sQ", f.read(16))
            if magic != MAGIC or length > 1 << 24:
                return None
            index = json.loads(f.read(length))
            if index.get("key") != key or os.fstat(f.fileno()).st_size != index["size"]:
                return None
            # private: nothing writes to it, and torch takes a writable buffer without a warning
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            os.utime(path)  # used now: kept before files used longer ago (`_evict`)
        except OSError:
            pass  # a cache this run may not write to: read it all the same
        return buffer, {k: tuple(v) for k, v in index["layers"].items()}
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def _pack(config: DecoderConfig, lib, tensors: dict, key: str, path: Path | None) -> Packed:
    """Every layer packed (on one core: torch's import holds the other) into a new cache file,
    or into memory where the file cannot be written."""
    layers, at = {}, 0
    for name, names, _ in config.linears():
        n, k = sum(tensors[x][2]["shape"][0] for x in names), tensors[names[0]][2]["shape"][1]
        floats = native_build.packed_size(n, k)
        layers[name] = (at, floats)
        at += -(-4 * floats // mmap.PAGESIZE) * mmap.PAGESIZE
    index = json.dumps({"key": key, "layers": layers}).encode()
    head = -(-(16 + len(index) + 64) // mmap.PAGESIZE) * mmap.PAGESIZE  # the index, then the layers page-aligned
    layers = {name: (head + off, floats) for name, (off, floats) in layers.items()}
    index = json.dumps({"key": key, "layers": layers, "size": head + at}).encode()
    buffer, tmp = _new_file(path, head + at) if path is not None else (None, None)
    if buffer is None:
        buffer = mmap.mmap(-1, head + at)
    try:
        maps = {}
        for file in config.files:
            with open(file, "rb") as f:  # private: ctypes takes the address of a writable buffer only
                maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        bases = {file: native_build.address(m) for file, m in maps.items()}
        out = native_build.address(buffer)
        for name, names, _ in config.linears():
            parts = [(bases[tensors[x][0]] + tensors[x][1] + tensors[x][2]["data_offsets"][0],
                      *tensors[x][2]["shape"]) for x in names]
            native_build.pack_parts(lib, parts, parts[0][2], out + layers[name][0], 1)
        del maps
        buffer[:16 + len(index)] = struct.pack("<8sQ", MAGIC, len(index)) + index
        if tmp is not None:
            os.replace(tmp, path)  # the map stays the file's: the same inode under its name
            _evict(path)
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return Packed(config, lib, buffer, layers, cached=False)


def _new_file(path: Path, size: int) -> tuple[mmap.mmap | None, str | None]:
    """A writable shared map of a new temporary file of `size` bytes beside `path`, where the disk
    has room for it and `SPARE` more; else (None, None)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free < size + SPARE:
            return None, None
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError:
        return None, None
    try:
        os.posix_fallocate(fd, 0, size)  # the blocks now: a full disk fails here, not as SIGBUS in the map
        return mmap.mmap(fd, size), tmp
    except OSError:
        os.unlink(tmp)
        return None, None
    finally:
        os.close(fd)


def _evict(newest: Path) -> None:
    """Removes the packed files used longest ago until those left hold at most `KEEP` bytes
    (`newest` is kept whatever its size). A run that has one mapped keeps its pages."""
    files = []
    for f in newest.parent.glob("*.bin"):
        try:
            files.append((f.stat().st_mtime, f.stat().st_size, f))
        except OSError:
            pass  # removed meanwhile
    total = sum(size for _, size, _ in files)
    for _, size, f in sorted(files):
        if total <= KEEP:
            break
        if f != newest:
            f.unlink(missing_ok=True)
            total -= size
