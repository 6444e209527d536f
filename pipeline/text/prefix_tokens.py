"""Shared text prefixes tokenized once, with exactly the ids of tokenizing each text whole.

Jobs share long text prefixes, yet a prefix cannot simply be tokenized alone: its last tokens may
merge with what follows. A *stable cut* is a character position c of a text T where, for every
continuation, `ids(T) = head + ids(T[:c]) + ids(T[c:]) + tail` (both parts without special tokens;
head and tail the post-processor's special tokens). `cut_rule` decides from the tokenizer's own
JSON whether it can name such cuts, and for which configurations that is proven; anything else
gets None and is tokenized whole, as before.

The cut: T[c] is a space (U+0020) and T[c-1] is not whitespace. Why it is stable, step by step
through the Rust tokenizer (tokenizers 0.23: added_vocabulary.rs, pre_tokenizers/*.rs):

- Added tokens are split off first, by a leftmost-longest Aho-Corasick scan. An occurrence of an
  added token lying across c contains T[c], a space: `guarded` lists the added tokens with a space
  (and those with rstrip, which swallow the whitespace after them); a cut near an occurrence of
  one is not taken. With none across c, the scan of T up to c is the scan of T[:c] (the candidates
  starting before c are the same and end by c), and from c on it is the scan of T[c:]. Its
  single_word test looks at the characters beside a match: a space at c reads as the end of the
  text does, and lstrip's whitespace run stops at T[c-1], which is not whitespace.
- No normalizer (any normalizer is refused), so the pieces between added tokens are T's text.
- ByteLevel with use_regex splits each piece by GPT-2's regex
  `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+` (onig,
  leftmost-first alternation, greedy). Every character starts a match (each character is a
  letter, a number, whitespace or another one), and the match at a position depends on the text
  from there on only (no look-behind, no anchors): so T's matches from c are T[c:]'s. The match
  covering T[c-1] (not whitespace) is a contraction literal, a letter, number or symbol run: none
  takes a space after its first character, so it ends at c, in T as in T[:c]. Every match
  starting before c reads no further than c, and what it reads there decides alike in both: a
  space at c stops a run or fails a literal as the end of T[:c] does; `\\s+(?!\\S)` (which the
  end of a text satisfies and a following letter does not) never reaches c, as T[c-1] is not
  whitespace. add_prefix_space puts a space before a piece that does not start with one: T[c:]
  starts with one. Byte mapping and the model (BPE, dropout off) work on each regex match alone.
- Metaspace (split=True) replaces every space by its replacement character and splits before
  each one (MergedWithNext): pieces end before T[c]'s replacement, in T as in T[:c], and T[c:]
  splits as T does from c. Its prepend scheme adds the replacement to a piece that does not
  start with it ("always"), only to the text's first one ("first"), or never: T[c:] starts with it.
- The post-processor: none, ByteLevel (offsets only), or TemplateProcessing of special tokens
  around the text's sequence (head before, tail after), alone or in a Sequence with ByteLevel.
  A probe checks head and tail against the tokenizer itself.

A slow tokenizer, special-token splitting (`split_special_tokens`), truncation or padding, other
pre-tokenizers, normalizers, models or post-processors: no cut, no reuse.
"""
from __future__ import annotations

import bisect
import json
import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from batchgen.pipeline.text.pieces import Pieces, pack_ids, unpack_ids

STEP = 128  # candidate cuts: the first stable cut at or after every STEP characters...
_TARGETS_UP_TO = 1 << 24
_MAX_PREFIXES = 4096  # cached prefixes (an LRU), and the characters and ids they may hold at most
_MAX_CHARS = 16 << 20
_MAX_IDS = 4 << 20
_MAX_SEEN = 1 << 16  # hashes of candidate prefixes seen in earlier batches


