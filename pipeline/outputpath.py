"""The output path, checked before any work: a name, a format and a place the run can finish with
(`check_output`, called by `process` and the Python API before the model loads)."""
from __future__ import annotations

import os
import tempfile

from jobs import JobError

_PARQUET_NAMES = (".parquet", ".pq")
_LINE_NAMES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
_UNSUPPORTED_COMPRESSION = (".zst", ".zstd", ".bz2", ".xz", ".lz4")


def check_output(output: str, fmt: str, overwrite: bool) -> None:
    """Refuse an output path the run could not finish with, before any model work."""
    name = os.path.basename(output)
    if not name:
        raise JobError(f"-o {output!r}: give an output file name")
    if os.path.isdir(output):
        raise JobError(f"-o {output}: is a directory; give an output file name")
    _check_suffix(output, fmt)
    parts = output + ".parts"
    if os.path.lexists(parts) and (os.path.islink(parts) or not os.path.isdir(parts)):
        raise JobError(f"{parts} is in the way (batchgen keeps unfinished work in a directory of that name); "
                       "remove it or choose another -o")
    if os.path.exists(output) and not overwrite and not os.path.isdir(parts):
        raise JobError(f"{output} already exists; pass --overwrite to replace it")
    _probe_writable(os.path.dirname(output) or ".", output)


def _check_suffix(output: str, fmt: str) -> None:
    lower = output.lower()
    if lower.endswith(_UNSUPPORTED_COMPRESSION):
        raise JobError(f"-o {output}: batchgen compresses output only as .gz (JSON Lines); name it .jsonl.gz")
    if lower.endswith(_PARQUET_NAMES) and fmt != "parquet":
        raise JobError(f"-o {output}: the name says Parquet but --output-format is {fmt}; "
                       f"name it .jsonl, or drop --output-format {fmt}")
    if lower.endswith(_LINE_NAMES) and fmt == "parquet":
        raise JobError(f"-o {output}: the name says JSON Lines but the output format is parquet; "
                       "pass --output-format jsonl (or openai), or name it .parquet")
    if lower.endswith(".gz") and fmt == "parquet":
        raise JobError(f"-o {output}: Parquet is compressed inside the file; drop the .gz")


def _probe_writable(parent: str, output: str) -> None:
    """Create and remove a temp file where the output will go (or in the nearest existing parent
    directory, which the run would create the rest under): a read-only or full place fails now."""
    where = parent
    while not os.path.exists(where):
        up = os.path.dirname(os.path.abspath(where))
        if up == os.path.abspath(where):
            break
        where = up
    if not os.path.isdir(where):
        raise JobError(f"-o {output}: {where} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(output)}.tmp-", dir=where)
    except OSError as e:
        raise JobError(f"-o {output}: cannot write in {where} ({e.strerror or e}); "
                       "choose a writable location") from None
    os.close(fd)
    os.unlink(probe)
