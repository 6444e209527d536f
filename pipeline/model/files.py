"""Where batchgen keeps model files, and the error for a model that cannot be located or loaded.

The lowest module of model loading: `load` (resolve + load), `default_model` (the GGUF
conversion) and `native` (its compiled kernels live in the same cache) all import it.
"""
from __future__ import annotations

from batchgen.pipeline.paths import cache_dir  # noqa: F401  (the model layer's files live under it)
from batchgen.pipeline.errors import BatchgenError


class ModelLoadError(BatchgenError):
    """A model could not be located or loaded; the message says which and how to fix it."""


