"""The start-up hook behind `lm_eval --model batchgen` (pipeline/lm_eval_plugin.py writes the
.pth file that runs `install()`; why: see there). A top-level module, not part of `pipeline`: it
runs at every start of Python, before a program sets up its sys.path, so importing it must not
import (and fix the location of) the `pipeline` package. It adds an import hook and nothing else: when
lm-eval imports its table of models (`lm_eval.models`), `batchgen` is added to it as the lazy
target `batchgen.pipeline.evalharness:BatchgenLM`, so neither lm-eval nor batchgen's backend is imported by
a program that does not use lm-eval.
"""
from __future__ import annotations

import sys

# run at every start of Python: no imports beyond sys (importlib.abc would slow every start-up);
# the finder and loader below are duck-typed

NAME = "batchgen"
TARGET = "batchgen.pipeline.evalharness:BatchgenLM"
_TABLE = "lm_eval.models"


class _Finder:
    """Finds lm-eval's table of models as the other finders do, with a loader that adds batchgen."""

    busy = False  # asking the other finders: another hook of this kind among them asks back

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if name != _TABLE or self.busy:
            return None
        self.busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None:
                        spec.loader = _Registering(spec.loader)
                    return spec
            return None
        finally:
            self.busy = False


class _Registering:
    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:  # the rest of the loader's interface is the inner loader's
        return getattr(self.inner, name)

    def create_module(self, spec: object) -> object:
        return self.inner.create_module(spec)

    def exec_module(self, module: object) -> None:
        self.inner.exec_module(module)
        from lm_eval.api.registry import model_registry

        if NAME not in model_registry:  # importing batchgen.pipeline.evalharness later upgrades it to the class
            model_registry.register(NAME, target=TARGET)


def install() -> None:
    """The import hook (run at start-up by the .pth file; once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
