"""Job input and result output for batchgen.

``schema`` validates rows into :class:`Job` records, ``readers`` streams them
from JSONL/Parquet/``datasets`` inputs, ``writers`` writes results atomically.
Nothing here imports torch or transformers, so the CLI can validate inputs fast; the package's names
load their modules on first use.
"""

from importlib import import_module

# name -> the module defining it, imported on first use (PEP 562): `batchgen` imports `batchgen.jobs.errors`
# on every start, and through this package's __init__ that pulled in pyarrow with the readers and writers,
# which the engine and the model code never need (a device run has no pyarrow: docs/gpu.md)
_WHERE = {
    **dict.fromkeys(["input_schema", "read_jobs"], "readers"),
    **dict.fromkeys(["GenerationDefaults", "InvalidRow", "Job", "JobError", "JobValidationError", "Location"], "schema"),
    **dict.fromkeys(["ErrorWriter", "JsonlWriter", "OpenAIBatchWriter", "OpenAIErrorWriter", "ParquetWriter",
                     "errors_path", "summary_path", "id_type_for", "infer_extra_schema", "open_result_writer",
                     "result_schema", "write_summary"], "writers"),
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ErrorWriter", "OpenAIErrorWriter", "GenerationDefaults", "InvalidRow", "Job", "JobError",
    "JobValidationError", "JsonlWriter", "Location", "OpenAIBatchWriter", "ParquetWriter",
    "errors_path", "summary_path", "id_type_for", "infer_extra_schema", "input_schema", "open_result_writer",
    "read_jobs", "result_schema", "write_summary",
]
