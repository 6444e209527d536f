"""All prompts of a run as one sorted, front-coded array: the compressed trie, built over arrays.

Sorted lexicographically, prompts that share a prefix are neighbours, and each prompt's longest
common prefix with the one before it (its LCP) says where it branches off: the sorted order plus
the LCP array *is* the compressed trie (every shared prefix is a run of neighbours whose LCPs
reach its length). Held that way, a prompt keeps only its *tail*, the tokens after its LCP, so
the whole index takes the radix-tree lower bound in tokens (2 bytes each for vocabularies up to
65,536), not one Python node per token run per job.

It is built in runs: each run of jobs is sorted (keys are big-endian token bytes, so comparing
bytes compares token sequences) and front-coded, and the runs are merged; memory is that of the
tails, never of all prompts at once. The sort is stable: equal prompts keep their input order.

The engine's tree holds each prompt minus its last token. In the order sorted by whole prompts,
that sequence's LCP with its predecessor is min(LCP, either length - 1), and it is still the
largest LCP with any earlier prompt, so inserting in this order needs no comparison at all
(`PrefixTree.insert_next`). The same holds for any subsequence (a window, a shard, the jobs not
yet done), with the LCP of non-neighbours the minimum over the gap.

Jobs of different LoRA adapters share nothing (a prefix's keys and values depend on the adapter):
with adapters, the order is by adapter first, then by key, and a job's LCP with a neighbour of
another adapter is 0. Everything built on the LCPs (the engine's trees, windows, groups, shards,
`cached_tokens`, `batchgen plan`) then keeps adapters apart by itself.
"""
from __future__ import annotations

import array
import heapq
import struct
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from pipeline.engine.types import RequestShape, fed_length

RUN_JOBS = 1 << 16  # jobs per sorted run: their whole keys exist only while their run is sorted


def key_width(vocab_size: int) -> int:
    """Bytes a token takes in a key."""
    return 2 if vocab_size <= 1 << 16 else 4


_STRUCTS: dict[tuple[int, int], struct.Struct] = {}  # (width, tokens) -> its packer: compiled once


def pack_keys(prompts: Sequence[Sequence[int]], width: int) -> list[bytes]:
    """Each prompt's key: its ids as big-endian bytes of `width`, so that comparing keys compares
    token sequences. Straight from the ids with `struct`: faster than through an int64 array."""
    out = []
    try:
        for p in prompts:
            packer = _STRUCTS.get((width, len(p)))
            if packer is None:
                if len(_STRUCTS) >= 4096:
                    _STRUCTS.clear()
                packer = _STRUCTS[width, len(p)] = struct.Struct(f">{len(p)}{'H' if width == 2 else 'I'}")
            out.append(packer.pack(*p))
    except struct.error:
        raise ValueError(f"token ids outside 0..{(1 << (8 * width)) - 1}") from None
    return out


@dataclass
class _Run:
    """Jobs sorted by key, front-coded: each key is its predecessor's first `lcp` tokens + its tail."""

    jobs: array.array
    lcp: array.array
    tails: bytes
    ends: array.array  # byte offset where each tail ends

    def keys(self, width: int) -> Iterator[tuple[bytes, int]]:
        key, start = b"", 0
        for job, shared, end in zip(self.jobs, self.lcp, self.ends):
            key = key[: shared * width] + self.tails[start:end]
            start = end
            yield key, job


