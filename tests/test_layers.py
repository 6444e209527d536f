"""The four layers hold (docs/layout.md): import-linter's contracts in pyproject.toml pass, and
fail when a forbidden import is planted; no module imports another that imports it back.

grimp finds a package's modules by walking its folder, and the repository's `jobs/` and
`pipeline/` install as `batchgen.jobs` and `batchgen.pipeline` (pyproject's package-dir): the
checks run on a copy laid out as installed."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")


def _staged(dest: Path) -> Path:
    """The package as it installs: batchgen/ with jobs/ and pipeline/ inside, and pyproject.toml."""
    shutil.copytree(ROOT / "batchgen", dest / "batchgen", ignore=IGNORE)
    for name in ("jobs", "pipeline"):
        shutil.copytree(ROOT / name, dest / "batchgen" / name, ignore=IGNORE)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True)


def test_the_contracts_hold(tmp_path):
    result = _lint(_staged(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


@pytest.mark.parametrize("module, planted", [
    ("jobs/params.py", "import batchgen.pipeline.errors"),          # jobs/ imports nothing from pipeline/
    ("jobs/params.py", "import batchgen.api"),                      # ... nor from the Python face
    ("pipeline/model/kv.py", "import batchgen.pipeline.engine.schedule"),   # model/ is the bottom layer
    ("pipeline/engine/schedule.py", "import batchgen.pipeline.text.tokenize"),  # the engine sees token ids only
    ("pipeline/text/scoring.py", "import batchgen.pipeline.engine.engine"),  # text/ never reaches the engine loop
    ("pipeline/engine/rows.py", "import gc"),                        # only run/ touches gc, signals, Ray
])
def test_a_planted_import_breaks_a_contract(tmp_path, module, planted):
    target = _staged(tmp_path) / "batchgen" / module
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


def test_no_import_cycles(tmp_path):
    # grimp counts every import, those under TYPE_CHECKING too; in a process whose `batchgen` is the copy
    code = ("import json, grimp, tests.test_layers as t; "
            "print(json.dumps(t._cycles(grimp.build_graph('batchgen', cache_dir=None))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_staged(tmp_path)), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_the_cycle_count_sees_a_cycle():
    graph = grimp.ImportGraph()
    for m in ("a", "a.x", "a.y"):
        graph.add_module(m)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    assert _cycles(graph) == [("a.x", "a.y")]
