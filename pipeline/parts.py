"""Committed work of a run, so a crash or a preemption loses at most the work in flight.

`OUTPUT.parts/` holds one Parquet part per commit (finished jobs only, with their input order),
an errors part beside it, and `manifest.json`, replaced atomically after each part: a part is
committed once the manifest names it. A rerun with the same job set and options resumes from
the manifest; one with other options or another model refuses to mix outputs.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from jobs import JobError, write_summary
from jobs.writers import ERROR_SCHEMA

ORDER = "_batchgen_order"  # a row's position in the input, so the final output keeps input order
MANIFEST = "manifest.json"
ERROR_PART_SCHEMA = ERROR_SCHEMA.append(pa.field(ORDER, pa.int64()))


def fingerprint(items: Iterable[Any], settings: dict[str, Any]) -> str:
    """A hash of the job set (ids, prompts, parameters, carried columns) and the run's settings."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for item in items:
        h.update(json.dumps(item, sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


class PartStore:
    def __init__(self, output: str, key: str, settings: dict[str, Any], result_schema: pa.Schema,
                 *, discard_mismatch: bool = False) -> None:
        self.dir = output + ".parts"
        os.makedirs(self.dir, exist_ok=True)
        self._lock = open(os.path.join(self.dir, ".lock"), "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobError(f"{output}: another batchgen process is writing this output") from None
        try:
            self._open(key, settings, result_schema, discard_mismatch)
        except BaseException:
            self._lock.close()  # a refused run must not keep the output locked
            raise

    def _open(self, key: str, settings: dict[str, Any], result_schema: pa.Schema, discard_mismatch: bool) -> None:
        self.schema = result_schema.append(pa.field(ORDER, pa.int64()))
        self.manifest = self._load()
        if self.manifest and self.manifest["key"] != key:
            if not discard_mismatch:
                raise JobError(
                    f"{self.dir} holds work of a run with other jobs, options or model "
                    f"(it ran {json.dumps(self.manifest.get('settings'), default=str)}); "
                    "pass --overwrite to discard it and start over")
            self._wipe()
            self.manifest = {}
        if not self.manifest:
            self.manifest = {"key": key, "settings": settings, "parts": [], "stats": {}}
        self._clean_strays()

    def _load(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.dir, MANIFEST)) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise JobError(f"{self.dir}/{MANIFEST} is unreadable ({e}); pass --overwrite to start over") from e

    def _wipe(self) -> None:
        for name in os.listdir(self.dir):
            if name != ".lock":
                path = os.path.join(self.dir, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)

    def _clean_strays(self) -> None:
        """Parts written but never named in the manifest died with their process: not committed."""
        named = {p for part in self.manifest["parts"] for p in part["files"]} | {MANIFEST, ".lock"}
        for name in os.listdir(self.dir):
            if name not in named:
                os.unlink(os.path.join(self.dir, name))

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.manifest.get("stats", {}))

    def done(self) -> set[int]:
        """Input positions already committed, as results or as errors."""
        orders: set[int] = set()
        for part in self.manifest["parts"]:
            for name in part["files"]:
                orders.update(pq.read_table(os.path.join(self.dir, name), columns=[ORDER])[ORDER].to_pylist())
        return orders

    def commit(self, results: list[dict[str, Any]], errors: list[dict[str, Any]], stats: dict[str, int]) -> None:
        if not results and not errors:
            return
        index = len(self.manifest["parts"])
        files = []
        for rows, schema, stem in ((results, self.schema, "part"), (errors, ERROR_PART_SCHEMA, "errors")):
            if rows:
                name = f"{stem}-{index:06d}.parquet"
                write_part(os.path.join(self.dir, name), rows, schema)
                files.append(name)
        manifest = {**self.manifest, "parts": [*self.manifest["parts"], {"files": files}], "stats": stats}
        write_summary(os.path.join(self.dir, MANIFEST), manifest)  # atomic: the commit point
        self.manifest = manifest

    def results(self) -> pa.Table:
        tables = [pq.read_table(os.path.join(self.dir, f), schema=self.schema)
                  for part in self.manifest["parts"] for f in part["files"] if f.startswith("part-")]
        table = pa.concat_tables(tables) if tables else self.schema.empty_table()
        return table.sort_by(ORDER)

    def errors(self) -> list[dict[str, Any]]:
        rows = [r for part in self.manifest["parts"] for f in part["files"] if f.startswith("errors-")
                for r in pq.read_table(os.path.join(self.dir, f)).to_pylist()]
        return sorted(rows, key=lambda r: r[ORDER])

    def remove(self) -> None:
        """The final output is in place: the parts are no longer needed."""
        self._lock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def write_part(path: str, rows: list[dict[str, Any]], schema: pa.Schema) -> None:
    """Parquet written beside its name, then renamed: a part exists whole or not at all (and a
    rewrite of the same part replaces it)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    table = pa.Table.from_pylist(rows, schema=schema)
    with open(tmp, "wb") as f:
        pq.write_table(table, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
