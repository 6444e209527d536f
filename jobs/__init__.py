"""Job input and result output for batchgen.

``schema`` validates rows into :class:`Job` records, ``readers`` streams them
from JSONL/Parquet/``datasets`` inputs, ``writers`` writes results atomically.
Nothing here imports torch or transformers, so the CLI can validate inputs fast.
"""

from .readers import input_schema, read_jobs
from .schema import (GenerationDefaults, InvalidRow, Job, JobError, JobValidationError,
                     Location)
from .writers import (ErrorWriter, JsonlWriter, OpenAIBatchWriter, OpenAIErrorWriter, ParquetWriter,
                      errors_path, summary_path, id_type_for, infer_extra_schema, open_result_writer,
                      result_schema, write_summary)

__all__ = [
    "ErrorWriter", "OpenAIErrorWriter", "GenerationDefaults", "InvalidRow", "Job", "JobError",
    "JobValidationError", "JsonlWriter", "Location", "OpenAIBatchWriter", "ParquetWriter",
    "errors_path", "summary_path", "id_type_for", "infer_extra_schema", "input_schema", "open_result_writer",
    "read_jobs", "result_schema", "write_summary",
]
