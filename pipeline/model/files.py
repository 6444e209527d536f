"""Where batchgen keeps model files, and the error for a model that cannot be located or loaded.

The lowest module of model loading: `load` (resolve + load), `default_model` (the GGUF
conversion) and `native` (its compiled kernels live in the same cache) all import it.
"""
from __future__ import annotations

import os
from pathlib import Path

from pipeline.errors import BatchgenError


class ModelLoadError(BatchgenError):
    """A model could not be located or loaded; the message says which and how to fix it."""


def cache_dir() -> Path:
    """Root of batchgen's cache: ``$BATCHGEN_CACHE_DIR`` or ``~/.cache/batchgen``."""
    env = os.environ.get("BATCHGEN_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchgen"
