"""The four layers hold (README, "Layout"): import-linter's contracts in pyproject.toml pass, and
fail when a forbidden import is planted; no module imports another that imports it back."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "jobs", "batchgen")
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True)


def test_the_contracts_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


@pytest.mark.parametrize("module, planted", [
    ("jobs/params.py", "import pipeline.errors"),                  # jobs/ imports nothing from pipeline/
    ("pipeline/model/kv.py", "import pipeline.engine.schedule"),   # model/ is the bottom layer
    ("pipeline/engine/schedule.py", "import pipeline.text.tokenize"),  # the engine sees token ids only
    ("pipeline/text/scoring.py", "import pipeline.engine.engine"),  # text/ never reaches the engine loop
    ("pipeline/engine/rows.py", "import gc"),                        # only run/ touches gc, signals, Ray
])
def test_a_planted_import_breaks_a_contract(tmp_path, module, planted):
    for name in (*PACKAGES, "pyproject.toml"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{planted}  # planted by the test\n")
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout


def _cycles(graph) -> list[tuple[str, ...]]:
    found = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            chain = graph.find_shortest_chain(importer=imported, imported=module)
            if chain:
                found.add(tuple(sorted(set((module, *chain)))))
    return sorted(found)


def test_no_import_cycles():
    # grimp counts every import, those under TYPE_CHECKING too
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    assert _cycles(graph) == []


def test_the_cycle_count_sees_a_cycle():
    graph = grimp.ImportGraph()
    for m in ("a", "a.x", "a.y"):
        graph.add_module(m)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    assert _cycles(graph) == [("a.x", "a.y")]
