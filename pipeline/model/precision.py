"""The dtype a model computes in: `--dtype auto`'s one rule (`resolve_dtype`), the dtype a
checkpoint is stored in (`stored_dtype`), and which dtypes a device computes natively and fast
(`native_dtypes`). torch is imported inside the functions, as in `batchgen.pipeline.model.load`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from batchgen.pipeline.errors import OptionError

if TYPE_CHECKING:
    import torch

NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
         "float16": "float16", "fp16": "float16"}
# safetensors' names of floating-point dtypes (F64 too: it resolves to float32 like any dtype not fast here)
_SAFETENSORS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
# /proc/cpuinfo flags of the x86 instructions that compute each half-precision dtype natively: its
# dot products or tiles (oneDNN's kernels use them; without them it converts to float32 and back)
_CPU_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_dtypes(device: torch.device) -> frozenset[str]:
    """The dtypes `device` computes natively and fast: float32 everywhere; on CUDA float16, and
    bfloat16 where `torch.cuda.is_bf16_supported()`; on MPS float16; on a CPU each half-precision
    dtype whose instructions it has (`_CPU_FLAGS`: bfloat16 with AVX-512 BF16 or AMX-BF16, as on
    AMD since Zen 4 and Intel since Cooper Lake; float16 with AVX512-FP16 or AMX-FP16)."""
    import torch

    if device.type == "cuda":
        return frozenset({"float32", "float16"} | ({"bfloat16"} if torch.cuda.is_bf16_supported() else set()))
    if device.type == "mps":
        return frozenset({"float32", "float16"})
    flags = cpu_flags()
    return frozenset({"float32"} | {d for d, names in _CPU_FLAGS.items() if flags.intersection(names)})


def stored_dtype(directory: str | Path | None) -> str | None:
    """The dtype a checkpoint is stored in, read as transformers' `dtype="auto"` reads it:
    config.json's `dtype` (older files: `torch_dtype`), else the dtype of the first floating-point
    tensor by name (safetensors' order of keys) in the first safetensors file. None where neither
    says (no directory, no files)."""
    if directory is None:
        return None
    from batchgen.pipeline.model.decoder_config import header

    d = Path(directory)
    try:
        raw = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict):
        for key in ("dtype", "torch_dtype"):
            if isinstance(raw.get(key), str) and raw[key].removeprefix("torch.") in (*NAMES, "float64"):
                return NAMES.get(raw[key].removeprefix("torch."), "float64")
    try:
        index = d / "model.safetensors.index.json"
        first = (sorted(set(json.loads(index.read_text())["weight_map"].values()))[0] if index.is_file()
                 else "model.safetensors")
        tensors = header(d / first)[1]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return next((_SAFETENSORS[tensors[k]["dtype"]] for k in sorted(tensors)
                 if k != "__metadata__" and tensors[k].get("dtype") in _SAFETENSORS), None)


def resolve_dtype(dtype: str, device: torch.device, stored: str | None = None) -> torch.dtype:
    """The dtype a model computes in on `device`. A name (float32, bfloat16, float16, or fp32, bf16,
    fp16) is taken as asked. ``auto`` follows transformers' `dtype="auto"`, the checkpoint's own
    dtype (`stored`, from `stored_dtype`), where this device computes it natively and fast
    (`native_dtypes`), else float32; float32 too where the checkpoint does not say. So:
    - a float32 checkpoint (the embedded default model among them) runs in float32 everywhere;
    - a bfloat16 checkpoint runs in bfloat16 on CUDA where supported and on a CPU with AVX-512
      BF16 or AMX, else in float32 (emulated bfloat16 is slower than float32 on a CPU);
    - a float16 checkpoint runs in float16 on CUDA and MPS and on a CPU with AVX512-FP16 or
      AMX-FP16, else in float32;
    - a float64 checkpoint runs in float32."""
    import torch

    if dtype == "auto":
        return getattr(torch, stored) if stored in native_dtypes(device) else torch.float32
    try:
        return getattr(torch, NAMES[dtype])
    except KeyError:
        raise OptionError("dtype", "unknown dtype: use auto, float32, bfloat16 or float16", dtype) from None
