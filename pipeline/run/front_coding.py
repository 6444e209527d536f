"""Sorted keys front-coded (pipeline/run/prefix_index.py): each key its predecessor's first LCP
tokens and its own tail; runs of them merged into one. Keys are big-endian token bytes, so
comparing bytes compares token sequences and a key pair's LCP is where their bytes first differ.
Neighbours' LCPs are found for many pairs at once (`_lcps`), not by a Python loop over keys.
"""
from __future__ import annotations

import array
import bisect
import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np


@dataclass
class Run:
    """Jobs sorted by key, front-coded: each key is its predecessor's first `lcp` tokens + its tail."""

    jobs: np.ndarray
    lcp: np.ndarray
    tails: bytes
    ends: np.ndarray  # byte offset where each tail ends

    def keys(self, width: int) -> Iterator[tuple[bytes, int]]:
        key, start, tails = b"", 0, self.tails
        for job, shared, end in zip(self.jobs.tolist(), (self.lcp * width).tolist(), self.ends.tolist()):
            key = key[:shared] + tails[start:end]
            start = end
            yield key, job


_BLOCK_KEYS = 2048  # keys compared together
_HEAD = 1024  # bytes of each key compared as a matrix (a longer common prefix: the rest one pair at a time)
_PADS = [bytes(k) for k in range(_HEAD + 1)]


def _lcps(keys: Sequence[bytes]) -> np.ndarray:
    """Each key's longest common prefix with the one before it, in bytes (0 for the first)."""
    out = np.zeros(len(keys), dtype=np.int64)
    for a in range(1, len(keys), _BLOCK_KEYS):
        b = min(len(keys), a + _BLOCK_KEYS)
        out[a:b] = _block_lcps(keys[a - 1 : b])
    return out


def _block_lcps(keys: Sequence[bytes]) -> np.ndarray:
    """The LCPs of each key after the first with the one before it: the keys' first bytes, padded
    to one width of 8-byte words, as a matrix whose neighbouring rows are compared at once; the
    first differing byte is the lowest set byte of a word's XOR (read little-endian)."""
    lengths = np.fromiter(map(len, keys), np.int64, len(keys))
    width = min(_HEAD, -(-int(lengths.max()) // 8) * 8) or 8
    pieces: list[bytes] = [b""] * (2 * len(keys))  # each key (its first `width` bytes), then its padding
    pieces[::2] = keys if width >= lengths.max() else [key[:width] for key in keys]
    pieces[1::2] = [_PADS[k] for k in np.maximum(width - lengths, 0).tolist()]
    data = b"".join(pieces)
    rows = np.frombuffer(data, dtype="<u8").reshape(len(keys), width // 8)
    diff = rows[1:] ^ rows[:-1]
    differ = diff != 0
    found = differ.any(axis=1)
    word = differ.argmax(axis=1)
    x = diff[np.arange(len(diff)), word]
    lowest = (x & (~x + np.uint64(1))).astype(np.float64)  # a power of two: its log2 is exact
    byte = np.where(found, np.log2(np.where(found, lowest, 1)).astype(np.int64) // 8, 0)
    common = np.minimum(lengths[1:], lengths[:-1])
    lcp = np.minimum(np.where(found, 8 * word + byte, width), common)
    for k in np.flatnonzero(~found & (common > width)).tolist():  # equal in the first `width` bytes
        m = int(common[k])
        x = int.from_bytes(keys[k][width:m], "big") ^ int.from_bytes(keys[k + 1][width:m], "big")
        lcp[k] = m - (x.bit_length() + 7) // 8
    return lcp


def front_code(keys: Sequence[bytes], jobs: np.ndarray, width: int, adapters: np.ndarray | None = None,
                before: bytes | None = None) -> Run:
    """Keys in sorted order, of these jobs, as a run; `before`: the key that comes before the first
    (None: none). `adapters` (by job): a job of another adapter than the one before it shares
    nothing with it (`before` is of the first job's adapter)."""
    shared = _lcps([before, *keys] if before is not None else keys)[1 if before is not None else 0:] // width
    if adapters is not None and len(jobs) > 1:
        mine = adapters[jobs]
        shared[1:][mine[1:] != mine[:-1]] = 0
    cut = (shared * width).tolist()
    tails = b"".join([key[c:] for key, c in zip(keys, cut)])
    ends = np.cumsum(np.fromiter(map(len, keys), np.int64, len(keys)) - shared * width)
    return Run(np.asarray(jobs, dtype=np.int64), shared, tails, ends)


_MERGE_BLOCK = 256  # keys of each run read ahead while merging


def merged(runs: Sequence[Run], width: int, adapters: np.ndarray | None = None) -> Run:
    """The runs merged into one, in (adapter, key, job) order: stable, ties in input order, as
    in one sort. A round reads the next keys of every run, takes from each those up to the
    least of the last ones read (no key still unread can come before them), sorts what it took
    (sorted runs: timsort merges them in C) and front-codes it after the round before."""
    def items(run: Run) -> Iterator[tuple]:
        if adapters is None:
            return ((key, job) for key, job in run.keys(width))
        return ((int(adapters[job]), key, job) for key, job in run.keys(width))

    streams = [items(r) for r in runs]
    ahead: list[list[tuple]] = [[] for _ in runs]
    done = [False] * len(runs)
    # the merged run grows in place (one buffer each, not a piece a round: the heap stays whole)
    jobs, lcps, ends, tails = array.array("q"), array.array("q"), array.array("q"), bytearray()
    before, last = None, None
    while True:
        for k, stream in enumerate(streams):
            if not done[k] and len(ahead[k]) < _MERGE_BLOCK:
                more = list(itertools.islice(stream, _MERGE_BLOCK))
                done[k] = len(more) < _MERGE_BLOCK
                ahead[k] += more
        if not any(ahead):
            break
        bounds = [a[-1] for a, d in zip(ahead, done) if a and not d]
        bound = min(bounds) if bounds else None
        taken = []
        for k, a in enumerate(ahead):
            cut = bisect.bisect_right(a, bound) if bound is not None else len(a)
            taken += a[:cut]
            ahead[k] = a[cut:]
        taken.sort()
        keys = [item[-2] for item in taken]
        mine = np.fromiter((item[-1] for item in taken), np.int64, len(taken))
        if adapters is not None and last is not None and taken[0][0] != last:
            before = None
        run = front_code(keys, mine, width, adapters, before)
        jobs.frombytes(run.jobs.tobytes())
        lcps.frombytes(run.lcp.astype(np.int64).tobytes())
        ends.frombytes((run.ends + len(tails)).tobytes())
        tails += run.tails
        before, last = keys[-1], taken[-1][0]
    return Run(np.frombuffer(jobs, np.int64), np.frombuffer(lcps, np.int64), bytes(tails), np.frombuffer(ends, np.int64))
