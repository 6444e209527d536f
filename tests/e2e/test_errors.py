"""batchgen's errors: one base class, caught by the CLI's guard (and nothing else is), and each
message naming options as the face that was called spells them."""
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import batchgen
import batchgen.jobs as jobs
import batchgen.pipeline as pipeline
from batchgen.pipeline.cli import main
from batchgen.pipeline.run.signals import Preempted

ROOT = Path(__file__).parents[2]
# a signal, not an error: a BaseException like KeyboardInterrupt, so no `except Exception` swallows it
NOT_ERRORS = {Preempted}


def _modules():
    for package in (jobs, pipeline, batchgen):
        yield package.__name__
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.count(".") == 1 and info.name in ("batchgen.jobs", "batchgen.pipeline"):
                continue  # walked as packages of their own above
            if not info.name.endswith("__main__"):  # running it is the CLI
                yield info.name


def test_every_exception_class_of_batchgen_is_a_batchgen_error():
    from batchgen.jobs.errors import BatchgenError

    found = []
    for name in _modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException):
                found.append(cls)
    names = {c.__name__ for c in found}
    # the ones the CLI used to name one by one, and the ones that escaped it
    assert {"JobError", "JobValidationError", "TemplateRowError", "ModelLoadError", "TokenizerError", "EngineError",
            "GrammarError", "OptionError", "Preempted"} <= names, names
    assert [c.__qualname__ for c in found if c not in NOT_ERRORS and not issubclass(c, BatchgenError)] == []
    from batchgen.pipeline import errors

    assert errors.BatchgenError is BatchgenError  # one class, re-exported where pipeline code looks for it


def test_jobs_never_imports_pipeline():
    for path in (ROOT / "jobs").glob("*.py"):
        text = path.read_text()
        assert "batchgen.pipeline" not in text and "pipeline" not in {w.strip(".") for w in text.split()}, path


def test_the_cli_catches_batchgen_errors_only():
    text = (ROOT / "pipeline" / "cli.py").read_text()
    guard = text[text.index("def _guard("):]
    guard = guard[:guard.index("\ndef ", 1)]
    assert "ValueError" not in guard and "except Exception" not in guard and "BatchgenError" in guard


@pytest.fixture(scope="module")
def bloom_dir(tmp_path_factory):
    """A tiny Bloom: transformers runs it, but its attention bypasses the attention interface
    batchgen's engine runs every layer through: its model type is off the allow-list
    (`hf_support`), and the probe forward refuses it too (EngineError)."""
    import transformers as T
    from tests.helpers.tiny_tokenizer import make_tokenizer

    d = tmp_path_factory.mktemp("tiny-bloom")
    config = T.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    return d


def test_an_unsupported_model_is_one_line(tmp_path, bloom_dir):
    src = tmp_path / "jobs.jsonl"
    src.write_text('{"prompt": "hello there"}\n')
    res = CliRunner().invoke(main, ["process", str(src), "-o", str(tmp_path / "out.parquet"), "--max-new-tokens",
                                    "2", "--model", str(bloom_dir)])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: model '{bloom_dir}': model type 'bloom' is not "
                                                   "supported: its attention (ALiBi)"), res.output
    assert "Traceback" not in res.output


def test_the_probe_refuses_an_attention_that_bypasses_the_interface(bloom_dir, monkeypatch):
    import transformers as T

    from batchgen.pipeline.engine.engine import Engine, EngineError
    from batchgen.pipeline.model import hf_support

    model = T.AutoModelForCausalLM.from_pretrained(bloom_dir)
    with pytest.raises(EngineError, match="^BloomForCausalLM: model type 'bloom' is not supported"):
        Engine(model)  # in memory, as from the Python API: the allow-list
    monkeypatch.setattr(hf_support, "SUPPORTED", hf_support.SUPPORTED | {"bloom"})
    with pytest.raises(EngineError, match="^BloomForCausalLM: its attention cannot run through batchgen's"):
        Engine(model)  # were it listed, the probe forward (its ALiBi bias meets the mask's rule there)


def test_options_are_named_as_the_face_that_was_called_spells_them():
    from batchgen.jobs.errors import OptionError, keyword_option, option, option_names

    assert option("output", "o.parquet") == "-o o.parquet" and option("overwrite") == "--overwrite"
    assert option("json_schema") == "--json-schema" and option("stop_token_ids") == "--stop-token-id"
    with option_names(keyword_option):
        assert option("output", "o.parquet") == "output='o.parquet'" and option("overwrite") == "overwrite=True"
        assert option("json_schema") == "json_schema="
        assert option("server") == "servers=" and option("vllm_arg") == "vllm_args="  # the API's plural keywords
        assert str(OptionError("shard", "need 0 <= I < N", "3/2")) == "shard='3/2': need 0 <= I < N"
    assert option("overwrite") == "--overwrite"  # the face's spelling ends with its call
    assert str(OptionError("json_schema", "cannot be used: bad")) == "--json-schema cannot be used: bad"


def test_an_option_error_survives_pickling():  # how a Ray worker's error reaches the driver
    import pickle

    from batchgen.jobs.errors import OptionError

    e = pickle.loads(pickle.dumps(OptionError("device", "unknown device", "gpu-please")))
    assert (e.name, e.reason, e.value, str(e)) == ("device", "unknown device", "gpu-please",
                                                   "--device gpu-please: unknown device")
