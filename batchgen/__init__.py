"""batchgen's Python API: batch generation over shared token prefixes, from a notebook or a data
pipeline, with the same validation and results as the `batchgen` command line.

    import batchgen
    out = batchgen.generate(dataset, max_new_tokens=64, json_schema=schema)   # Dataset in, Dataset out
    engine = batchgen.Engine.load("HuggingFaceTB/SmolLM2-360M-Instruct")      # a model kept loaded
    df = engine.generate(df, temperature=0.7, n=4)                            # DataFrame in, DataFrame out

`jobs/` (rows in, results out) and `pipeline/` (tokenizing, planning, the engine) are the
internals. Scoring (`batchgen.score`) will sit beside `generate` when it lands.
"""
from pipeline import __version__

from batchgen.api import Engine, generate
from jobs.errors import BatchgenError, OptionError

__all__ = ["BatchgenError", "Engine", "OptionError", "generate", "__version__"]