@dataclass(frozen=True)
class CutRule:
    kind: str  # the pre-tokenizer whose argument applies (the module's docstring)
    head: tuple[int, ...]  # the post-processor's special tokens before the text's ids
    tail: tuple[int, ...]  # and after them
    guarded: tuple[str, ...]  # added tokens that could lie across a cut: none may be near one

    def stable(self, text: str, c: int) -> bool:
        if c <= 0 or c >= len(text) or text[c] != " " or text[c - 1].isspace():
            return False
        # an occurrence overlapping T[c-1:c+1] lies within T[c-len:c+len]
        return not self.guarded or not any(text.find(g, max(0, c - len(g)), c + len(g)) >= 0 for g in self.guarded)

    def cut_from(self, text: str, start: int) -> int:
        """The first stable cut at or after `start`, or -1."""
        c = text.find(" ", max(start, 1))
        while c >= 0 and not self.stable(text, c):
            c = text.find(" ", c + 1)
        return c


def cut_rule(backend: Any) -> CutRule | None:
    """The stable cuts of this Rust tokenizer, set up as it encodes; None where none is proven."""
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a backend that cannot say what it is gets no cuts
        return None
    if refusal(spec) is not None or getattr(backend, "encode_special_tokens", True):
        return None
    head, tail = _template(spec["post_processor"])
    guarded = tuple(t["content"] for t in spec.get("added_tokens") or ()
                    if " " in t["content"] or t.get("rstrip"))
    rule = CutRule(spec["pre_tokenizer"]["type"], tuple(head), tuple(tail), guarded)
    probe = "Probe words, 12 of them."
    plain = backend.encode(probe, add_special_tokens=False).ids
    if backend.encode(probe, add_special_tokens=True).ids != [*head, *plain, *tail]:
        return None  # a post-processor that does not do what its JSON was read to say
    return rule


def refusal(spec: dict[str, Any]) -> str | None:
    """Why the tokenizer of this JSON gets no cuts, or None (the module's docstring proves those)."""
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return "truncation or padding"
    if spec.get("normalizer") is not None:
        return "a normalizer"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return "a model other than BPE without dropout"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("use_regex") is not True:
            return "ByteLevel without its regex"
    elif pre.get("type") == "Metaspace":
        if pre.get("split") is not True or pre.get("prepend_scheme") not in ("first", "always", "never") \
                or not isinstance(pre.get("replacement"), str) or len(pre["replacement"]) != 1:
            return "a Metaspace pre-tokenizer without split or a known prepend scheme"
    else:
        return f"the pre-tokenizer {pre.get('type')}"
    for t in spec.get("added_tokens") or ():
        if not isinstance(t.get("content"), str) or not t["content"]:
            return "an added token without text"
    try:
        _template(spec.get("post_processor"))
    except ValueError as e:
        return str(e)
    return None


def _template(post: dict[str, Any] | None) -> tuple[list[int], list[int]]:
    """The special tokens a post-processor puts before and after a single text's ids."""
    if post is None or post.get("type") == "ByteLevel":
        return [], []
    if post.get("type") == "Sequence":
        steps = post.get("processors") or []
        templates = [p for p in steps if p.get("type") != "ByteLevel"]
        if len(templates) > 1 or any(p.get("type") != "TemplateProcessing" for p in templates):
            raise ValueError("a post-processor sequence other than ByteLevel and one template")
        return _template(templates[0]) if templates else ([], [])
    if post.get("type") != "TemplateProcessing":
        raise ValueError(f"the post-processor {post.get('type')}")
    parts, specials = post.get("single") or [], post.get("special_tokens") or {}
    sequences = [k for k, p in enumerate(parts) if "Sequence" in p]
    if len(sequences) != 1 or parts[sequences[0]]["Sequence"].get("id") != "A":
        raise ValueError("a template without exactly the text's sequence")
    ids = []
    for p in parts:
        if "Sequence" in p:
            continue
        name = (p.get("SpecialToken") or {}).get("id")
        if name not in specials:
            raise ValueError("a template of unknown special tokens")
        ids.append(list(specials[name]["ids"]))
    k = sequences[0]
    return [i for part in ids[:k] for i in part], [i for part in ids[k:] for i in part]


