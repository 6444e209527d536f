"""Text <-> token ids, in the only modules that load a tokenizer (this one and `batchgen.pipeline.text.fast_tokenizer`):
the engine sees ids only.

Prompts get the ids of tokenizing them whole, exactly as plain generation would (default special
tokens for text, the chat template with a generation prompt for messages); grouping happens later
on these ids, never on strings, since a prefix tokenized alone can end in different tokens. Only
where a cut is proven not to change them (`batchgen.pipeline.text.prefix_tokens`) is a shared text prefix
tokenized once for the texts that start with it, and the rest of a text through the ids of its
pieces between such cuts (`batchgen.pipeline.text.pieces`).
"""
from __future__ import annotations

import functools
import json
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

from batchgen.pipeline.errors import BatchgenError
from batchgen.pipeline.engine.types import StopCheck
from batchgen.pipeline.text.fast_tokenizer import StandIn, load as load_known, remember
from batchgen.pipeline.text.pieces import key_width, pack_ids, unpack_ids
from batchgen.pipeline.text.prefix_tokens import PrefixTokens, cut_rule


_ENCODE_BATCH = 1024  # texts per call of the Rust batch encoder


class TokenizerError(BatchgenError):
    """A tokenizer that cannot be loaded, or a text it cannot encode; the message says which."""


@contextmanager
def torch_hidden(hide: bool = True) -> Iterator[None]:
    """transformers imports torch with its config module (for RoPE helpers), so loading a
    tokenizer or a config costs a torch import though neither needs it. For the commands
    that never load a model (`validate`, `plan`), transformers is told torch is unavailable while
    it first imports those modules. Only in a process that has not imported torch or
    transformers' config module yet: anywhere else it changes nothing."""
    if not hide or "torch" in sys.modules or "transformers.configuration_utils" in sys.modules:
        yield
        return
    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils

    real = import_utils.is_torch_available
    utils.is_torch_available = import_utils.is_torch_available = lambda: False
    try:
        yield
    finally:
        utils.is_torch_available = import_utils.is_torch_available = real


def _config_for_tokenizer(name_or_path: str) -> dict[str, Any]:
    """`AutoTokenizer` loads the model's config class only to choose the tokenizer class, and with
    torch present that import is slow (a Llama config pulls in `torch.distributed.tensor` and
    sympy). Where the local `tokenizer_config.json` names its class and brings no custom code,
    the choice reads only the config's `model_type`, `_name_or_path`, `tokenizer_class` and
    `model_name` (transformers 5.24's `AutoTokenizer.from_pretrained`), so those are passed as the
    config and the tokenizer is the same (a test compares the two). Elsewhere: nothing."""
    d = Path(name_or_path)
    try:
        tc = json.loads((d / "tokenizer_config.json").read_text())
        raw = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not (isinstance(tc, dict) and isinstance(raw, dict)) or not isinstance(tc.get("tokenizer_class"), str) \
            or "auto_map" in tc or "auto_map" in raw or not isinstance(raw.get("model_type"), str):
        return {}
    fields = {"model_type": raw["model_type"], "_name_or_path": str(name_or_path),
              "tokenizer_class": raw.get("tokenizer_class")}
    if "model_name" in raw:
        fields["model_name"] = raw["model_name"]
    return {"config": SimpleNamespace(**fields)}


