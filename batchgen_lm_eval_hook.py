"""The start-up hook behind `lm_eval --model batchgen` (pipeline/lm_eval_plugin.py writes the
.pth file that runs `install()`; why: see there). A top-level module, not part of `pipeline`: it
runs at every start of Python, before a program sets up its sys.path, so importing it must not
import (and fix the location of) the `pipeline` package. It adds an import hook and nothing else: when
lm-eval imports its table of models (`lm_eval.models`), `batchgen` is added to it as the lazy
target `batchgen.pipeline.evalharness:BatchgenLM`, so neither lm-eval nor batchgen's backend is imported by
a program that does not use lm-eval.

It registers with the registry lm-eval has: 0.4.13's `model_registry.register(name, target=...)`
(a lazy target), or the older `MODEL_REGISTRY` table of classes (up to 0.4.9 at least: a stand-in
class there, which becomes batchgen's class on first use), and does nothing with any other shape.
Whatever goes wrong in it is swallowed: this hook runs inside lm-eval's own import of its models,
in every program of the environment, and must never break it.
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
        self.inner.exec_module(module)  # lm-eval's own errors are lm-eval's
        try:
            _register()
        except Exception:  # noqa: BLE001  (an lm-eval of another shape: without batchgen, as if not installed)
            pass


def _register() -> None:
    """batchgen into lm-eval's table of models, in the shape that table has (module docstring)."""
    import lm_eval.api.registry as registry

    table = getattr(registry, "model_registry", None)
    if callable(getattr(table, "register", None)):  # 0.4.13: lazy targets
        if NAME not in table:  # importing batchgen.pipeline.evalharness later upgrades it to the class
            table.register(NAME, target=TARGET)
        return
    table = getattr(registry, "MODEL_REGISTRY", None)
    if type(table) is dict and NAME not in table:  # older: name -> class
        table[NAME] = _stand_in(table)


def make_room() -> None:
    """Called by batchgen's backend before it registers its class: an older table's stand-in
    (`_stand_in`) leaves it, as that table's `register_model` refuses a name that is taken."""
    table = getattr(sys.modules.get("lm_eval.api.registry"), "MODEL_REGISTRY", None)
    entry = table.get(NAME) if type(table) is dict else None
    if isinstance(entry, type) and vars(entry).get("batchgen_stand_in"):
        del table[NAME]


def _stand_in(table: dict) -> type:
    """A class for the older table that stands for batchgen's: what lm-eval asks of it
    (`create_from_arg_string`, a call) is asked of the real class, imported on that first use."""

    class Lazy(type):
        def real(cls) -> type:
            make_room()
            import importlib

            module, _, name = TARGET.partition(":")
            try:
                return getattr(importlib.import_module(module), name)
            except ImportError as e:
                table.setdefault(NAME, cls)
                raise ImportError(f"batchgen's lm-eval backend needs lm-eval 0.4.13 (pip install lm-eval==0.4.13); "
                                  f"this lm-eval lacks what it uses ({e})") from None

        def __getattr__(cls, name: str) -> object:
            return getattr(cls.real(), name)

        def __call__(cls, *args: object, **kwargs: object) -> object:
            return cls.real()(*args, **kwargs)

    return Lazy("BatchgenLM", (), {"__module__": __name__, "__doc__": f"stands for {TARGET}",
                                   "batchgen_stand_in": True})


def install() -> None:
    """The import hook (run at start-up by the .pth file; once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
