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
import struct
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from batchgen.pipeline.engine.types import RequestShape, fed_length
from batchgen.pipeline.run.front_coding import front_code, merged
from batchgen.pipeline.text.pieces import key_width, pack_ids

RUN_JOBS = 1 << 16  # jobs per sorted run: their whole keys exist only while their run is sorted


def pack_keys(prompts: Sequence[Sequence[int]], width: int) -> list[bytes]:
    """Each prompt's key: its ids as big-endian bytes of `width` (`pieces.pack_ids`), so that
    comparing keys compares token sequences."""
    try:
        return [pack_ids(p, width) for p in prompts]
    except struct.error:
        raise ValueError(f"token ids outside 0..{(1 << (8 * width)) - 1}") from None


@dataclass
class Entries:
    """Jobs' index entries as columns: each job's key (`pack_keys`), its requests (how many, and
    each one's shape, in job order) and its adapter (None: every job the base model's)."""

    keys: list[bytes]
    counts: np.ndarray  # job -> its requests
    shapes: RequestShape  # each field an int64 array over the requests
    adapters: np.ndarray | None = None

    @classmethod
    def of(cls, keys: list[bytes], requests: Sequence[Sequence[RequestShape]],
           adapters: Sequence[int] | None = None) -> "Entries":
        flat = [r for rs in requests for r in rs]
        columns = zip(*flat) if flat else [() for _ in RequestShape._fields]
        return cls(keys, np.fromiter(map(len, requests), np.int64, len(requests)),
                   RequestShape(*(np.asarray(c, dtype=np.int64) for c in columns)),
                   np.asarray(adapters, dtype=np.int64) if adapters is not None else None)

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, jobs: np.ndarray) -> "Entries":
        """These jobs' entries, in this order."""
        first = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=first[1:])
        counts = self.counts[jobs]
        picked = np.repeat(first[jobs] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        return Entries([self.keys[j] for j in jobs.tolist()], counts, RequestShape(*(c[picked] for c in self.shapes)),
                       self.adapters[jobs] if self.adapters is not None else None)

    @staticmethod
    def concat(parts: Sequence["Entries"]) -> "Entries":
        adapters = None
        if any(e.adapters is not None for e in parts):
            adapters = np.concatenate([e.adapters if e.adapters is not None else np.zeros(len(e), np.int64)
                                       for e in parts])
        return Entries([k for e in parts for k in e.keys], np.concatenate([e.counts for e in parts]),
                       RequestShape(*(np.concatenate(c) for c in zip(*(e.shapes for e in parts)))), adapters)


class IndexBuilder:
    """Collects jobs' keys (with their requests' shapes) and builds the index."""

    def __init__(self, vocab_size: int, run_jobs: int = RUN_JOBS) -> None:
        self.width = key_width(vocab_size)
        self.dtype = np.dtype(">u2" if self.width == 2 else ">u4")
        self.run_jobs = run_jobs
        self._keys: list[bytes] = []
        self._runs: list = []  # front_coding.Run
        self._jobs = 0
        # per job (lengths, weights, requests, adapters) and per request (shapes): arrays, a batch each
        self._lengths: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []
        self._adapters: array.array | None = None  # per job, once some job has one (else all 0)
        self._requests: list[np.ndarray] = []
        self._shapes: list[RequestShape] = []

    def __len__(self) -> int:
        return self._jobs

    def add(self, keys: Sequence[Sequence[int]], requests: Sequence[Sequence[RequestShape]],
            adapters: Sequence[int] | None = None) -> None:
        self.add_keys(pack_keys(keys, self.width), requests, adapters)

    def add_keys(self, keys: Sequence[bytes], requests: Sequence[Sequence[RequestShape]],
                 adapters: Sequence[int] | None = None) -> None:
        """Keys as `pack_keys` gives them (packed where they were tokenized, a batch at a time),
        each job's requests (`expand.index_entry`) and its adapter (None: all the base model's)."""
        self.add_entries(Entries.of(list(keys), requests, adapters))

    def add_entries(self, entries: Entries) -> None:
        """Jobs' entries as columns."""
        keys, adapters = entries.keys, entries.adapters
        if adapters is not None and self._adapters is None and adapters.any():
            self._adapters = array.array("q", bytes(self._jobs * 8))
        if self._adapters is not None:
            self._adapters.frombytes((adapters if adapters is not None else np.zeros(len(keys), np.int64))
                                     .astype(np.int64).tobytes())
        self._keys.extend(keys)
        shift = self.width.bit_length() - 1
        self._lengths.append((np.fromiter(map(len, keys), np.int64, len(keys)) >> shift).astype(np.int32))
        owner = np.repeat(np.arange(len(keys)), entries.counts)  # (rows at the job's node: its requests' samples)
        self._weights.append(np.bincount(owner, weights=entries.shapes.n, minlength=len(keys)).astype(np.int32))
        self._requests.append(entries.counts.astype(np.int32))
        self._shapes.append(RequestShape(*(c.astype(np.int32) for c in entries.shapes)))  # 4 bytes each
        self._jobs += len(keys)
        if len(self._keys) >= self.run_jobs:
            self._seal()

    def _seal(self) -> None:
        first = self._jobs - len(self._keys)
        keys, adapters = self._keys, self._adapters
        if adapters is None:
            order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: equal keys keep input order
        else:  # by adapter, then key
            order = sorted(range(len(keys)), key=lambda i: (adapters[first + i], keys[i]))
        mine = np.asarray(adapters, dtype=np.int64) if adapters is not None else None
        self._runs.append(front_code([keys[i] for i in order], first + np.asarray(order, dtype=np.int64), self.width,
                                      mine))
        self._keys = []

    def build(self) -> "PrefixIndex":
        if self._keys:
            self._seal()
        runs, self._runs = self._runs, []
        adapters = np.asarray(self._adapters, dtype=np.int64) if self._adapters is not None else None
        run = runs[0] if len(runs) == 1 else merged(runs, self.width, adapters)
        del runs
        tails = np.frombuffer(run.tails, dtype=self.dtype).astype(self.dtype.newbyteorder("="))
        ends = run.ends // self.width
        # 4 bytes a job or request each (positions and offsets stay 8)
        requests = _joined(self._requests)
        first = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(requests, out=first[1:])
        shapes = RequestShape(*(_joined(c) for c in zip(*self._shapes))) if self._shapes \
            else RequestShape(*(np.zeros(0, np.int32) for _ in RequestShape._fields))
        return PrefixIndex(np.asarray(run.jobs, dtype=np.int32), np.asarray(run.lcp, dtype=np.int32),
                           tails, ends, _joined(self._lengths), _joined(self._weights), first, shapes,
                           np.asarray(self._adapters, dtype=np.int32) if self._adapters is not None else None)


def _joined(chunks: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(chunks) if chunks else np.zeros(0, np.int32)


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
