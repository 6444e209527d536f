"""Where batchgen keeps what it makes once and reuses (the default model's conversion, compiled
kernels, tokenizer records): one root, below every layer that caches something."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of batchgen's cache: ``$BATCHGEN_CACHE_DIR`` or ``~/.cache/batchgen``."""
    env = os.environ.get("BATCHGEN_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchgen"
