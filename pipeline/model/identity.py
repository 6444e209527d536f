"""What makes a model "the same model" for resumed work (`model_identity`): finished work of a
run is resumed only where the model's files are the same, so that a checkpoint rewritten in place
between a crash and the rerun never mixes its completions with the old weights' ones.

- A local directory (and the embedded default model's converted directory): each file's name,
  size and content. Reading every byte of a model of many gigabytes at every start would cost
  seconds to minutes, so a large file's content is sampled: a safetensors file's header (every
  tensor's name, dtype, shape and offsets) and the first and last 4 KiB of every tensor's bytes
  (small tensors, as norms and biases, whole); any other large file's first MiB and 1,024 chunks
  spread over the rest. New weights (a fine-tune, another seed, another conversion) change every
  tensor's bytes, so they are another model; a copy of the same bytes on another machine, whose
  files have new modification times, is the same model (a Slurm job requeued on another node
  resumes). Files of up to 4 MiB (config, tokenizer, generation config, chat template, custom
  code) are hashed whole. The files are those directly in the directory, except hidden ones and
  `*.md` (documentation).
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

from batchgen.pipeline.model.decoder_config import header
from batchgen.pipeline.model.load import located

WHOLE = 4 << 20      # files up to this size are hashed whole
EDGE = 4096          # bytes hashed at each end of a safetensors tensor
HEAD = 1 << 20       # a large file of another kind: its first MiB ...
SAMPLES = 1024       # ... and this many chunks of EDGE bytes spread over the rest


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
            files.append((entry.name, st.st_size, _content(entry.path, st.st_size)))
    return "files " + hashlib.blake2b(json.dumps(files).encode(), digest_size=16).hexdigest()


def _content(path: str, size: int) -> str:
    """A digest of the file's content, sampled where it is large (module docstring)."""
    digest = hashlib.blake2b(digest_size=16)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return "unreadable"
    try:
        if size <= WHOLE:
            digest.update(os.pread(fd, size, 0))
        else:
            for start, length in _spans(path, size):
                digest.update(os.pread(fd, length, start))
    finally:
        os.close(fd)
    return digest.hexdigest()


def _spans(path: str, size: int) -> list[tuple[int, int]]:
    """The (offset, length) spans of a large file whose bytes are hashed."""
    if path.endswith(".safetensors"):
        try:
            data, tensors = header(path)
            spans = [(0, data)]  # the header: names, dtypes, shapes, offsets
            for name, info in sorted(tensors.items()):
                if name == "__metadata__":
                    continue
                begin, end = (data + int(o) for o in info["data_offsets"])
                if end - begin <= 2 * EDGE:
                    spans.append((begin, end - begin))
                else:
                    spans += [(begin, EDGE), (end - EDGE, EDGE)]
            return spans
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not a safetensors file after all: sampled as any other
    step = (size - HEAD) // SAMPLES
    return [(0, HEAD), *((HEAD + i * step, EDGE) for i in range(SAMPLES)), (size - EDGE, EDGE)]


def describe(identity: str | None) -> str:
    """How a refusal names what changed."""
    if identity is not None and identity.startswith("revision "):
        return "its hub revision"
    return "its files (a file's content or size, or which files it has)"

