"""An output never overwrites an input: before any work, the files a run writes are checked
against the files it reads.

A run writes its output, the errors file and the summary beside it, a temporary file next to
each (`.NAME.tmp-*`, removed by the cleanup after a crash), and keeps unfinished work in
`OUTPUT.parts/`, which it removes when done (and wipes with --overwrite). None of them may be an
input, nor may the output land in an input directory, whose part files a rerun would read with
it. Files are compared as the file system knows them (device and inode), so a symbolic link, a
hard link or another spelling of the path is the same file; directories by their real path.
"""
from __future__ import annotations

import os
from typing import Sequence

from batchgen.jobs import errors_path, remote, summary_path
from batchgen.jobs.atomic import temp_prefix
from batchgen.jobs.errors import OptionError

_KINDS = ("output", "errors file", "summary")


def check_apart(output: str, fmt: str, inputs: Sequence[str], store: str | None = None,
                reads: str = "input") -> None:
    """Refuse (OptionError, option "output") an output whose files would replace one of `inputs`.
    `store`: the directory the run keeps unfinished work in (OUTPUT.parts), if it has one;
    `reads`: what the inputs are called in the message (merge reads shards)."""
    written = dict(zip((output, errors_path(output, fmt), summary_path(output)), _KINDS))
    ids = {_file_id(path): (path, kind) for path, kind in written.items() if _file_id(path) is not None}
    for given in inputs:
        if remote.is_uri(given) or not os.path.exists(given):
            continue  # a remote input is never a local output; a missing one is reported by the reader
        if os.path.isdir(given):
            _check_directory(output, given, written, ids, reads)
        else:
            _check_file(output, given, written, ids, reads)
        if store is not None and _inside(given, store):
            raise OptionError("output", f"the {reads} {given} is inside {store}, where batchgen keeps unfinished "
                                        "work and removes it when done; move the input or choose another output",
                              output)


def check_directory_apart(out_dir: str, inputs: Sequence[str]) -> None:
    """The same for an output that is a directory batchgen fills (`--engine ray`): no input in it."""
    for given in inputs:
        if not remote.is_uri(given) and os.path.exists(given) and (_inside(given, out_dir)
                                                                   or _same_directory(given, out_dir)):
            raise OptionError("output", f"holds the input {given}: batchgen writes and replaces its parts "
                                        "there; an output never replaces an input, so choose another directory",
                              out_dir)


def _check_file(output: str, given: str, written: dict[str, str], ids: dict, reads: str) -> None:
    found = ids.get(_file_id(given))
    if found is not None:
        path, kind = found
        which = "is" if kind == "output" else f"has its {kind} {path}, which is"
        raise OptionError("output", f"{which} the {reads} {given} (the same file): an output never replaces "
                                    "an input; choose another output", output)
    for path, kind in written.items():
        # the cleanup after a crash removes the temporary files of the output's own files by name
        if _same_directory(os.path.dirname(given) or ".", os.path.dirname(path) or ".") \
                and os.path.basename(given).startswith(temp_prefix(path)):
            raise OptionError("output", f"the {reads} {given} has the name of a temporary file of the {kind} "
                                        f"({temp_prefix(path)}*), which batchgen removes; rename it", output)


def _check_directory(output: str, given: str, written: dict[str, str], ids: dict, reads: str) -> None:
    for path, kind in written.items():
        if _same_directory(os.path.dirname(path) or ".", given):
            which = "is" if kind == "output" else f"has its {kind} {path}"
            raise OptionError("output", f"{which} inside the {reads} directory {given}: a rerun would read it "
                                        "as input; write it elsewhere", output)
    if ids:  # an input's part file hard-linked to an output file elsewhere
        for entry in os.scandir(given):
            if entry.is_file():
                _check_file(output, entry.path, written, ids, reads)


def _file_id(path: str) -> tuple[int, int] | None:
    """The file `path` names (through links), as (device, inode); None if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _same_directory(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or under it (real paths: links resolved)."""
    real, top = os.path.realpath(path), os.path.realpath(directory)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)
