"""Token ids packed as bytes, and texts tokenized through the ids of their pieces between stable cuts.

Ids are packed big-endian, `key_width` bytes each, so that comparing packed ids compares the id
sequences (what the prefix index sorts: pipeline/run/prefix_index.py); `batchgen plan` and
`validate` keep a prompt's ids that way from the tokenizer on, never as a Python list.

A stable cut (pipeline/text/prefix_tokens.py) splits a text's ids exactly: `ids(T) = ids(T[:c]) +
ids(T[c:])`, each part tokenized alone without special tokens. A stable cut of T[c:] at c' is one
of T at c + c' too (the same characters decide it, and an added token found near it in T[c:] is
one found in T), so cutting at every stable cut in turn splits T's ids into its pieces' ids: T[:c1]
tokenized alone, then T[c1:c2] alone, and so on. The pieces are mostly words (" country"); their ids
are kept (`Pieces`, bounded) and a text is tokenized by looking its pieces up, the Rust encoder
running only on pieces not met before. Where it is cheap to tell, that is: a text in which every
space follows a character that is not whitespace (no `\\s ` in it), no guarded added token occurs,
and which does not start with a space, cuts at every space; any other text is tokenized whole.
"""
from __future__ import annotations

import re
import struct
from typing import Any, Sequence

import numpy as np

_STRUCTS: dict[tuple[int, int], struct.Struct] = {}  # (width, ids) -> its packer: compiled once
_UNSAFE = re.compile(r"\s ")  # a space after whitespace, which is no cut
_MAX_PIECES = 1 << 15  # pieces kept (then the newer half stays)
_MAX_PIECE_CHARS = 128  # a longer piece is tokenized but not kept (it is rarely met again)


def key_width(vocab_size: int) -> int:
    """Bytes a token id takes packed."""
    return 2 if vocab_size <= 1 << 16 else 4


def pack_ids(ids: Sequence[int], width: int) -> bytes:
    """Ids as big-endian bytes of `width` (struct.error for an id outside them). Straight from the
    ids with `struct`: faster than through an array."""
    packer = _STRUCTS.get((width, len(ids)))
    if packer is None:
        if len(_STRUCTS) >= 4096:
            _STRUCTS.clear()
        packer = _STRUCTS[width, len(ids)] = struct.Struct(f">{len(ids)}{'H' if width == 2 else 'I'}")
    return packer.pack(*ids)


def unpack_ids(packed: bytes, width: int) -> list[int]:
    return np.frombuffer(packed, dtype=">u2" if width == 2 else ">u4").tolist()


class Pieces:
    """The packed ids of pieces between stable cuts, and texts tokenized through them. Not
    thread-safe: its caller holds a lock (`PrefixTokens`)."""

    def __init__(self, guarded: tuple[str, ...], width: int) -> None:
        self.guarded, self.width = guarded, width
        self._spaced: dict[str, bytes] = {}  # "word" -> the ids of " word" tokenized alone
        self._bare: dict[str, bytes] = {}  # a text's first piece -> its ids tokenized alone

    def encode(self, backend: Any, texts: Sequence[str], starts: Sequence[int]) -> list[bytes]:
        """Each text's ids from `starts[k]` (0, or a stable cut of it: a space), without special
        tokens, packed: what `backend.encode_batch_fast([t[s:] ...], add_special_tokens=False)` gives."""
        spaced, bare, unsafe, guarded = self._spaced, self._bare, _UNSAFE.search, self.guarded
        out: list[bytes] = [b""] * len(texts)
        alone: list[int] = []  # tokenized whole
        pending: list[tuple[int, list[str]]] = []  # with pieces not met before
        for k, (text, start) in enumerate(zip(texts, starts)):
            rest = text[start:] if start else text
            if not rest:
                continue
            if unsafe(rest) or (not start and rest[0] == " ") or (guarded and any(g in text for g in guarded)):
                alone.append(k)
                continue
            parts = rest.split(" ")  # a rest from a cut starts with its space: parts[0] is ""
            try:
                out[k] = (bare[parts[0]] if start == 0 else b"") + b"".join(map(spaced.__getitem__, parts[1:]))
            except KeyError:
                pending.append((k, parts))
        if not pending and not alone:
            return out
        # the pieces not met before, tokenized alone (a rest's parts[0] is "": " " is tokenized too)
        new_spaced = list({p for k, parts in pending for p in (parts if starts[k] else parts[1:]) if p not in spaced})
        new_bare = list({parts[0] for k, parts in pending if not starts[k] and parts[0] not in bare})
        todo = [" " + p for p in new_spaced] + new_bare + [texts[k][starts[k]:] for k in alone]
        packed = [pack_ids(e.ids, self.width) for e in backend.encode_batch_fast(todo, add_special_tokens=False)]
        spaced.update(zip(new_spaced, packed))
        bare.update(zip(new_bare, packed[len(new_spaced):]))
        for k, ids in zip(alone, packed[len(new_spaced) + len(new_bare):]):
            out[k] = ids
        for k, parts in pending:
            out[k] = (bare[parts[0]] if starts[k] == 0 else b"") + b"".join(map(spaced.__getitem__, parts[1:]))
        _bound(spaced, new_spaced)
        _bound(bare, new_bare)
        return out


def _bound(cache: dict[str, bytes], new: list[str]) -> None:
    """Drop the new pieces too long to keep, and the older half once there are too many."""
    for p in new:
        if len(p) > _MAX_PIECE_CHARS:
            del cache[p]
    if len(cache) > _MAX_PIECES:  # (entries are in the order they were put)
        kept = list(cache.items())[len(cache) // 2:]
        cache.clear()
        cache.update(kept)
