"""A model directory's tokenizer without importing transformers, where it is known to be the same.

`import transformers` (for `AutoTokenizer`) costs more of a run's start than reading, checking and
tokenizing its jobs. What batchgen calls on a tokenizer is a small part of it: encoding (the
`tokenizers` library's Rust backend does it), decoding (the same backend), its EOS id, and
rendering its chat template (jinja2). `StandIn` is that part, built from the directory's
`tokenizer.json`, with the chat template rendered in the jinja environment transformers 5 builds
for it (`transformers.utils.chat_template_utils`), so it encodes, renders and decodes exactly as
transformers' tokenizer does.

It is used only where that was checked against transformers itself: the first load of a
directory goes through `AutoTokenizer` as before, and `remember` then records, in batchgen's cache,
that transformers' tokenizer for it is `TokenizersBackend` itself (no class with its own code), with
a Rust backend that serializes exactly as `tokenizer.json` read alone (after the no-truncation,
no-padding set-up every call makes), space clean-up in decoding off, and one chat template or none;
with what the stand-in needs of it (EOS id, special tokens, chat template, special-token
splitting). The record is keyed by a digest of the directory's files (all but weights) and of the
installed transformers, tokenizers and jinja2, so new files or libraries are checked again.
Anything else (hub ids, other classes, remote code, a record that cannot be written) loads through
transformers, as before.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

FORMAT = 1  # of the records: a record of another format is not read
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".npz", ".npy")
_MAX_FILE = 256 << 20  # a larger non-weight file is not digested: that directory loads through transformers
_KEEP_RECORDS = 64  # the newest records kept (test and temp directories come and go)
_PROBE_TEXT = "Hello world! <|im_start|>user\nÜnïcödé 12345\ttabs  and\n\nlines.<|im_end|> ✓ 日本語"
_PROBE_CHATS = ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓ <|im_end|>"}],
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": "Again?"}])


def load(source: str, trust_remote_code: bool) -> StandIn | None:
    """The stand-in for `source`'s tokenizer where a record says it is transformers' own, else None."""
    files = _files(source)
    if files is None:
        return None
    try:
        record = json.loads(_record_path(_digest(files, trust_remote_code)).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return None
    return StandIn(files["tokenizer.json"].decode("utf-8"), record)


def remember(source: str, trust_remote_code: bool, hf: Any) -> None:
    """After transformers loaded `hf` from `source`: record it for `load` if the stand-in built
    from the directory's files is the same tokenizer (see the module's docstring). Quietly nothing
    where it is not, or where the cache cannot be written."""
    from transformers import TokenizersBackend
    from transformers.tokenization_utils_base import PaddingStrategy, TruncationStrategy

    files = _files(source)
    if files is None or type(hf) is not TokenizersBackend or not isinstance(hf.chat_template, (str, type(None))):
        return
    backend = hf._tokenizer
    if hf.clean_up_tokenization_spaces and (type(backend.model).__name__ != "BPE" or
                                            hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output):
        return
    record = {"format": FORMAT, "eos_token_id": hf.eos_token_id, "special_tokens_map": hf.special_tokens_map,
              "chat_template": hf.chat_template, "split_special_tokens": bool(hf.split_special_tokens)}
    try:
        ours = StandIn(files["tokenizer.json"].decode("utf-8"), record)
    except Exception:  # noqa: BLE001 - a tokenizer.json the library cannot read alone: not ours to judge
        return
    # what every call of `hf` sets up before encoding
    hf.set_truncation_and_padding(PaddingStrategy.DO_NOT_PAD, TruncationStrategy.DO_NOT_TRUNCATE, None, 0, None, None)
    if backend.to_str() != ours.backend.to_str() or not _same_on_probes(hf, ours):
        return
    _write(_record_path(_digest(files, trust_remote_code)), record)


def _same_on_probes(hf: Any, ours: StandIn) -> bool:
    """A last check of the parts the backend's serialization does not cover."""
    ids = hf(_PROBE_TEXT)["input_ids"]
    if ours(_PROBE_TEXT)["input_ids"] != ids or len(ours) != len(hf):
        return False
    for skip in (False, True):
        if ours.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip):
            return False
    if ours.chat_template is None:
        return True
    for chat in _PROBE_CHATS:  # a template may refuse one (a system message, say): then both must, alike
        got, want = (_rendered(t, chat) for t in (ours, hf))
        if got != want:
            return False
    return True