def _from_transformers(name_or_path: str, trust_remote_code: bool, without_torch: bool) -> Any:
    try:
        with torch_hidden(without_torch):
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                 **_config_for_tokenizer(name_or_path))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot load a tokenizer from {name_or_path!r}: {e}") from e


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        """`hf_tokenizer`: transformers' tokenizer, or its stand-in (`batchgen.pipeline.text.fast_tokenizer`),
        which encodes, renders and decodes as it does."""
        self._tok = hf_tokenizer  # what every method here calls
        self._hf = None if isinstance(hf_tokenizer, StandIn) else hf_tokenizer
        self._source: tuple[str, bool, bool] | None = None  # where `load` found the stand-in's directory
        self._grammars = None
        self._piece_bytes: dict[int, bytes] = {}  # token_bytes' answers (at most the vocabulary)
        self._prefixes: PrefixTokens | bool | None = None  # shared prefixes' ids; False: no stable cuts

    @property
    def hf(self) -> Any:
        """transformers' tokenizer: beside the stand-in, loaded on first use (constraints and
        lm-eval need transformers' own)."""
        if self._hf is None:
            self._hf = _from_transformers(*self._source)
        return self._hf

    @property
    def grammars(self) -> Any:
        """Constraints compiled for this tokenizer (pipeline/text/grammar.py), built on first use."""
        if self._grammars is None:
            from batchgen.pipeline.text.grammar import Grammars

            self._grammars = Grammars(self.hf)
        return self._grammars

    @classmethod
    def load(cls, name_or_path: str, *, trust_remote_code: bool = False, without_torch: bool = False) -> "Tokenizer":
        """`without_torch`: for a process that will never load a model (see `torch_hidden`). A
        directory whose tokenizer transformers was seen to load as exactly the stand-in gets the
        stand-in, and never imports transformers for it (`batchgen.pipeline.text.fast_tokenizer`)."""
        stand_in = load_known(name_or_path, trust_remote_code)
        if stand_in is None:
            hf = _from_transformers(name_or_path, trust_remote_code, without_torch)
            remember(name_or_path, trust_remote_code, hf)
            return cls(hf)
        tok = cls(stand_in)
        tok._source = (name_or_path, trust_remote_code, without_torch)
        return tok

    @property
    def vocab_size(self) -> int:
        """Ids are below this (added tokens included)."""
        return len(self._tok)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self._tok.eos_token_id
        return [] if eos is None else [eos]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self._tok(prompt)["input_ids"])

    def encode_pair(self, context: str, continuation: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """A scoring pair tokenized as lm-eval-harness does: the context's trailing spaces move into
        the continuation, context + continuation is encoded whole and split at the context's
        length (so a leading space is the continuation's, as the tokenizer would merge it)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = list(self._tok(context + continuation, add_special_tokens=add_special_tokens)["input_ids"])
        head = list(self._tok(context, add_special_tokens=add_special_tokens)["input_ids"])
        return whole[: len(head)], whole[len(head) :]

    def encode_reply(self, rendered: str, reply: str) -> tuple[list[int], list[int]]:
        """A chat scoring pair: the rendered chat's ids (generation prompt included, and the
        whitespace the template writes after it: the ids a generating job of these messages
        starts from) and the reply's tokens after them, as the reply's text is tokenized there
        (rendered + reply encoded whole, split after the rendered chat's ids). A reply whose first
        characters would join the template's last token is refused: it cannot follow that prompt."""
        head = list(self.hf(rendered, add_special_tokens=False)["input_ids"])
        whole = list(self.hf(rendered + reply, add_special_tokens=False)["input_ids"])
        if whole[: len(head)] != head:
            raise TokenizerError("its first characters merge with the end of the chat template's generation "
                                 "prompt when tokenized, so it cannot be scored as the assistant's reply after it; "
                                 "drop its leading whitespace")
        return head, whole[len(head) :]

    def encode_messages(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not self.has_chat_template:
            raise TokenizerError("this model's tokenizer has no chat template: give jobs a 'prompt' instead of 'messages'")
        out = self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])

    def encode_many(self, prompts: Sequence[str | None], chats: Sequence[Sequence[dict[str, str]] | None]
                    ) -> list[list[int] | TokenizerError]:
        """Each job's ids (a prompt, or a chat where the prompt is None), as `encode_prompt` and
        `encode_messages` give them, in one call of the fast tokenizer's batch encoder (its Rust
        threads); a job that cannot be tokenized gets its error, the others their ids."""
        out: list[list[int] | TokenizerError | None] = [None] * len(prompts)
        texts, where, plain = [], [], []
        for i, (prompt, chat) in enumerate(zip(prompts, chats)):
            if prompt is not None:
                texts.append(prompt)
                where.append(i)
                plain.append(True)
                continue
            try:
                texts.append(self.render(chat))
                where.append(i)
                plain.append(False)
            except TokenizerError as e:
                out[i] = e
        # a prompt gets the special tokens (a BOS), a rendered chat does not: its template wrote them
        for special in (True, False):
            picked = [k for k, p in enumerate(plain) if p == special]
            for k, ids in zip(picked, self._encode_batch([texts[k] for k in picked], special)):
                out[where[k]] = ids
        return out  # type: ignore[return-value]

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The chat template's text for these messages, with the generation prompt."""
        if not self.has_chat_template:
            raise TokenizerError("this model's tokenizer has no chat template: give jobs a 'prompt' instead of 'messages'")
        try:
            return self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template may raise anything for a row it refuses
            raise TokenizerError(f"the chat template refused these messages: {str(e)[:200]}") from e

    def _encode_batch(self, texts: list[str], special: bool) -> list[list[int]]:
        """What `self.hf(text, add_special_tokens=special)` gives each text: for a fast tokenizer,
        its own steps (no truncation, no padding, its special-token splitting) then one batch."""
        out: list[list[int]] = []
        self.encode_texts(texts, special, out.extend)
        return out

    def encode_texts(self, texts: Sequence[str], special: bool = True,
                     keep: Callable[[list[list[int]]], Any] | None = None) -> list[int]:
        """Each text's token count, as `self.hf(text, add_special_tokens=special)` gives it; with
        `keep`, each batch's ids are handed to it, so that ids are held a batch at a time (a
        million prompts' ids as Python lists would take GBs). Without it no id list is made: the
        counts come from the encodings themselves. Texts sharing a prefix get its ids from one
        tokenization of it, where the tokenizer has stable cuts (`_shared_prefixes`)."""
        return self._encode(texts, special, keep, packed=False)

    def encode_keys(self, texts: Sequence[str], special: bool, keep: Callable[[list[bytes]], Any]) -> list[int]:
        """`encode_texts`, each batch's ids handed to `keep` packed (`pieces.pack_ids`, `key_width`
        bytes each): what the prefix index keeps of a prompt, made without a list of its ids
        where the tokenizer has stable cuts."""
        return self._encode(texts, special, keep, packed=True)

    @property
    def key_width(self) -> int:
        """Bytes an id of this tokenizer takes packed."""
        return key_width(self.vocab_size)

    def _encode(self, texts: Sequence[str], special: bool, keep: Callable | None, packed: bool) -> list[int]:
        lengths: list[int] = []
        if not texts:
            return lengths
        backend = self._fast_backend()
        prefixes = self._shared_prefixes(backend)
        width = self.key_width
        for start in range(0, len(texts), _ENCODE_BATCH):  # an Encoding holds much more than its ids: few at once
            batch = list(texts[start : start + _ENCODE_BATCH])
            if backend is None:
                ids = [list(self._tok(t, add_special_tokens=special)["input_ids"]) for t in batch]
                lengths += map(len, ids)
            elif prefixes is not None:  # the same ids, shared text prefixes and pieces tokenized once
                keys = prefixes.encode_packed(backend, batch, special)
                shift = width.bit_length() - 1
                lengths += [len(k) >> shift for k in keys]
                ids = keys if packed else [unpack_ids(k, width) for k in keys] if keep is not None else []
            else:
                encodings = backend.encode_batch_fast(batch, add_special_tokens=special)
                lengths += map(len, encodings)
                ids = [e.ids for e in encodings] if keep is not None else []
                del encodings
            if keep is not None:
                if packed and not (backend is not None and prefixes is not None):
                    ids = [pack_ids(i, width) for i in ids]
                keep(ids)
        return lengths

    def _shared_prefixes(self, backend: Any) -> PrefixTokens | None:
        """Where this tokenizer has proven stable cuts (`batchgen.pipeline.text.prefix_tokens`), what tokenizes
        shared text prefixes once; None where it has none, or with BATCHGEN_PREFIX_TOKENS=0."""
        if backend is None or os.environ.get("BATCHGEN_PREFIX_TOKENS", "1") == "0" or backend.encode_special_tokens:
            return None
        if self._prefixes is None:
            rule = cut_rule(backend)
            self._prefixes = PrefixTokens(rule, width=self.key_width) if rule is not None else False
        return self._prefixes or None

    def _fast_backend(self) -> Any:
        """The Rust tokenizer, set up as `self.hf(...)` sets it for one text; None for a slow one."""
        if isinstance(self._tok, StandIn):
            return self._tok.backend  # set up so when it was built
        backend = getattr(self._tok, "_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_batch_fast") or \
                not hasattr(self._tok, "set_truncation_and_padding"):
            return None
        from transformers.tokenization_utils_base import PaddingStrategy, TruncationStrategy

        self._tok.set_truncation_and_padding(PaddingStrategy.DO_NOT_PAD, TruncationStrategy.DO_NOT_TRUNCATE,
                                             None, 0, None, None)
        split = bool(getattr(self._tok, "split_special_tokens", False))
        if backend.encode_special_tokens != split:
            backend.encode_special_tokens = split
        return backend

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text, special tokens included (what a logprobs listing names). A token
        holding part of a multi-byte character decodes to U+FFFD."""
        return self._tok.batch_decode([[i] for i in ids], skip_special_tokens=False)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes (what OpenAI's logprobs call `bytes`), also of a token holding
        part of a multi-byte character: a byte-level BPE token's bytes through GPT-2's
        byte-to-character table, a byte-fallback token's (`<0xE2>`) byte, an added token's text;
        any other token decodes to whole characters, taken as they read after another token (a
        word-start marker is its space, which a token decoded alone loses)."""
        cache = self._piece_bytes
        missing = [i for i in dict.fromkeys(ids) if i not in cache]
        if missing:
            kinds, backend = self._decoder_kinds(), self._fast_backend_or_none()
            added = self.hf.added_tokens_decoder
            pieces = self.hf.convert_ids_to_tokens(missing)
            for i, piece in zip(missing, pieces):
                cache[i] = (added[i].content.encode() if i in added else
                            _piece_bytes(piece, kinds) or self._text_after_itself(i, backend))
        return [cache[i] for i in ids]

    def text_bytes(self, ids: Sequence[int]) -> list[bytes | None]:
        """What each token adds to `decode(ids)`, as UTF-8 bytes: joined, the text's bytes (None:
        a special token, which the text skips). A token holding part of a multi-byte character
        gets its own bytes of it; the text shows the character once it is whole. Where the
        tokenizer has no incremental decoder (a slow one), each token's own bytes."""
        special = set(self.hf.all_special_ids)
        backend = self._fast_backend_or_none()
        if backend is None:
            return [None if i in special else b for i, b in zip(ids, self.token_bytes(ids))]
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=True)  # the library's incremental detokenizer
        out: list[bytes | None] = []
        held: list[int] = []  # positions whose text the stream holds back (an unfinished character)
        for k, i in enumerate(ids):
            out.append(None)
            if i in special:
                continue
            text = stream.step(backend, i)
            if text is None:
                held.append(k)
                continue
            data = text.encode()
            own = self.token_bytes([ids[h] for h in held])
            head = b"".join(own)
            if held and data.startswith(head) and not _is_utf8(head):  # a character split over tokens
                for h, b in zip(held, own):
                    out[h] = b
                data = data[len(head):]
            else:
                for h in held:
                    out[h] = b""
            out[k], held = data, []
        for h, b in zip(held, self.token_bytes([ids[h] for h in held])):
            out[h] = b  # a character left unfinished at the end: the text shows U+FFFD for it
        return out

    def _decoder_kinds(self) -> set[str]:
        """The types of the fast tokenizer's decoder and of the decoders of its sequence."""
        decoder = getattr(self._fast_backend_or_none(), "decoder", None)
        if decoder is None:
            return set()
        spec = json.loads(decoder.__getstate__())
        return {d.get("type") for d in [spec, *spec.get("decoders", [])]}

    def _fast_backend_or_none(self) -> Any:
        backend = getattr(self.hf, "backend_tokenizer", None)
        return backend if hasattr(backend, "decode") else None

    def _text_after_itself(self, token: int, backend: Any) -> bytes:
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(skip_special_tokens=False)
            stream.step(backend, token)
            text = stream.step(backend, token)
            if text is not None:
                return text.encode()
        return self.token_texts([token])[0].encode()

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def stop_check(self, stops: Sequence[str]) -> StopCheck | None:
        """A cheap per-step check: decode only the tail that could hold a stop string."""
        if not stops:
            return None
        stops = tuple(stops)
        # a token decodes to at least one character except partial bytes: a margin covers those
        window = max(len(s) for s in stops) + 4

        def check(ids: list[int]) -> bool:
            tail = self._tok.decode(ids[-window:], skip_special_tokens=True)
            return any(s in tail for s in stops)

        return check

    def completion_text(self, ids: Sequence[int], stops: Sequence[str]) -> tuple[str, bool]:
        """The completion's text, cut before the first stop string; and whether one was found."""
        text = self.decode(ids)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_bytes(piece: str, kinds: set[str]) -> bytes | None:
    """A token's bytes from its vocabulary piece, where the decoder makes them from bytes: GPT-2's
    table for byte-level BPE, `<0xNN>` for byte fallback; None elsewhere."""
    if "ByteLevel" in kinds:
        table = _unicode_to_bytes()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    if "ByteFallback" in kinds:
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
    return None


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