_TARGETS: list[int] = []


def _targets(length: int, step: int) -> list[int]:
    """Where candidate cuts are looked for in a text of this length: every `step` characters up to
    8 steps, then every eighth of the way so far (a long text gets few candidates, each a prefix
    lost at most an eighth of its length)."""
    if step == STEP:
        if not _TARGETS:
            _TARGETS.extend(_spaced(_TARGETS_UP_TO, STEP))
        return _TARGETS[: bisect.bisect_left(_TARGETS, length)]
    return _spaced(length, step)


def _spaced(length: int, step: int) -> list[int]:
    out, t = [], step
    while t < length:
        out.append(t)
        t += max(step, t // 8)
    return out


class PrefixTokens:
    """Batches of texts tokenized through the ids of their shared prefixes, cut at stable cuts:
    a prefix shared by two texts of a batch, or met in an earlier one, is tokenized once and
    kept (an LRU bounded in prefixes, characters and ids); each text's rest is tokenized through
    its pieces (`pieces.Pieces`). Candidate cuts are few (`_targets`); a prefix several texts
    share is taken to the last stable cut they have in common, and found again from the candidate
    cut it extends. Ids are kept packed (`pieces.pack_ids`, `width` bytes each)."""

    def __init__(self, rule: CutRule, step: int = STEP, width: int = 4) -> None:
        self.rule, self.step, self.width = rule, step, width
        # prefix -> its packed ids, and the hash of the candidate prefix it extends (None: it is one)
        self._cache: OrderedDict[str, tuple[bytes, int | None]] = OrderedDict()
        self._longer: dict[int, list[str]] = {}  # candidate prefix's hash -> cached prefixes extending it
        self._chars = self._ids = 0
        self._seen: dict[int, None] = {}
        self._pieces = Pieces(rule.guarded, width)
        self._head, self._tail = pack_ids(rule.head, width), pack_ids(rule.tail, width)
        self._lock = threading.Lock()  # the caches are one Tokenizer's, which threads may share

    def encode(self, backend: Any, texts: Sequence[str], special: bool, want_ids: bool
               ) -> tuple[list[int], list[list[int]] | None]:
        """Each text's token count, and with `want_ids` its ids: what
        `backend.encode_batch_fast(texts, add_special_tokens=special)` gives."""
        packed = self.encode_packed(backend, texts, special)
        shift = self.width.bit_length() - 1
        ids = [unpack_ids(p, self.width) for p in packed] if want_ids else None
        return [len(p) >> shift for p in packed], ids

    def encode_packed(self, backend: Any, texts: Sequence[str], special: bool) -> list[bytes]:
        """Each text's ids as `encode` gives them, packed."""
        with self._lock:  # (the Rust encoder's calls too: the caches change after them)
            found = self._lookup(backend, texts)
            rests = self._pieces.encode(backend, texts, [f[0] if f is not None else 0 for f in found])
        head, tail = (self._head, self._tail) if special else (b"", b"")
        return [head + (f[1] if f is not None else b"") + rest + tail for f, rest in zip(found, rests)]

    def _lookup(self, backend: Any, texts: Sequence[str]) -> list[tuple[int, bytes] | None]:
        """Per text, the longest cached prefix it starts with, ending at a stable cut of it
        (tokenizing now the prefixes worth it), with the prefix's ids; None: tokenize it whole."""
        found: list[tuple[int, bytes] | None] = [None] * len(texts)
        cache, longer, stable, cut_from, misses = self._cache, self._longer, self.rule.stable, self.rule.cut_from, []
        hits: dict[str, None] = {}  # moved to the LRU's end once per batch
        for k, text in enumerate(texts):
            keys, last = [], len(text)
            for target in reversed(_targets(len(text), self.step)):  # longest first
                c = cut_from(text, target)
                if c < 0 or c >= last:  # none, or the same cut as the longer target's
                    continue
                last = c
                key = text[:c]
                hit = key if key in cache else None
                # a longer prefix ends where this text may go on otherwise: its cut must be stable here too
                for p in longer.get(hash(key), ()):
                    if text.startswith(p) and stable(text, len(p)):
                        hit = p
                        break
                if hit is not None:
                    hits[hit] = None
                    found[k] = (len(hit), cache[hit][0])
                    break
                keys.append(key)
            else:
                if keys:
                    misses.append((k, keys))
        for hit in hits:
            cache.move_to_end(hit)
        if misses:
            self._tokenize_shared(backend, texts, misses, found)
        return found

    def _tokenize_shared(self, backend: Any, texts: Sequence[str], misses: list[tuple[int, list[str]]],
                         found: list[tuple[int, bytes] | None]) -> None:
        """A missed prefix is worth tokenizing when another text of this batch has it too, or an
        earlier batch's did: the longest such of each text, taken on to the last stable cut that
        the batch's texts having it share."""
        counts = Counter(key for _, keys in misses for key in keys)
        seen, chosen = self._seen, {}
        for k, keys in misses:
            key = next((key for key in keys if counts[key] > 1 or hash(key) in seen), None)
            if key is not None:
                chosen.setdefault(key, []).append(k)
        for _, keys in misses:
            seen.update(dict.fromkeys(map(hash, keys)))
        if len(seen) > _MAX_SEEN:  # the newer half stays
            self._seen = dict.fromkeys(list(seen)[len(seen) // 2:])
        prefixes: dict[str, tuple[str, list[int]]] = {}  # prefix -> the candidate it extends, its texts
        for key, ks in chosen.items():
            prefix = self._extended(key, [texts[k] for k in ks])
            prefixes.setdefault(prefix, (key, []))[1].extend(ks)
        new = [p for p in prefixes if p not in self._cache]
        for prefix, e in zip(new, backend.encode_batch_fast(new, add_special_tokens=False)):
            self._put(prefix, pack_ids(e.ids, self.width), prefixes[prefix][0])
        for prefix, (_, ks) in prefixes.items():
            entry = self._cache.get(prefix)
            ids = entry[0] if entry is not None else \
                pack_ids(backend.encode(prefix, add_special_tokens=False).ids, self.width)
            for k in ks:
                found[k] = (len(prefix), ids)

    def _extended(self, key: str, group: list[str]) -> str:
        """`key` taken on to the last cut stable in every text of `group` (all start with `key`)
        before their common prefix ends; `key` itself for a group of one."""
        if len(group) < 2:
            return key
        end = len(os.path.commonprefix([min(group), max(group)]))  # the common prefix of all
        text = group[0]
        c = text.rfind(" ", len(key) + 1, end)
        while c > len(key) and not all(self.rule.stable(t, c) for t in group):
            c = text.rfind(" ", len(key) + 1, c)
        return text[:c] if c > len(key) else key

    def _put(self, prefix: str, ids: bytes, candidate: str) -> None:
        base = None if prefix == candidate else hash(candidate)
        self._cache[prefix] = (ids, base)
        if base is not None:
            self._longer.setdefault(base, []).append(prefix)
        self._chars += len(prefix)
        self._ids += len(ids) // self.width
        while self._cache and (len(self._cache) > _MAX_PREFIXES or self._chars > _MAX_CHARS or
                               self._ids > _MAX_IDS):
            old, (old_ids, old_base) = self._cache.popitem(last=False)
            self._chars -= len(old)
            self._ids -= len(old_ids) // self.width
            if old_base is not None:  # what found it goes with it
                extending = self._longer[old_base]
                extending.remove(old)
                if not extending:
                    del self._longer[old_base]
