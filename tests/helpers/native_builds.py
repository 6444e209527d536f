"""The compiled kernels built for another CPU than this one (`-march=...` instead of `-march=native`):
what the tests compile to check that a build compiles, or load to run an AVX2 build on an AVX-512 CPU."""
from __future__ import annotations

from batchgen.pipeline.model import native_build


def flags_for(march: str) -> list[str]:
    """`native_build.FLAGS` with `-march=native` replaced by `-march=<march>`."""
    return [f if f != "-march=native" else f"-march={march}" for f in native_build.FLAGS]


def build_for(monkeypatch, march: str) -> None:
    """From now on (for this test), `native_build` builds its libraries for `march`."""
    monkeypatch.setattr(native_build, "FLAGS", flags_for(march))
