"""The documentation holds: the site builds with `mkdocs build --strict` (a broken link or anchor, a
page missing from the nav, a snippet whose file is gone or the CLI reference failing to import all
fail), and every shell and Python example in README.md runs.

The README's examples run as a user runs them, in a scratch directory holding a copy of `data/`,
with these changes: the hub id they name (HuggingFaceTB/SmolLM2-360M-Instruct, not downloadable here)
becomes a tiny random Llama's directory; `BATCHGEN_MODEL` points the shell examples that name no
model at it too; `BATCHGEN_MAX_NEW_TOKENS` keeps jobs that set no length short. The Python example
that names no model runs the embedded default model as written: it is a PyPI package, offline.
Blocks not run are listed in NOT_RUN with the reason, and each entry must still match a block.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
HUB_ID = "HuggingFaceTB/SmolLM2-360M-Instruct"

# a line that names a block -> why that block is not run here
NOT_RUN = {
    "make test": "the set-up and the whole suite, this file included (make run is make setup and the README's "
                 "first example on the default model)",
    "--engine vllm": "a GPU machine's own vLLM install and servers (tests/e2e/test_vllm_engine.py runs these "
                     "flags against vLLM's CPU build)",
    "--device cuda": "needs a CUDA device (runs where torch sees one)",
}


def blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block of README.md, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def _not_run(code: str) -> str | None:
    for key, reason in NOT_RUN.items():
        if key in code:
            if key == "--device cuda" and _has_cuda():
                return None
            return reason
    return None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cases():
    for i, (lang, code) in enumerate(blocks()):
        first = code.strip().splitlines()[0][:40]
        yield pytest.param(lang, code, id=f"{i}-{lang}-{first}")


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    assert lines[:6] == [
        "# batchgen", "", "```bash",
        "make run    # fresh machine: creates .venv, installs batchgen + the embedded default model, runs a sample job file",
        "make test   # fresh machine: same set-up, then the whole test suite (slow real-model tests included)", "```"]
    assert "make docs" in README.read_text()


def test_every_readme_block_is_a_language_the_test_runs_and_every_exclusion_matches_one():
    found = blocks()
    assert {lang for lang, _ in found} <= {"bash", "python"}
    for key in NOT_RUN:
        assert any(key in code for _, code in found), f"NOT_RUN entry {key!r} matches no README block"


def test_every_readme_link_to_a_file_exists_and_its_anchor_too():
    from markdown.extensions.toc import slugify  # the slugs mkdocs gives headings

    for target, anchor in re.findall(r"\]\(([^)#]+)(?:#([^)]*))?\)", README.read_text()):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / target).read_text(), flags=re.M)
            assert anchor in {slugify(h, "-") for h in headings}, f"{target}#{anchor}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A working directory as the README's examples expect it: data/, out/, two LoRA adapters of the
    tiny model under adapters/, and the tiny model's directory."""
    from tests.helpers.tiny_adapters import make_adapter
    from tests.helpers.tiny_models import make_model
    from tests.helpers.tiny_tokenizer import make_tokenizer

    root = tmp_path_factory.mktemp("readme")
    model_dir = root / "tiny-llama"
    model = make_model("llama")
    model.save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    make_adapter(model, root / "adapters" / "sql", seed=1)
    make_adapter(model, root / "adapters" / "chat", seed=2)
    shutil.copytree(ROOT / "data", root / "data")
    (root / "out").mkdir()
    return root, model_dir


@pytest.mark.slow
@pytest.mark.parametrize("lang,code", list(_cases()))
def test_readme_example_runs(lang, code, scratch):
    reason = _not_run(code)
    if reason:
        pytest.skip(reason)
    root, model_dir = scratch
    code = code.replace(HUB_ID, str(model_dir))
    # a short default length for the jobs that set none: the examples' point is that they run
    env = {**os.environ, "BATCHGEN_MODEL": str(model_dir), "BATCHGEN_MAX_NEW_TOKENS": "8", "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{code}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_docs_site_builds_strict(tmp_path):
    """`mkdocs build --strict`, as `make docs` runs it; mkdocs is in the `docs` extra `make setup` installs."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # the CLI reference is generated from click: every command and a flag of each are on the page
    cli = (tmp_path / "site" / "cli" / "index.html").read_text()
    for needle in ("batchgen process", "batchgen validate", "batchgen plan", "batchgen merge", "--shard",
                   "--min-shared-tokens"):
        assert needle in cli, needle
    assert "Sentinel" not in cli  # click 8.3's UNSET default, which mkdocs-click's table style prints
    # the benchmark tables come from BENCHMARKS.md itself
    bench = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert "What bounds each number" in bench
