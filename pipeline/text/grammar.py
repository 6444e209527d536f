"""Constrained decoding: JSON Schemas, regular expressions and choices, with llguidance.

llguidance was chosen over xgrammar (the measurements are in BENCHMARKS.md): it compiles a schema
several times faster (batch jobs often carry a schema each), its wheel has no dependencies (xgrammar
pulls in triton and a second FFI runtime), its validation returns a message instead of raising (what
`validate` reports), and its per-step mask costs little against a decode step.

One `Grammars` per tokenizer compiles each distinct constraint once; every sample gets its own
`Matcher` (a copy of the compiled one). The engine (`engine.constrain.allowed_tokens`) fills the
masks of all constrained rows of a step into one bitmask, one row after the other on the calling
thread: llguidance's parallel fill keeps a thread pool that competes with torch's threads for the
cores and slowed the model's forward several times over on a small machine (BENCHMARKS.md), while
a serial fill costs little. Constraints apply to generated tokens only:
prompts and their shared prefixes are untouched.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from functools import lru_cache
from typing import Any

import torch

from batchgen.jobs.params import Constraint
from batchgen.pipeline.errors import BatchgenError
from batchgen.pipeline.engine.types import MatcherFactory

# Compact JSON: no whitespace between tokens unless a schema asks for it ("x-guidance"). Free
# whitespace lets a model pad forever; compact output is what json.dumps(separators=...) gives.
JSON_OPTIONS = {"whitespace_flexible": False}
_PROTOTYPES = 256  # compiled matchers kept for copying; others are rebuilt from their grammar text


class GrammarError(BatchgenError):
    """A constraint that cannot be compiled for this tokenizer; the message says why."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked: `Grammars.check` does that)."""
    import llguidance

    build = llguidance.LLMatcher
    if constraint.kind == "json_schema":
        return build.grammar_from_json_schema(constraint.spec, defaults=JSON_OPTIONS)
    if constraint.kind == "json_object":
        return build.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if constraint.kind == "regex":
        return build.grammar_from_regex(constraint.spec)
    if constraint.kind == "choice":
        choices = json.loads(constraint.spec)
        return build.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    raise GrammarError(f"unknown constraint kind {constraint.kind!r}")


class Matcher:
    """One sample's position in its grammar (the engine's `constrain.Matcher`)."""

    __slots__ = ("ll", "n_vocab")

    def __init__(self, ll: Any, n_vocab: int) -> None:
        self.ll = ll
        self.n_vocab = n_vocab  # its tokenizer's vocabulary: the width of the masks it fills

    def accept(self, token: int) -> None:
        self.ll.consume_token(token)  # a refused token leaves the matcher in its error state

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The tokens allowed next, into row `row` of the step's bitmask (`engine.constrain.allowed_tokens`)."""
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self.ll, bitmask, row)

    @property
    def accepting(self) -> bool:
        """The text so far is complete: ending here (EOS) is allowed."""
        return self.ll.is_accepting()

    @property
    def done(self) -> bool:
        """The text is complete and the grammar allows nothing more: the sample ends. (A matcher
        stopped short of a complete text is a dead end: the next mask allows nothing.)"""
        return self.ll.is_stopped() and self.ll.is_accepting()

    @property
    def error(self) -> str | None:
        if not self.ll.is_error():
            return None
        return _first_line(self.ll.get_error() or "the grammar refused a token")


class Grammars:
    """Compiles constraints for one Hugging Face tokenizer and makes matchers from them."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self._tok = None
        self._prototypes: OrderedDict[str, Any] = OrderedDict()
        self.check = lru_cache(maxsize=65536)(self._check)

    @property
    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (built once: about a second for a large vocabulary)."""
        if self._tok is None:
            self._tok = _ll_tokenizer(self.hf)
        return self._tok

    def _check(self, constraint: Constraint) -> str:
        """The constraint's grammar text, checked against this tokenizer; raises GrammarError."""
        import llguidance

        try:
            text = grammar_text(constraint)
        except ValueError as e:  # not a JSON object, say
            raise GrammarError(str(e)) from None
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise GrammarError(_first_line(error))
        return text

    def factory(self, constraint: Constraint) -> MatcherFactory:
        """A maker of fresh matchers for this constraint; raises GrammarError if it cannot compile."""
        text = self.check(constraint)
        return lambda: self.matcher(text)

    def matcher(self, text: str) -> Matcher:
        import llguidance

        proto = self._prototypes.get(text)
        if proto is None:
            proto = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
            self._prototypes[text] = proto
            if len(self._prototypes) > _PROTOTYPES:
                self._prototypes.popitem(last=False)
        else:
            self._prototypes.move_to_end(text)
        return Matcher(proto.deep_copy(), self.tokenizer.vocab_size)