def _front_code(items: Iterator[tuple[bytes, int]], width: int, adapters: array.array | None = None) -> _Run:
    """(key, job) pairs in sorted order as a run. Two big-endian keys share the tokens before their
    first differing byte, which the highest set bit of their XOR (as ints) marks: found in C,
    without a loop over tokens. It is tried past the LCP before it first: neighbours in sorted
    order mostly share at least that much (one memcmp), and then only the rest is converted.
    `adapters` (by job): a job of another adapter than the one before it shares nothing with it."""
    jobs, lcps, ends = array.array("q"), array.array("l"), array.array("q")
    add_job, add_lcp, add_end = jobs.append, lcps.append, ends.append
    tails = bytearray()
    prev = b""
    hint = 0  # bytes the previous key shared with its predecessor
    last = None  # the previous job's adapter
    for key, job in items:
        if adapters is not None and adapters[job] != last:
            last, prev, hint = adapters[job], b"", 0  # as if it were the first key
        n = min(len(prev), len(key))
        if hint > n:
            hint = n - n % width
        if key.startswith(prev[:hint]):
            x = int.from_bytes(prev[hint:n], "big") ^ int.from_bytes(key[hint:n], "big")
            lcp = (n - (x.bit_length() + 7) // 8) // width
        else:
            x = int.from_bytes(prev[:hint], "big") ^ int.from_bytes(key[:hint], "big")
            lcp = (hint - (x.bit_length() + 7) // 8) // width
        tails += key[lcp * width :]
        add_job(job)
        add_lcp(lcp)
        add_end(len(tails))
        prev, hint = key, lcp * width
    return _Run(jobs, lcps, bytes(tails), ends)


class IndexBuilder:
    """Collects jobs' keys (with their requests' shapes) and builds the index."""

    def __init__(self, vocab_size: int, run_jobs: int = RUN_JOBS) -> None:
        self.width = key_width(vocab_size)
        self.dtype = np.dtype(">u2" if self.width == 2 else ">u4")
        self.run_jobs = run_jobs
        self._keys: list[bytes] = []
        self._runs: list[_Run] = []
        self._lengths = array.array("l")
        self._weights = array.array("l")
        self._adapters: array.array | None = None  # per job, once some job has one (else all 0)
        self._requests = array.array("l")  # per job: how many
        self._shapes = [array.array("l") for _ in RequestShape._fields]  # per request: each field

    def __len__(self) -> int:
        return len(self._lengths)

    def add(self, keys: Sequence[Sequence[int]], requests: Sequence[Sequence[RequestShape]],
            adapters: Sequence[int] | None = None) -> None:
        self.add_keys(pack_keys(keys, self.width), requests, adapters)

    def add_keys(self, keys: Sequence[bytes], requests: Sequence[Sequence[RequestShape]],
                 adapters: Sequence[int] | None = None) -> None:
        """Keys as `pack_keys` gives them (packed where they were tokenized, a batch at a time),
        each job's requests (`expand.index_entry`) and its adapter (None: all the base model's)."""
        if adapters is not None and self._adapters is None and any(adapters):
            self._adapters = array.array("l", bytes(len(self._lengths) * array.array("l").itemsize))
        if self._adapters is not None:
            self._adapters.extend(adapters if adapters is not None else [0] * len(keys))
        self._keys.extend(keys)
        shift = self.width.bit_length() - 1
        self._lengths.extend(len(k) >> shift for k in keys)
        self._weights.extend(sum(r.n for r in rs) for rs in requests)  # rows at the job's node
        self._requests.extend(len(rs) for rs in requests)
        flat = [r for rs in requests for r in rs]
        for column, values in zip(self._shapes, zip(*flat) if flat else [() for _ in self._shapes]):
            column.extend(values)
        if len(self._keys) >= self.run_jobs:
            self._seal()

    def _seal(self) -> None:
        first = len(self._lengths) - len(self._keys)
        keys, adapters = self._keys, self._adapters
        if adapters is None:
            order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: equal keys keep input order
        else:  # by adapter, then key
            order = sorted(range(len(keys)), key=lambda i: (adapters[first + i], keys[i]))
        self._runs.append(_front_code(((keys[i], first + i) for i in order), self.width, adapters))
        self._keys = []

    def build(self) -> "PrefixIndex":
        if self._keys:
            self._seal()
        runs, self._runs = self._runs, []
        if len(runs) == 1:
            merged = runs[0]
        elif self._adapters is None:  # ties compare job numbers: input order, as in one stable sort
            merged = _front_code(heapq.merge(*(r.keys(self.width) for r in runs)), self.width)
        else:
            adapters = self._adapters
            merged = _front_code(heapq.merge(*(r.keys(self.width) for r in runs),
                                             key=lambda kj: (adapters[kj[1]], kj)), self.width, adapters)
        del runs
        tails = np.frombuffer(merged.tails, dtype=self.dtype).astype(self.dtype.newbyteorder("="))
        ends = np.frombuffer(merged.ends, dtype=np.int64) // self.width
        # 4 bytes a job or request each (positions and offsets stay 8)
        first = np.zeros(len(self._requests) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self._requests, dtype=np.int64), out=first[1:])
        return PrefixIndex(np.asarray(merged.jobs, dtype=np.int32), np.asarray(merged.lcp, dtype=np.int32),
                           tails, ends, np.asarray(self._lengths, dtype=np.int32),
                           np.asarray(self._weights, dtype=np.int32), first,
                           RequestShape(*(np.asarray(c, dtype=np.int32) for c in self._shapes)),
                           np.asarray(self._adapters, dtype=np.int32) if self._adapters is not None else None)


@dataclass
class PrefixIndex:
    """Positions are places in the sorted order; jobs are numbers in the order keys were added. A
    job's key is its requests' shareable tokens plus one (`expand.index_entry`): a generating
    job's prompt."""

    order: np.ndarray  # position -> job
    lcp: np.ndarray  # position -> tokens shared with the key at the position before (0 at 0)
    tails: np.ndarray  # the tails, concatenated
    ends: np.ndarray  # position -> where its tail ends in `tails`
    lengths: np.ndarray  # job -> key tokens
    weights: np.ndarray  # job -> rows at its node of the tree (its requests' samples)
    first: np.ndarray  # job -> its first request (and first[-1]: all requests)
    shapes: RequestShape  # each field an array: request -> its value
    adapters: np.ndarray | None = None  # job -> its adapter's index (None: every job the base model's)

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], weights: Sequence[int] | None = None,
           max_new: Sequence[int] | None = None, vocab_size: int = 1 << 32, run_jobs: int = RUN_JOBS,
           requests: Sequence[Sequence[RequestShape]] | None = None,
           adapters: Sequence[int] | None = None) -> "PrefixIndex":
        """Keys and their jobs' requests; without `requests`, each key a generating job's prompt
        with `weights` samples (1) of `max_new` tokens (1)."""
        if requests is None:
            ns = weights if weights is not None else [1] * len(prompts)
            news = max_new if max_new is not None else [1] * len(prompts)
            requests = [[RequestShape(len(p), fed_length(len(p), m, None), m, n)] for p, n, m in zip(prompts, ns, news)]
        b = IndexBuilder(vocab_size, run_jobs)
        b.add(prompts, requests, adapters)
        return b.build()

    def __len__(self) -> int:
        return len(self.order)

    def requests_of(self, jobs: np.ndarray) -> tuple[np.ndarray, RequestShape]:
        """The requests of these jobs, in their order: where each job's start (and, last, their
        count), and each shape field as an array over them."""
        starts, counts = self.first[jobs], self.first[jobs + 1] - self.first[jobs]
        offsets = np.zeros(len(jobs) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        picked = np.repeat(starts - offsets[:-1], counts) + np.arange(offsets[-1])
        return offsets, RequestShape(*(c[picked] for c in self.shapes))

    def prompt_tokens(self, jobs: np.ndarray) -> np.ndarray:
        """Each job's prompt tokens, over its requests (what its result rows report)."""
        offsets, shapes = self.requests_of(jobs)
        total = np.zeros(len(shapes.prompt_tokens) + 1, dtype=np.int64)
        np.cumsum(shapes.prompt_tokens, out=total[1:])
        return total[offsets[1:]] - total[offsets[:-1]]

    def lower_bound(self) -> int:
        """The least prefill any prefix cache can do, batchgen's rules given: each distinct prefix
        of the keys' shareable tokens once, and what each request runs beyond them."""
        _, held = self.subset(np.arange(len(self)))
        own = self.shapes.fed.sum(dtype=np.int64) - (
            (self.lengths - 1).astype(np.int64) * np.diff(self.first)).sum()
        return int((self.lengths - 1).sum() - held.sum() + own)

    def subset(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For ascending positions: their jobs, and the LCP of the engine's sequences (prompt minus
        its last token) with the previous one of the subset (0 for the first)."""
        jobs = self.order[positions]
        held = np.zeros(len(positions), dtype=np.int64)
        if len(positions) > 1:
            # the LCP of p and q > p in sorted order: the minimum of lcp over (p, q]
            gap = np.minimum.reduceat(np.append(self.lcp, 0), positions + 1)[:-1]
            lengths = self.lengths[jobs] - 1
            held[1:] = np.minimum(np.minimum(gap, lengths[:-1]), lengths[1:])
        return jobs, held

    def head(self, position: int, n: int) -> list[int]:
        """The first `n` tokens of the prompt at `position` (all of it if shorter): from its own
        tail and, back through the ones before, the tails its LCPs point into."""
        n = min(n, int(self.lengths[self.order[position]]))
        pieces = []
        while n > 0:
            position = self._back_to(position, n)  # the prompt that holds token n - 1 in its tail
            shared = int(self.lcp[position])
            start = int(self.ends[position - 1]) if position else 0
            pieces.append(self.tails[start : start + n - shared])
            n, position = shared, position - 1
        return np.concatenate(pieces[::-1]).tolist() if pieces else []

    def _back_to(self, position: int, n: int) -> int:
        """The last position at or before `position` that shares fewer than `n` tokens with the
        one before it (0 shares none): searched backwards in growing blocks, not one by one."""
        hi, step = position + 1, 256
        while True:
            lo = max(0, hi - step)
            found = np.flatnonzero(self.lcp[lo:hi] < n)
            if len(found) or lo == 0:
                return lo + int(found[-1]) if len(found) else 0
            hi, step = lo, step * 2

    def prompts(self, positions: np.ndarray) -> Iterator[tuple[int, list[int]]]:
        """(job, prompt ids) at ascending positions, rebuilt from the tails in one forward pass.
        Consecutive prompts share the list items of their common head (one int object per token)."""
        if not len(positions):
            return
        start, stop = int(positions[0]), int(positions[-1]) + 1
        while start > 0 and self.lcp[start] > 0:  # back to a prompt stored whole
            start -= 1
        wanted = np.zeros(stop - start, dtype=bool)
        wanted[positions - start] = True
        key: list[int] = []
        begin = int(self.ends[start - 1]) if start else 0
        for block in range(start, stop, _BLOCK):  # numpy scalars are slow one by one: lists per block
            end_block = min(stop, block + _BLOCK)
            tails = self.tails[begin : int(self.ends[end_block - 1])].tolist()
            offset = begin
            for job, shared, end, want in zip(self.order[block:end_block].tolist(), self.lcp[block:end_block].tolist(),
                                              self.ends[block:end_block].tolist(),
                                              wanted[block - start : end_block - start].tolist()):
                key = key[:shared] + tails[begin - offset : end - offset]
                begin = end
                if want:
                    yield job, key


_BLOCK = 1 << 14
