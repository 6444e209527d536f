"""What makes a model "the same model" for resumed work (`model_identity`): finished work of a
run is resumed only where the model's files are the same, so that a checkpoint rewritten in place
between a crash and the rerun never mixes its completions with the old weights' ones.

- A local directory (and the embedded default model's converted directory): each file's name,
  size and modification time, as the packed-weight cache keys its files (`prepack._identity`).
  Hashing the weights' bytes would read every byte of a model of many gigabytes at every start;
  a rewrite (`save_pretrained`, a copy over it, a new conversion) gives new modification times
  even where the sizes stay. The files are those directly in the directory, except hidden ones
  and `*.md` (documentation): whatever a loader may read there (weights, config, tokenizer,
  generation config, chat template, custom code) counts.
- A hub id, from the local Hugging Face cache: the snapshot's revision (a commit hash on the hub,
  whose files never change), not its files: the cache fills a snapshot file by file as tools
  download them, and a revision names the same content whichever files are there.

Torch-free: computed before the weights load, and again after (a hub id's snapshot may be
downloaded or moved on by the load).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat

from batchgen.pipeline.model.load import located


def model_identity(name_or_path: str | None) -> str | None:
    """The identity of the model's files (module docstring), or None where they are not on this
    machine yet (a hub id not in the local cache: the load downloads it)."""
    where = located(name_or_path)
    if where is None:
        return None
    directory, from_hub = where
    if from_hub:
        return f"revision {directory.name}"
    files = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name.endswith(".md"):
            continue
        try:
            st = os.stat(entry.path)  # follows a link: the file it names
        except OSError:
            continue  # a dangling link: nothing a loader reads
        if stat.S_ISREG(st.st_mode):
            files.append((entry.name, st.st_size, st.st_mtime_ns))
    return "files " + hashlib.blake2b(json.dumps(files).encode(), digest_size=16).hexdigest()


def describe(identity: str | None) -> str:
    """How a refusal names what changed."""
    if identity is not None and identity.startswith("revision "):
        return "its hub revision"
    return "its files (a file's size or modification time, or which files it has)"