def _ll_tokenizer(hf: Any) -> Any:
    import llguidance

    base = _hf_ll_tokenizer(hf)
    return llguidance.LLTokenizer(_TextSpecials(base, hf.bos_token_id), eos_token=base.eos_tokens)


class _TextSpecials:
    """llguidance's tokenizer interface (the attributes of its TokenizerWrapper) over one of its
    tokenizers, where the text of a special token is text.

    llguidance turns the text a grammar forces (a JSON key, a regex literal) into tokens with the
    Hugging Face tokenizer, and that one reads "<|im_end|>" in any text as the special token: a
    constraint holding EOS's text forced the EOS token, and the row ended there. Its masks never
    allow a special token for text otherwise (special tokens are marked in its token trie). Here
    a special token in that tokenization is spelled with ordinary tokens instead (greedily: such
    text is rare, and any spelling the grammar accepts is right)."""

    is_tokenizer_wrapper = True

    def __init__(self, base: Any, bos: int | None) -> None:
        self.base = base
        self.eos_token_id, self.bos_token_id = base.eos_token, bos
        self.special_token_ids = [t for t in range(base.vocab_size) if base.is_special_token(t)]
        self.tokens = [base.decode_bytes([t]) for t in range(base.vocab_size)]  # specials: their text
        self._special = frozenset(self.special_token_ids)

    def __call__(self, text: str) -> list[int]:
        # called from llguidance's Rust code, which cannot take an exception: nothing here raises
        ids = self.base.tokenize_str(text)
        if self._special.isdisjoint(ids):
            return ids
        out: list[int] = []
        for t in ids:
            if t in self._special:
                out.extend(self.base.greedy_tokenize(self.tokens[t].decode(errors="replace")))
            else:
                out.append(t)
        # a special token that took the whitespace beside it (lstrip/rstrip) spells less than the text
        return out if self.base.decode_bytes(out) == text.encode() else self.base.greedy_tokenize(text)


def _hf_ll_tokenizer(hf: Any) -> Any:
    import llguidance
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(hf)
    except Exception as e:  # noqa: BLE001 - whatever llguidance says, the tokenizer is not usable as is
        if "decoder type" not in str(e):
            raise GrammarError(f"constrained decoding cannot use this tokenizer ({_first_line(str(e))}); "
                               "it needs a fast (Rust) tokenizer") from None
    # A Metaspace decoder (sentencepiece-style tokenizers converted by transformers) is not one
    # llguidance reads; the equivalent Replace/ByteFallback/Fuse/Strip chain is.
    spec = json.loads(hf.backend_tokenizer.to_str())
    dec = spec.get("decoder") or {}
    if dec.get("type") != "Metaspace":
        raise GrammarError(f"constrained decoding does not support this tokenizer's decoder ({dec.get('type')})")
    rep = dec.get("replacement", "▁")
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": rep}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    try:
        return llguidance.LLTokenizer(json.dumps(spec), eos_token=hf.eos_token_id)
    except Exception as e:  # noqa: BLE001
        raise GrammarError(f"constrained decoding cannot use this tokenizer ({_first_line(str(e))})") from None


def _first_line(message: str) -> str:
    """llguidance's message on one line: its first line, and the parser's "error:" line if any
    (the rest echoes the grammar with carets)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or ["unknown error"]
    head = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    detail = next((line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")), None)
    return f"{head} {detail}" if detail else head
