"""The one atomic, symlink-safe way batchgen writes a file.

Outputs, errors files, summaries, committed parts and manifests all go through
:class:`AtomicWriter`: it streams into a fresh temp file ``.{name}.tmp-XXXXXXXX`` next to the
target, created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` (``tempfile.mkstemp``) so a link planted in
a shared folder is never followed, then fsyncs it, ``os.replace``s it into place (replacing a
link at the target, never writing through it) and fsyncs the directory. A reader (or a rerun
deciding whether to skip work) never sees a half-written file.
"""

from __future__ import annotations

import functools
import glob
import gzip
import os
import tempfile
from typing import IO, Any, Iterable

from .errors import option
from .schema import JobError


@functools.cache
def _file_mode() -> int:
    # mkstemp creates files 0600; an output gets the mode any new file would (0666 minus umask)
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def temp_prefix(path: str) -> str:
    """The name of a temp file of `path` starts with this, in its directory."""
    return f".{os.path.basename(path)}.tmp-"


def remove_stale_temps(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Temp files left by a writer of exactly these targets whose process died. Only names built
    from these targets match (``.run.tmp-*`` for ``run``, never ``.run2.tmp-*``); call it only
    while no other process writes them (a run holds its output's lock)."""
    for path in map(os.fspath, paths):
        pattern = os.path.join(glob.escape(os.path.dirname(path) or "."), glob.escape(temp_prefix(path)) + "*")
        for stale in glob.glob(pattern):  # the pattern starts with a dot: hidden names match
            try:
                os.unlink(stale)  # a link is removed itself, its target is untouched
            except OSError:
                pass


class AtomicWriter:
    """Temp file next to the target; replaced into place only on a clean exit."""

    _allow_gzip = False  # only line formats; a gzipped Parquet file helps nobody

    def __init__(self, path: str | os.PathLike[str], overwrite: bool = False) -> None:
        self.path = os.fspath(path)
        if not os.path.basename(self.path):
            raise JobError(f"{self.path!r}: give an output file name, not a directory")
        if os.path.isdir(self.path):
            raise JobError(f"{self.path}: is a directory; give an output file name")
        if os.path.exists(self.path) and not overwrite:
            raise JobError(f"{self.path}: already exists; pass {option('overwrite')} to replace it")
        self.tmp_path: str | None = None
        self._file: IO[bytes] | None = None

    def __enter__(self) -> AtomicWriter:
        parent = os.path.dirname(self.path) or "."
        os.makedirs(parent, exist_ok=True)
        fd, self.tmp_path = tempfile.mkstemp(prefix=temp_prefix(self.path), dir=parent)
        self._raw = self._file = os.fdopen(fd, "wb")
        try:
            os.fchmod(fd, _file_mode())
        except BaseException:
            self._discard()
            raise
        if self._allow_gzip and self.path.endswith(".gz"):
            self._file = gzip.GzipFile(fileobj=self._raw, mode="wb")
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self._discard()
            return
        try:
            self._finish()
            if self._file is not self._raw:
                self._file.close()  # type: ignore[union-attr]
            self._raw.flush()
            os.fsync(self._raw.fileno())  # data on disk before the rename makes it visible
            self._raw.close()
            self._commit()
        except BaseException:
            self._discard()
            raise

    def _commit(self) -> None:
        os.replace(self.tmp_path, self.path)
        # fsync the directory so the rename itself survives a power loss.
        fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _discard(self) -> None:
        try:
            self._abort()
        except Exception:
            pass  # already failing; the original error is the one to report
        for f in (self._file, getattr(self, "_raw", None)):
            try:
                if f is not None:
                    f.close()
            except Exception:
                pass  # already failing; the original error is the one to report
        try:
            if self.tmp_path is not None:
                os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass

    def _finish(self) -> None:
        """Flush anything buffered into the temp file (subclasses)."""

    def _abort(self) -> None:
        """Release format-level state before the temp file is deleted (subclasses)."""


class WrittenIfAny(AtomicWriter):
    """An atomic file that exists only if something was written to it (`_empty` says whether
    nothing was): with nothing, no file is created, and with `overwrite` a file of an earlier run
    at the path is removed, so that it always tells of this run alone (an errors file)."""

    def __init__(self, path: str | os.PathLike[str], overwrite: bool = False) -> None:
        super().__init__(path, overwrite)
        self._overwrite = overwrite

    def _empty(self) -> bool:
        raise NotImplementedError

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None and self._empty():
            self._discard()
            if self._overwrite and os.path.lexists(self.path):
                os.unlink(self.path)
            return
        super().__exit__(exc_type, exc, tb)
