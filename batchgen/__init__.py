"""batchgen's Python API: batch generation over shared token prefixes, from a notebook or a data
pipeline, with the same validation and results as the `batchgen` command line.

    import batchgen
    out = batchgen.generate(dataset, max_new_tokens=64, json_schema=schema)   # Dataset in, Dataset out
    engine = batchgen.Engine.load("HuggingFaceTB/SmolLM2-360M-Instruct")      # a model kept loaded
    df = engine.generate(df, temperature=0.7, n=4)                            # DataFrame in, DataFrame out

`batchgen.jobs` (rows in, results out; the repository's `jobs/`) and `batchgen.pipeline`
(tokenizing, planning, the engine; `pipeline/`) are the internals, installed under this package
only (pyproject's package-dir), so a user's own `jobs.py` or `pipeline.py` never shadows them.
"""
from batchgen.jobs.errors import BatchgenError, OptionError
from batchgen.pipeline import __version__

__all__ = ["BatchgenError", "Engine", "OptionError", "ServedEngine", "generate", "__version__"]


def __getattr__(name: str):
    # the API (pyarrow, the readers) loads on first use: `python -m batchgen` and every
    # `batchgen.pipeline` import pass through this package and need none of it
    if name in ("Engine", "generate"):
        from batchgen import api

        return getattr(api, name)
    if name == "ServedEngine":
        from batchgen.served import ServedEngine

        return ServedEngine
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
