"""batchgen's compiled attention kernels for CPUs (`cpu_attention.c` and the files it includes):
decode tokens and runs of prefill tokens, each against its anchor and its own keys in one pass;
the decoder's norms and MLP gate in one pass each (`LayerOps`, `cpu_layer_ops.c`); and its float32
linear layers (`Gemm`, `cpu_gemm.c`).

Built on first use with the machine's C compiler and loaded with ctypes (`batchgen.pipeline.model.native_build`,
which needs no torch).

The attention kernels and the GEMM need AVX-512, or AVX2 with FMA (there with vectors of 8 floats:
tiles of half the lanes, the GEMM's the same bits); the layer ops need AVX-512 (elsewhere PyTorch's
ops run them). Decode reads each anchor as matrix products: in AVX-512 registers (with
AVX-512 BF16 dot products for bfloat16 where the CPU has them), or for bfloat16 on AMX tiles
where the CPU has them (Intel since Sapphire Rapids) and Linux lends them (`amx`). bfloat16 prefill
runs on AMX tiles there too (`cpu_amx_prefill.c`), else on AVX-512 BF16 dot products where the CPU
runs them fast (`bf16_dots`, `cpu_bf16.c`), else widened to float32 (`prefill_kernel`). Without AVX-512
or AVX2, without a compiler, for another layout or dtype, or with
``BATCHGEN_NATIVE=0``, `supports` is False and the engine reads decode attention through PyTorch's
kernels (`batchgen.pipeline.model.attention`): the same results, more slowly. `why_not` says which.
`batchgen.pipeline.model.attention.native_ok` checks both kernels against the reference once per layout.
"""
from __future__ import annotations

import ctypes
import os

import torch

from batchgen.pipeline.model.native_build import (FLAGS, INCLUDED, MAX_FOLD, MAX_HEAD, SOURCE, THREADING,  # noqa: F401
                                         _cpu_key, _errors, _lib, _libs, declare, enabled, gemm_enabled, layout_ok,
                                         pack_parts, packed_size)

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ANCHORS = {"tiles": 0, "matmul": 1, "matmul-avx512": 2}  # decode_attention's kernels for the anchors
# prefill_attention's kernels: "widen" is float32's wide tile (bfloat16 widened onto the 16-lane one),
# "dots" and "amx" bfloat16's, "tile16" the 16-lane tile for either (the reference the wide one matches bit for bit)
PREFILL = {"widen": 0, "dots": 1, "amx": 2, "tile16": 3}


