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
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.jobs import JobError, write_summary
from batchgen.jobs.columns import ERROR_SCHEMA, ORDER  # ORDER: a row's position in the input, so the output keeps input order
from batchgen.jobs.writers import write_table

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


def job_set_key(digest: str, settings: dict[str, Any]) -> str:
    """What finished work belongs to: the job set (`digest`: every job with its input position,
    `preflight.job_digest`) and the settings. The same for every shard of one command line (so
    `merge` can check they belong together), and for the local and the Ray runner."""
    return fingerprint([digest], {k: v for k, v in settings.items() if k != "shard"})


def may_resume(where: str, recorded: Mapping[str, Any] | None, key: str, overwrite: bool,
               settings: Mapping[str, Any] | None = None) -> bool:
    """Whether the finished work recorded at `where` (its key and settings, None if there is none)
    belongs to this run (of `settings`). Work of other jobs, options, precision or model files is
    never mixed in: it is refused, or with `overwrite` the caller discards it (False)."""
    if not recorded or recorded.get("key") == key:
        return True
    if overwrite:
        return False
    raise JobError(f"{where} holds work of a run with other jobs, options or model "
                   f"({_what_differs(recorded.get('settings'), settings)}); "
                   "pass --overwrite to discard it and start over")


def _what_differs(then: Any, now: Mapping[str, Any] | None) -> str:
    """The refusal's reason: the model's files where only they changed, else the settings it ran."""
    ran = f"it ran {json.dumps(then, default=str)}"
    if not isinstance(then, dict) or now is None or "model_files" not in now:
        return ran
    if "model_files" not in then:  # written before batchgen recorded them: the model cannot be told apart
        return f"{ran}, and did not record which files of the model it ran"
    now = json.loads(json.dumps(now, default=str))  # as the manifest holds it (tuples as lists)
    rest = {k for k in then.keys() | now.keys() if k != "model_files" and then.get(k) != now.get(k)}
    if rest or then["model_files"] == now["model_files"]:
        return ran
    from batchgen.pipeline.model.identity import describe

    return (f"model {now.get('model')} is not the one it ran: {describe(now['model_files'])} changed since, "
            "so its completions would mix two models")


def read_manifest(parts_dir: str) -> dict[str, Any]:
    """The committed work recorded in `parts_dir` ({} if none)."""
    try:
        with open(os.path.join(parts_dir, MANIFEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise JobError(f"{parts_dir}/{MANIFEST} is unreadable ({e}); pass --overwrite to start over") from e


class PartStore:
    def __init__(self, output: str, key: str, settings: dict[str, Any], result_schema: pa.Schema,
                 *, discard_mismatch: bool = False) -> None:
        self.dir = output + ".parts"
        os.makedirs(self.dir, exist_ok=True)
        if os.path.islink(self.dir):
            # everything in it may be deleted (stray parts, --overwrite): never another directory
            raise JobError(f"{self.dir} is a symbolic link; remove it (batchgen keeps its parts in a real directory)")
        try:
            self._lock = os.open(os.path.join(self.dir, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise JobError(f"{self.dir}/.lock cannot be opened ({e.strerror}); remove it if it is a link") from e
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise JobError(f"{output}: another batchgen process is writing this output") from None
        try:
            self._open(key, settings, result_schema, discard_mismatch)
        except BaseException:
            os.close(self._lock)  # a refused run must not keep the output locked
            raise

    def _open(self, key: str, settings: dict[str, Any], result_schema: pa.Schema, discard_mismatch: bool) -> None:
        self.schema = result_schema.append(pa.field(ORDER, pa.int64()))
        try:
            self.manifest = read_manifest(self.dir)
            keep = may_resume(self.dir, self.manifest, key, discard_mismatch, settings)
        except JobError:
            if not discard_mismatch:
                raise
            keep = False  # --overwrite starts over, also from an unreadable manifest
        if not keep:
            self._wipe()
            self.manifest = {}
        if not self.manifest:
            self.manifest = {"key": key, "settings": settings, "parts": [], "stats": {}}
        self._clean_strays()

    def _wipe(self) -> None:
        for name in os.listdir(self.dir):
            if name != ".lock":
                _remove(os.path.join(self.dir, name))

    def _clean_strays(self) -> None:
        """Parts written but never named in the manifest died with their process: not committed."""
        named = {p for part in self.manifest["parts"] for p in part["files"]} | {MANIFEST, ".lock"}
        for name in os.listdir(self.dir):
            if name not in named:
                _remove(os.path.join(self.dir, name))

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.manifest.get("stats", {}))

    def done(self, positions: int) -> np.ndarray:
        """For each of `positions` input positions: whether it is committed, as results or errors."""
        done = np.zeros(positions, dtype=bool)
        for part in self.manifest["parts"]:
            for name in part["files"]:
                orders = pq.read_table(os.path.join(self.dir, name), columns=[ORDER])[ORDER].to_numpy()
                done[orders[orders < positions]] = True
        return done

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

    def files(self, stem: str) -> list[str]:
        """The committed files of one kind ("part" results or "errors"), in commit order."""
        return [os.path.join(self.dir, f) for part in self.manifest["parts"] for f in part["files"]
                if f.startswith(stem + "-")]

    def close(self) -> None:
        """Release the output (idempotent): every way out of a run calls it."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def remove(self) -> None:
        """The final output is in place: the parts are no longer needed."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)  # a link goes, never what it points to


def write_part(path: str, rows: list[dict[str, Any]], schema: pa.Schema,
               metadata: Mapping[str, str] | None = None) -> None:
    """A part exists whole or not at all (the one atomic writer), and a rewrite of the same part
    replaces it. Carried columns that Arrow cannot hold as they are become JSON text."""
    write_table(path, rows, schema.with_metadata(metadata) if metadata else schema)
