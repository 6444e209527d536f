"""Install what a machine without network lacks for batchgen, from wheels carried with the work tree.

The device machine (docs/gpu.md) has PyTorch and an older transformers preinstalled and reaches no
registry. `make gpu-wheels` (bench/gpu_carry.py) downloads the wheels of batchgen's dependency
closure, pure-Python or abi3 only, into `.gpu/wheels`; this script, run on the device with that
machine's own Python, resolves ROOTS against what that Python already has, walking each carried
wheel's own requirements, and installs only what is missing or too old into a folder put first on
PYTHONPATH (pip's `--target`, or the wheels unzipped where pip is absent). Nothing the machine has is
changed. (bench/gpu_check.sh lays batchgen out as installed with two links, so no build step runs.)

Standard library only, plus `packaging` (transformers needs it; pip's vendored copy otherwise).

    python -m bench.gpu_install --wheels .gpu/wheels --site /tmp/site --report env.json
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pragma: no cover - a Python with pip but without packaging
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
# what the device run imports: batchgen's engine and model code, its tests' helpers, pytest; the
# specifiers are pyproject's (tests/test_gpu_check.py holds them equal). pyarrow, datasets and
# llguidance are not here: a pyarrow wheel (55 MB per Python version) does not fit the 64 MiB a run
# carries, and the steps that need them are skipped where the machine lacks them (bench/gpu_check.sh).
ROOTS = ["transformers>=5.24,<6", "tokenizers", "huggingface_hub", "safetensors", "click>=8.1", "tqdm>=4.60",
         "pytest>=8"]


class Unresolved(Exception):
    pass


def carried(wheels: Path) -> dict[str, list[tuple[object, Path]]]:
    """Carried wheels that this Python can install, by project name: (version, path), newest first."""
    tags = set(sys_tags())
    out: dict[str, list] = {}
    for path in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        name, version, _, wheel_tags = parse_wheel_filename(path.name)
        if tags & set(wheel_tags) and runs_here(path):
            out.setdefault(name, []).append((version, path))
    for versions in out.values():
        versions.sort(key=lambda x: x[0], reverse=True)
    return out


def installed_version(name: str):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _metadata(wheel: Path) -> list[str]:
    """The header lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return z.read(meta).decode().split("\n\n", 1)[0].splitlines()


def runs_here(wheel: Path) -> bool:
    """The wheel's Requires-Python takes this Python (its tags were checked by `carried`)."""
    want = [line.split(":", 1)[1].strip() for line in _metadata(wheel) if line.startswith("Requires-Python:")]
    return not want or SpecifierSet(want[0]).contains(platform.python_version(), prereleases=True)


def requirements_of(wheel: Path) -> list[Requirement]:
    """A wheel's Requires-Dist whose markers hold here (extras not asked for are left out)."""
    env = {**default_environment(), "extra": ""}
    reqs = []
    for line in _metadata(wheel):
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                reqs.append(req)
    return reqs


def resolve(roots: list[str], wheels: dict[str, list]) -> tuple[dict[str, Path], list[str]]:
    """Which carried wheels to install: a root, or a requirement of a wheel chosen here, that this
    Python does not satisfy gets the newest carried wheel that does. Returns (chosen by name, the
    requirements nothing satisfies); the first conflict raises."""
    chosen: dict[str, tuple[object, Path]] = {}
    missing: list[str] = []
    queue = [Requirement(r) for r in roots]
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in chosen:
            if not req.specifier.contains(chosen[name][0], prereleases=True):
                raise Unresolved(f"{req} conflicts with the carried {name} {chosen[name][0]}")
            continue
        have = installed_version(name)
        if have is not None and req.specifier.contains(have, prereleases=True):
            continue
        fits = [(v, p) for v, p in wheels.get(name, []) if req.specifier.contains(v, prereleases=True)]
        if not fits:
            missing.append(f"{req} (installed: {have or 'none'}; carried: "
                           f"{', '.join(str(v) for v, _ in wheels.get(name, [])) or 'none'})")
            continue
        chosen[name] = fits[0]
        queue += requirements_of(fits[0][1])
    return {n: p for n, (_, p) in chosen.items()}, missing


def install(paths: list[Path], site: Path) -> str:
    """Into `site`: pip where this Python has it (no index, no dependencies), else the wheels unzipped
    (a wheel is a zip laid out as site-packages; these carry no compiled extension needing a build)."""
    site.mkdir(parents=True, exist_ok=True)
    if not paths:
        return "nothing"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--target", str(site), *map(str, paths)]
    pip = subprocess.run(cmd, capture_output=True, text=True)
    if pip.returncode == 0:
        return "pip"
    print(f"pip failed ({pip.stderr.strip()[-500:]}); unzipping the wheels instead", file=sys.stderr)
    for p in paths:
        with zipfile.ZipFile(p) as z:
            z.extractall(site)
    return "unzip"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, default=ROOT / ".gpu" / "wheels")
    ap.add_argument("--site", type=Path, required=True, help="the folder to install into (put it first on PYTHONPATH)")
    ap.add_argument("--report", type=Path, default=None, help="write what was found and installed here (JSON)")
    ap.add_argument("--root", action="append", default=[], help="another requirement to satisfy (repeatable)")
    args = ap.parse_args(argv)
    wheels = carried(args.wheels)
    report = {"python": sys.version.split()[0], "executable": sys.executable, "wheels_dir": str(args.wheels),
              "carried": {n: [str(v) for v, _ in vs] for n, vs in sorted(wheels.items())}}
    try:
        chosen, missing = resolve(ROOTS + args.root, wheels)
        report["installer"] = install(sorted(chosen.values()), args.site)
        report["installed"] = {n: p.name for n, p in sorted(chosen.items())}
        report["unsatisfied"] = missing
    except Unresolved as e:
        report["error"] = str(e)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    # a requirement nothing satisfies fails the step; the steps after it say what they lack
    return 1 if report.get("error") or report.get("unsatisfied") else 0


if __name__ == "__main__":
    raise SystemExit(main())
