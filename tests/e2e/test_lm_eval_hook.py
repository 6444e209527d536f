"""The lm-eval start-up hook never breaks lm-eval (issue 48, 5): with an lm-eval whose registry has
the older shape (`MODEL_REGISTRY` and `register_model`, up to 0.4.9 at least) batchgen is
registered as a stand-in class; with any other shape nothing is registered and lm-eval imports
its models as if batchgen were not installed. Each lm-eval here is a fake package written into a
temporary directory and put first on PYTHONPATH; the hook is installed as the .pth file does.
(0.4.13's shape, the real package: tests/e2e/test_lm_eval.py.)"""
import os
import subprocess
import sys
import textwrap

import pytest

from batchgen.pipeline.lm_eval_plugin import write_pth

# lm-eval 0.4.2's registry, as it is (less its `evaluate` import)
OLD_REGISTRY = '''
from lm_eval.api.model import LM

MODEL_REGISTRY = {}


def register_model(*names):
    def decorate(cls):
        for name in names:
            assert issubclass(cls, LM), f"Model '{name}' ({cls.__name__}) must extend LM class"
            assert name not in MODEL_REGISTRY, f"Model named '{name}' conflicts with existing model!"
            MODEL_REGISTRY[name] = cls
        return cls
    return decorate


def get_model(model_name):
    try:
        return MODEL_REGISTRY[model_name]
    except KeyError:
        raise ValueError(f"no model for this name found: {model_name}")
'''
MODEL = '''
class LM:
    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        return cls()


class TemplateLM(LM):
    pass
'''
# what batchgen's backend imports of lm-eval beyond the registry (0.4.13 has them; 0.4.9 has not)
UTILS = '''
def _add_special_kwargs(*a, **k): pass
def has_bos_prefix(*a, **k): pass
def normalize_gen_kwargs(*a, **k): pass
'''
DUMMY = '''
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model


@register_model("dummy")
class DummyLM(LM):
    pass
'''


def fake_lm_eval(root, registry, backend_utils=False):
    """An lm_eval package under `root` with this registry module (None: none), a model module that
    registers "dummy" where the registry has `register_model`, and the backend's utilities."""
    files = {"__init__.py": "", "api/__init__.py": "", "api/model.py": MODEL, "utils.py": "",
             "models/__init__.py": "from . import dummy\n" if registry is OLD_REGISTRY else "",
             "models/dummy.py": DUMMY, "models/utils.py": UTILS if backend_utils else ""}
    if registry is not None:
        files["api/registry.py"] = registry
    for name, text in files.items():
        path = root / "lm_eval" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def run_with_hook(tmp_path, lm_eval_root, code):
    """`code` in a fresh Python whose site runs the hook's .pth file, the fake lm-eval first on its path."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    write_pth(site)
    prelude = f"import site; site.addsitedir({str(site)!r})\n"
    env = {**os.environ, "PYTHONPATH": str(lm_eval_root)}
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split("\n")[:-1]


def test_an_older_registry_gets_a_stand_in_that_becomes_the_backend_on_first_use(tmp_path):
    root = fake_lm_eval(tmp_path / "old", OLD_REGISTRY, backend_utils=True)
    out = run_with_hook(tmp_path, root, """
        import sys
        import lm_eval.models
        from lm_eval.api.registry import MODEL_REGISTRY, get_model
        print(sorted(MODEL_REGISTRY), get_model("batchgen").__name__,
              any(m.startswith("batchgen.pipeline") for m in sys.modules))
        get_model("batchgen").create_from_arg_string  # lm-eval's first use: the backend is imported
        print(MODEL_REGISTRY["batchgen"].__module__, MODEL_REGISTRY["batchgen"].__name__)
    """)
    assert out == ["['batchgen', 'dummy'] BatchgenLM False", "batchgen.pipeline.evalharness BatchgenLM"]
    # the backend imported by a program itself (not through the stand-in) takes the name too
    out = run_with_hook(tmp_path, root, """
        import lm_eval.models
        import batchgen.pipeline.evalharness
        from lm_eval.api.registry import get_model
        print(get_model("batchgen").__module__)
    """)
    assert out == ["batchgen.pipeline.evalharness"]


def test_an_older_lm_eval_without_what_the_backend_uses_says_so_when_asked_for_batchgen(tmp_path):
    root = fake_lm_eval(tmp_path / "old", OLD_REGISTRY)
    out = run_with_hook(tmp_path, root, """
        import lm_eval.models
        from lm_eval.api.registry import MODEL_REGISTRY, get_model
        print(get_model("dummy").__name__)
        try:
            get_model("batchgen").create_from_arg_string("")
        except ImportError as e:
            print(str(e).splitlines()[0][:60], len(str(e).splitlines()), "batchgen" in MODEL_REGISTRY)
    """)
    assert out == ["DummyLM", "batchgen's lm-eval backend needs lm-eval 0.4.13 (pip install 1 True"]


@pytest.mark.parametrize("registry", [
    None,  # no lm_eval.api.registry at all
    "model_registry = object()\nMODEL_REGISTRY = ()\n",  # names the hook knows, of other types
    "class R:\n    def __contains__(self, n): return False\n"
    "    def register(self, *a, **k): raise RuntimeError('refused')\nmodel_registry = R()\n",  # it raises
    "raise RuntimeError('a registry that cannot be imported')\n",
], ids=["no-registry", "other-types", "register-raises", "import-raises"])
def test_any_other_registry_shape_leaves_lm_eval_importing_its_models(tmp_path, registry):
    root = fake_lm_eval(tmp_path / "other", registry)
    (root / "lm_eval" / "models" / "__init__.py").write_text("TABLE = ['dummy']\n")
    out = run_with_hook(tmp_path, root, """
        import lm_eval.models
        print(lm_eval.models.TABLE, [m for m in __import__("sys").modules if m.startswith("batchgen.pipeline")])
    """)
    assert out == ["['dummy'] []"]
