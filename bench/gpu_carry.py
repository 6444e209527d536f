"""`make gpu-wheels`: fill `.gpu/` with what a GPU run carries to a machine without network.

- `.gpu/wheels`: the wheels of bench/gpu_install.py's ROOTS and everything they require, at the
  versions this venv runs (the set the test suite proved), pure-Python or abi3 only, so one copy
  serves any CPython from 3.10 on. Left out: what the device machine has with its PyTorch and its
  transformers (SKIP), whose compiled wheels differ per Python version.
- `.gpu/smollm2`: the default model's config and tokenizer files, no weights (269 MB in bfloat16 do
  not fit the 64 MiB a run carries): the device builds a random model of exactly SmolLM2's shape
  (bench/gpu_check.py `model`), which costs what the real one costs per token.

    python -m bench.gpu_carry [--dest .gpu]
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.gpu_install import ROOT, ROOTS

# on the device already (PyTorch's and transformers' own requirements) and compiled per Python version
SKIP = {"torch", "triton", "numpy", "pyyaml", "regex", "jinja2", "markupsafe", "sympy", "mpmath", "networkx",
        "setuptools"}
SKIP_PREFIX = ("nvidia-", "cuda-")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")
PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")  # the device's Python is not known ahead: PyTorch 2.11 takes these
LIMIT_MB = 64  # what one device run carries, every carry path together


def closure(roots: list[str]) -> dict[str, str]:
    """name -> this venv's version, for the roots and everything they require here (markers
    evaluated, no extras), SKIP left out."""
    env = {**default_environment(), "extra": ""}
    out: dict[str, str] = {}
    queue = [Requirement(r) for r in roots]
    while queue:
        name = canonicalize_name(queue.pop(0).name)
        if name in out or name in SKIP or name.startswith(SKIP_PREFIX):
            continue
        out[name] = md.version(name)
        for line in md.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                queue.append(req)
    return out


def _pip_download(spec: str, dest: Path, python: str, abis: tuple[str, ...]) -> subprocess.CompletedProcess:
    # Requires-Python is checked on the device by gpu_install, against the Python that runs there
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
           "--ignore-requires-python", "--implementation", "cp", "--python-version", python,
           *[x for abi in abis for x in ("--abi", abi)],
           *[x for tag in ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "any") for x in ("--platform", tag)]]
    return subprocess.run(cmd + [spec], capture_output=True, text=True)


def download(pins: dict[str, str], dest: Path) -> None:
    """Each pin's pure-Python or abi3 wheel (one for every CPython from 3.10 on); where the project
    publishes only per-version wheels, one per version in PYTHONS (at least one must exist)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    for name, version in sorted(pins.items()):  # one at a time: an error names the package
        spec = f"{name}=={version}"
        if _pip_download(spec, dest, "3.10", ("abi3", "none")).returncode == 0:
            continue
        got = [py for py in PYTHONS if _pip_download(spec, dest, py, (f"cp{py.replace('.', '')}",)).returncode == 0]
        if not got:
            raise SystemExit(f"gpu-wheels: no wheel of {spec} for CPython {', '.join(PYTHONS)}")


def model_files(dest: Path) -> None:
    from batchgen.pipeline.model.load import default_model_path

    src = Path(default_model_path())
    dest.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dest / name)


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".gpu")
    args = ap.parse_args(argv)
    pins = closure(ROOTS)
    download(pins, args.dest / "wheels")
    model_files(args.dest / "smollm2")
    total = size_mb(args.dest)
    for f in sorted(args.dest.rglob("*")):
        if f.is_file():
            print(f"{f.stat().st_size / 2**20:8.2f} MB  {f.relative_to(args.dest)}")
    print(f"{total:8.2f} MB  in all under {args.dest} (a run carries at most {LIMIT_MB} MiB)")
    return 0 if total < LIMIT_MB else 1


if __name__ == "__main__":
    raise SystemExit(main())