def _rendered(tokenizer: Any, chat: list[dict[str, str]]) -> str | tuple[type, str]:
    try:
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - what a template raises is part of what it does
        return type(e), str(e)


class StandIn:
    """What batchgen calls of a `TokenizersBackend`, with the same signatures and results."""

    def __init__(self, tokenizer_json: str, record: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.backend = RustTokenizer.from_str(tokenizer_json)
        self.backend.no_truncation()
        self.backend.no_padding()
        self.split_special_tokens = bool(record["split_special_tokens"])
        self.backend.encode_special_tokens = self.split_special_tokens
        self.eos_token_id = record["eos_token_id"]
        self.special_tokens_map = dict(record["special_tokens_map"])
        self.chat_template = record["chat_template"]

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return self.backend.decode_batch([list(s) for s in sequences], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: Sequence[dict[str, str]], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True) -> Any:
        """transformers' `apply_chat_template` for one conversation of messages with string values
        (what a job's messages are: `batchgen.jobs.checks`), no tools or documents."""
        if self.chat_template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                             "template argument was passed! For information about writing templates and setting the "
                             "tokenizer.chat_template attribute, please see the documentation at "
                             "https://huggingface.co/docs/transformers/main/en/chat_templating")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if not all(isinstance(m, dict) and all(isinstance(k, str) and isinstance(v, (str, type(None)))
                                               for k, v in m.items()) for m in conversation):
            raise TypeError("the tokenizer stand-in renders messages of string values only")
        # as transformers does: keys holding None dropped, reasoning under the names templates read
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in conversation]
        text = _compiled(self.chat_template).render(messages=chat, tools=None, documents=None,
                                                    add_generation_prompt=add_generation_prompt,
                                                    **self.special_tokens_map)
        if not tokenize:
            return text
        ids = self(text, add_special_tokens=False)
        return ids if return_dict else ids["input_ids"]


_REASONING = ("reasoning_content", "thinking", "reasoning")  # transformers' `_REASONING_FIELDS`


def _alias_reasoning(message: dict[str, str]) -> dict[str, str]:
    """transformers' `_alias_reasoning_fields` for one message."""
    reasoning = next((message[key] for key in _REASONING if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


@lru_cache
def _compiled(template: str) -> Any:
    """The template compiled in the environment transformers 5 compiles chat templates in
    (`_cached_compile_jinja_template`): the same sandbox, options, filters and globals."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}` tag (its AssistantTracker): the block's text unchanged,
        which is what it renders while no assistant-token mask is asked for (batchgen never asks)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def _files(source: str) -> dict[str, bytes] | None:
    """The directory's files but its weights, by name; None where the stand-in cannot apply."""
    d = Path(source)
    if not d.is_dir() or not (d / "tokenizer.json").is_file():
        return None
    files = {}
    try:
        for entry in os.scandir(d):
            if entry.name.endswith(_WEIGHTS) or not entry.is_file():
                continue
            if entry.stat().st_size > _MAX_FILE:
                return None
            files[entry.name] = Path(entry.path).read_bytes()
    except OSError:
        return None
    return files


def _digest(files: dict[str, bytes], trust_remote_code: bool) -> str:
    h = hashlib.sha256(f"{FORMAT}:{trust_remote_code}".encode())
    for name in ("transformers", "tokenizers", "jinja2"):  # each package's __init__ names its version
        spec = importlib.util.find_spec(name)
        h.update(name.encode() + (Path(spec.origin).read_bytes() if spec and spec.origin else b"-"))
    for name in sorted(files):
        h.update(f"\0{name}\0{len(files[name])}\0".encode() + files[name])
    return h.hexdigest()


def _record_path(digest: str) -> Path:
    from batchgen.pipeline.paths import cache_dir

    return cache_dir() / "tokenizers" / f"{digest[:32]}.json"


def _write(path: Path, record: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        records = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in records[_KEEP_RECORDS:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only cache: this directory keeps loading through transformers
