"""Jobs in and results out in the caller's own type: a list of dicts, a pandas DataFrame, a
`datasets.Dataset`, or file paths (read exactly as the CLI reads them; results come back as a
list of dicts). Rows become the readers' records, so they are validated by the same code."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping

import pyarrow as pa

from batchgen.jobs import JobError, Location
from batchgen.jobs.writers import conform_rows

ERROR = "error"  # the results' extra column: why a job failed (null for those that ran)


@dataclass
class Source:
    kind: str  # "list", "pandas", "dataset" or "files"
    records: list[tuple[Location, Any]]  # (where, row or the reason it is not one); empty for files
    hint: pa.Schema | None = None  # column types of a typed input (kept in the results)
    paths: list[str] | None = None


def _is(obj: Any, module: str, name: str) -> bool:
    """isinstance without importing pandas or datasets for callers that use neither."""
    mod = sys.modules.get(module)
    return mod is not None and isinstance(obj, getattr(mod, name))


def source_of(jobs: Any) -> Source:
    if isinstance(jobs, (str, os.PathLike)):
        return Source("files", [], paths=[os.fspath(jobs)])
    if isinstance(jobs, (list, tuple)) and jobs and all(isinstance(j, (str, os.PathLike)) for j in jobs):
        return Source("files", [], paths=[os.fspath(j) for j in jobs])
    if _is(jobs, "pandas", "DataFrame"):
        table = pa.Table.from_pandas(jobs, preserve_index=False)  # NaN becomes null: "use the default"
        return Source("pandas", _records("dataframe", table.to_pylist()), table.schema)
    if _is(jobs, "datasets", "Dataset"):
        table = jobs.with_format("arrow")[:] if len(jobs) else jobs.data.table.slice(0, 0)
        return Source("dataset", _records("dataset", table.to_pylist()), table.schema)
    if isinstance(jobs, (list, tuple)):
        return Source("list", _records("jobs", jobs))
    raise JobError(f"jobs must be a list of dicts, a pandas DataFrame, a datasets.Dataset or file paths; "
                   f"got {type(jobs).__name__}")


def _records(label: str, rows: Any) -> list[tuple[Location, Any]]:
    return [(Location(label, row=i), dict(r) if isinstance(r, Mapping) else
             f"expected a dict, got {type(r).__name__}") for i, r in enumerate(rows)]


def results_as(source: Source, rows: list[dict[str, Any]], schema: pa.Schema) -> Any:
    """Result rows (schema order, the error column last) in the type the jobs came in."""
    schema = schema.append(pa.field(ERROR, pa.string()))
    if source.kind in ("list", "files"):
        return [{name: r.get(name) for name in schema.names} for r in rows]
    # as the Parquet output holds them: a column of mixed values is JSON text
    table = pa.Table.from_pylist(conform_rows(rows, schema, required=False), schema=schema)
    if source.kind == "pandas":
        return table.to_pandas()
    import datasets

    return datasets.Dataset(table)