def why_not(dtype: torch.dtype, hq: int, hkv: int, d: int, dv: int) -> str | None:
    """Why the kernel does not serve this layout, or None if it does."""
    if not enabled():
        return "BATCHGEN_NATIVE=0"
    if dtype not in DTYPES:
        return f"{dtype} (float32 and bfloat16 only)"
    if d != dv or not layout_ok(hq, hkv, d):
        return f"{hq} query heads over {hkv} key heads of size {d}/{dv} (1-{MAX_FOLD} per key head, 16-{MAX_HEAD} in steps of 16)"
    lib = _lib(hq // hkv, d)
    if lib is None:
        return f"it could not be built: {_errors[(hq // hkv, d)]}"
    if not lib.batchgen_supports(hq, hkv, d, dv, DTYPES[dtype]):
        return "this CPU has neither AVX-512 nor AVX2 with FMA"
    return None


def supports(dtype: torch.dtype, hq: int, hkv: int, d: int, dv: int) -> bool:
    """Whether the kernels serve this dtype and head layout on this machine (building them if need be)."""
    return why_not(dtype, hq, hkv, d, dv) is None


def _ints(*xs: torch.Tensor) -> list[int]:
    assert all(x.dtype == torch.long and x.is_contiguous() and x.device.type == "cpu" for x in xs)
    return [x.data_ptr() for x in xs]


def _lib_for(q: torch.Tensor, hkv: int) -> ctypes.CDLL | None:
    hq, d = q.shape[1], q.shape[2]
    return _lib(hq // hkv, d) if hkv and hq % hkv == 0 and q.dtype in DTYPES else None


def decode_attention(q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, slot: torch.Tensor,
                     own_len: torch.Tensor, anc_k: torch.Tensor, anc_v: torch.Tensor, anc_len: torch.Tensor,
                     scale: float, out: torch.Tensor, anchors: str = "matmul") -> bool:
    """One query per row, q (n, Hq, D) (last dim contiguous), over its anchor's keys (data pointers
    `anc_k`/`anc_v` (n,) of contiguous [1, Hkv, len, D] buffers, 0 for none; `anc_len` (n,)) then
    its slot's first `own_len` keys in own_k/own_v [slots, Hkv, cap, D]. Writes out (n, Hq, D),
    float32, or bfloat16 for bfloat16 q (rounded as `.to` rounds: the cast's pass saved). The
    int64 arrays are contiguous CPU tensors. False if the kernel could not run (a layout
    `supports` refuses; no scratch memory). `anchors` (`ANCHORS`): the anchors as matrix
    products, on AMX tiles where `amx` says (bfloat16), else in AVX-512 registers ("matmul"), or
    in AVX-512 registers always ("matmul-avx512"), or as the 16-row tiles prefill uses ("tiles",
    the kernel the matrix products replaced, kept for the tests and the benchmark)."""
    n, hq, d = q.shape
    _, hkv, cap, _ = own_v.shape
    assert q.stride(2) == 1 and own_k.is_contiguous() and own_v.is_contiguous() and out.is_contiguous()
    assert out.dtype in (torch.float32, q.dtype) and q.dtype == own_k.dtype == own_v.dtype and own_k.shape == own_v.shape
    assert all(x.numel() == n for x in (slot, own_len, anc_k, anc_v, anc_len))
    lib = _lib_for(q, hkv)
    return lib is not None and not lib.batchgen_decode_attention(
        n, hq, hkv, d, DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), own_k.data_ptr(),
        own_v.data_ptr(), cap, *_ints(slot, own_len, anc_k, anc_v, anc_len), scale, out.data_ptr(),
        torch.get_num_threads(), ANCHORS[anchors], int(out.dtype == torch.bfloat16))


def amx(dtype: torch.dtype, hq: int, hkv: int, d: int) -> bool:
    """Whether decode attention reads this layout's anchors through AMX tiles: bfloat16, a head size
    of a multiple of 32, a CPU with AMX (Intel since Sapphire Rapids) and Linux lending them."""
    return dtype == torch.bfloat16 and supports(dtype, hq, hkv, d, d) and bool(_lib(hq // hkv, d).batchgen_amx())


def bf16_dots(hq: int, hkv: int, d: int, fast_only: bool = True) -> bool:
    """Whether bfloat16 prefill runs on AVX-512 BF16 dot products for this layout (`cpu_bf16.c`), not
    widened on the float32 tile: on a CPU that has them and, with `fast_only`, runs them faster
    than it widens (AMD since Zen 4; not the Intel Xeon measured, BENCHMARKS.md)."""
    if not supports(torch.bfloat16, hq, hkv, d, d):
        return False
    return bool(_lib(hq // hkv, d).batchgen_bf16_dots(int(fast_only)))


def prefill_kernel(hq: int, hkv: int, d: int) -> str:
    """bfloat16 prefill's kernel for this layout (`PREFILL`): AMX tiles where `amx` says, else AVX-512 BF16
    dot products where `bf16_dots` says, else the float32 tile, the keys and values widened."""
    key = (hq, hkv, d)
    if key not in _prefill_kernels:
        _prefill_kernels[key] = "amx" if amx(torch.bfloat16, hq, hkv, d) else "dots" if bf16_dots(hq, hkv, d) else "widen"
    return _prefill_kernels[key]


_prefill_kernels: dict[tuple[int, int, int], str] = {}


def prefill_attention(q: torch.Tensor, hkv: int, t0: torch.Tensor, t1: torch.Tensor, own_k: torch.Tensor,
                      own_v: torch.Tensor, own_cap: torch.Tensor, own_index: torch.Tensor, offset: torch.Tensor,
                      anc_k: torch.Tensor, anc_v: torch.Tensor, anc_len: torch.Tensor, scale: float,
                      out: torch.Tensor, kernel: str | None = None) -> bool:
    """Runs of tokens, each continuing one sequence: segment s is tokens t0[s]..t1[s] of q (T, Hq, D)
    (last dim contiguous), whose keys sit at own indices offset[s].. of row own_index[s] of its own
    buffer (data pointers own_k/own_v of contiguous [rows, Hkv, own_cap[s], D]), already written.
    Each token reads its anchor (as in `decode_attention`) and then its own keys up to its own
    index. Writes the segments' rows of out (T, Hq, D), float32 or, for bfloat16 q, bfloat16 (as in
    `decode_attention`). False if the kernel could not run
    (also: `kernel` "amx" where `amx` says no). float32 runs on the wide tile (48 lanes with
    AVX-512), or on the 16-lane one with `kernel` "tile16" (the same bits). bfloat16 runs on `kernel` (`PREFILL`, default
    `prefill_kernel`'s): on AMX tiles or AVX-512 BF16 dot products, the weights rounded to bfloat16 as
    PyTorch's kernels round them, or widened to float32 on the 16-lane tile ("widen", "tile16")."""
    hq, d = q.shape[1], q.shape[2]
    assert q.stride(2) == 1 and out.is_contiguous() and out.dtype in (torch.float32, q.dtype) and q.dtype in DTYPES
    lib = _lib_for(q, hkv)
    if lib is None:
        return False
    if kernel is None:
        kernel = prefill_kernel(hq, hkv, d) if q.dtype == torch.bfloat16 else "widen"
    return not lib.batchgen_prefill_attention(
        t0.numel(), hq, hkv, d, DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
        *_ints(t0, t1, own_k, own_v, own_cap, own_index, offset, anc_k, anc_v, anc_len), scale, out.data_ptr(),
        torch.get_num_threads(), PREFILL[kernel], int(out.dtype == torch.bfloat16))


LAYER_OPS_CAPABILITY = {2: "AVX512", 1: "AVX2"}  # batchgen_layer_ops(): whose bits the library's passes are
_GRAIN = 32768  # ATen's grain size (at::internal::GRAIN_SIZE): elementwise ops split into threads' chunks above it


def silu_chunk(total: int) -> int:
    """The elements of each thread's chunk as PyTorch splits an elementwise op over `total` now."""
    threads = torch.get_num_threads()
    tasks = 1 if total < _GRAIN or threads == 1 else min(threads, -(-total // _GRAIN))
    return max(1, -(-total // tasks))


class LayerOps:
    """The decoder's elementwise passes (`cpu_layer_ops.c`) on float32 or bfloat16 activations:
    the norm with its residual sum, the MLP's gate, the rotary embeddings. The reference is
    PyTorch's ops (`Decoder._add_norm`, `_gate`, `_rotate`), which run where `layer_ops` gives None."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += residual (if any), in place; returns transformers' RMSNorm of x times `weight`."""
        n, h = x.shape
        assert x.is_contiguous() and weight.is_contiguous() and weight.dtype == x.dtype and weight.numel() == h
        assert residual is None or (residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype)
        out = torch.empty_like(x)
        if self._lib.batchgen_add_rms_norm(n, h, DTYPES[x.dtype], x.data_ptr(),
                                           None if residual is None else residual.data_ptr(), weight.data_ptr(),
                                           eps, out.data_ptr(), torch.get_num_threads()):
            raise MemoryError("batchgen's norm kernel got no scratch memory")
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate = silu(gate) * up, in place; returns gate. PyTorch computes the last elements of
        each of its threads' chunks one by one (`cpu_layer_ops.c`): the chunks it would make now."""
        assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape and gate.dtype == up.dtype
        if self._lib.batchgen_silu_mul(gate.shape[0], gate[0].numel() if gate.shape[0] else 0, DTYPES[gate.dtype],
                                       gate.data_ptr(), up.data_ptr(), silu_chunk(gate.numel()),
                                       torch.get_num_threads()):
            raise MemoryError("batchgen's MLP kernel got no scratch memory")
        return gate

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """`decoder._rotate_(x, cos, sin)` in place: x (T, H, D) with its last dim contiguous,
        cos and sin (T, 1, D) contiguous, sin's first half negated."""
        t, heads, d = x.shape
        assert x.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == x.dtype
        assert cos.shape == sin.shape == (t, 1, d)
        if self._lib.batchgen_rotary(t, heads, d, DTYPES[x.dtype], x.data_ptr(), x.stride(0), x.stride(1),
                                     cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()):
            raise MemoryError("batchgen's rotary kernel got no scratch memory")


def layer_ops(dtype: torch.dtype, hq: int, hkv: int, d: int, hidden: int, intermediate: int) -> LayerOps | None:
    """The elementwise passes for a decoder of this layout on this CPU (its attention kernels'
    library), or None: where `supports` says no, for widths that are not multiples of 16, where
    ATen runs kernels of another vector width than the library's, for bfloat16 on AVX2, or with
    ``BATCHGEN_LAYER_OPS=0`` (PyTorch's ops, the reference)."""
    if os.environ.get("BATCHGEN_LAYER_OPS", "1") == "0" or hidden % 16 or intermediate % 16:
        return None
    if not supports(dtype, hq, hkv, d, d):
        return None
    lib = _lib(hq // hkv, d)
    if dtype == torch.bfloat16 and lib.batchgen_layer_ops() != 2:
        return None  # AVX2 has no bfloat16 conversions: its gate ran 1.5x PyTorch's time (BENCHMARKS.md)
    # their bits are PyTorch's as ATen's AVX-512 or AVX2 kernels compute them (its silu's vectors and
    # one-by-one tail): where ATen runs another build than the library's (ATEN_CPU_CAPABILITY, an
    # AVX2 library on an AVX-512 CPU), PyTorch's ops run instead
    return LayerOps(lib) if LAYER_OPS_CAPABILITY.get(lib.batchgen_layer_ops()) == torch.backends.cpu.get_cpu_capability() \
        else None


def _built() -> ctypes.CDLL | None:
    """A library already built in this process (any layout's: these kernels do not depend on it)."""
    return next((lib for lib in _libs.values() if lib is not None), None)


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, list[bool]] | None:
    """Each row's argmax (PyTorch's: the first of equal maxima) and whether the row is all finite,
    from float32 logits (B, V) on the CPU in one pass (`cpu_layer_ops.c`), where a library of these
    kernels is already built in this process (the decoder's, or the attention kernels'); else None,
    and the caller takes PyTorch's ops."""
    lib = _built()
    if lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or not logits.is_contiguous() \
            or logits.dim() != 2 or not logits.shape[1]:
        return None
    best = torch.empty(logits.shape[0], dtype=torch.long)
    finite = torch.empty(logits.shape[0], dtype=torch.uint8)
    if lib.batchgen_greedy(logits.shape[0], logits.shape[1], logits.data_ptr(), best.data_ptr(), finite.data_ptr(),
                           torch.get_num_threads()):
        return None
    return best, finite.bool().tolist()


def store_rows(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               tokens: torch.Tensor | slice, slots: torch.Tensor, at: torch.Tensor) -> bool:
    """`k_buf[slots, :, at] = k[:, tokens].transpose(0, 1)` and the same for v, as copies of
    each token's heads: k, v (H, T, D) with their last dim contiguous, the buffers [slots, H, cap,
    D] contiguous, `tokens` a slice of every token or an index. False where it did not run (no
    library built in this process, another dtype or layout, an index out of range): the caller
    assigns by indexing, which says what is wrong."""
    lib = _built()
    every = isinstance(tokens, slice)
    if (lib is None or k.dtype not in DTYPES or not k.dtype == v.dtype == k_buf.dtype == v_buf.dtype
            or k.device.type != "cpu" or k.stride(2) != 1 or v.stride(2) != 1 or not k_buf.is_contiguous()
            or not v_buf.is_contiguous() or k_buf.shape != v_buf.shape or k.shape != v.shape
            or k_buf.shape[1] != k.shape[0] or k_buf.shape[3] != k.shape[2]
            or (every and tokens != slice(None)) or (not every and tokens.numel() != slots.numel())):
        return False
    index = [tokens] if not every else []
    if not all(x.dtype == torch.long and x.is_contiguous() and x.device.type == "cpu" for x in [slots, at, *index]) \
            or at.numel() != slots.numel() or (every and slots.numel() != k.shape[1]):
        return False
    heads, t, d = k.shape
    return not lib.batchgen_store_rows(
        slots.numel(), heads, d, DTYPES[k.dtype], k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
        v.stride(1), t, k_buf.data_ptr(), v_buf.data_ptr(), k_buf.shape[0], k_buf.shape[2],
        None if every else tokens.data_ptr(), slots.data_ptr(), at.data_ptr(), torch.get_num_threads())


class Gemm:
    """The decoder's float32 linear layers on `cpu_gemm.c`: `linear(weight, bias)` packs the weight
    once (a copy: the checkpoint's memory is not kept) and returns the layer's forward; `packed`
    takes a weight packed already (`batchgen.pipeline.model.prepack`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def linear(self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None = None):
        """`weight` (N, K), or the parts of a fused layer stacked by output, each (N_i, K) (packed
        from where they are: no concatenated copy first)."""
        parts = weight if isinstance(weight, list) else [weight]
        assert all(w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2 for w in parts)
        parts = [w if w.stride(1) == 1 else w.contiguous() for w in parts]
        n, k = sum(w.shape[0] for w in parts), parts[0].shape[1]
        assert all(w.shape[1] == k for w in parts)
        packed = torch.empty(packed_size(n, k), dtype=torch.float32)
        pack_parts(self._lib, [(w.data_ptr(), w.shape[0], w.stride(0)) for w in parts], k, packed.data_ptr(),
                   torch.get_num_threads())
        return self.packed(packed, n, k, bias)

    def packed(self, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None):
        """The forward of an (n, k) weight packed as `linear` packs it."""
        assert packed.dtype == torch.float32 and packed.numel() == packed_size(n, k) and packed.is_contiguous()
        b = bias.to(torch.float32).contiguous() if bias is not None else None
        lib = self._lib

        def forward(x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
            rows = _gemm_rows(x, k)
            y = torch.empty(rows.shape[0], n, dtype=torch.float32)
            if lib.batchgen_gemm(rows.shape[0], n, k, rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                                 None if b is None else b.data_ptr(), y.data_ptr(), torch.get_num_threads()):
                raise MemoryError("batchgen's linear kernel got no scratch memory")
            return y.view(*x.shape[:-1], n)

        forward.packed = packed  # (what the layer holds: for the tests and memory accounting)
        forward.n, forward.k, forward.bias = n, k, b
        return forward

    def glu(self, gate, up, ops: LayerOps):
        """A gated MLP's first half, `ops.silu_mul(gate(x), up(x))`, in one pass where its bits are
        the same (`batchgen_gemm_glu`): for two forwards of `packed`, over the same inputs."""
        assert gate.n == up.n and gate.k == up.k
        n, k, lib = gate.n, gate.k, self._lib
        pg, pu, bg, bu = gate.packed, up.packed, gate.bias, up.bias

        def forward(x: torch.Tensor) -> torch.Tensor:  # (T, K) -> (T, N)
            assert x.dim() == 2
            rows = _gemm_rows(x, k)
            y = torch.empty(rows.shape[0], n, dtype=torch.float32)
            rc = lib.batchgen_gemm_glu(rows.shape[0], n, k, rows.data_ptr(), rows.stride(0), pg.data_ptr(),
                                       None if bg is None else bg.data_ptr(), pu.data_ptr(),
                                       None if bu is None else bu.data_ptr(), y.data_ptr(),
                                       silu_chunk(rows.shape[0] * n), torch.get_num_threads())
            if rc == -1:  # PyTorch would take some of these elements one by one: the three passes
                return ops.silu_mul(gate(x), up(x))
            if rc:
                raise MemoryError("batchgen's linear kernel got no scratch memory")
            return y

        return forward


def _gemm_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x (..., K) float32 on the CPU as the GEMM reads it: rows of K contiguous floats, any distance apart."""
    assert x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] == k
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    return rows


def gemm(dtype: torch.dtype, hq: int, hkv: int, d: int) -> Gemm | None:
    """The float32 linear layers' kernel for a decoder of this layout on this CPU (its attention
    kernels' library), or None: another dtype (bfloat16 stays on oneDNN's AMX kernels), a layout
    `supports` refuses, neither AVX-512 nor AVX2, or ``BATCHGEN_GEMM=0`` (oneDNN's, `kernels.linear`)."""
    if dtype != torch.float32 or not gemm_enabled() or not supports(dtype, hq, hkv, d, d):
        return None
    lib = _lib(hq // hkv, d)
    return Gemm(lib) if lib.batchgen_gemm_ok() else None
