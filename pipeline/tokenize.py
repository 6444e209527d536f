"""Text <-> token ids. The only module that imports a tokenizer: the engine sees ids only.

Prompts are tokenized whole, exactly as plain generation would (default special tokens for
text, the chat template with a generation prompt for messages); grouping happens later on these
ids, never on strings, since a prefix tokenized alone can end in different tokens.
"""
from __future__ import annotations

from typing import Any, Sequence

from pipeline.types import StopCheck


class TokenizerError(Exception):
    pass


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self._grammars = None

    @property
    def grammars(self) -> Any:
        """Constraints compiled for this tokenizer (pipeline/grammar.py), built on first use."""
        if self._grammars is None:
            from pipeline.grammar import Grammars

            self._grammars = Grammars(self.hf)
        return self._grammars

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @classmethod
    def load(cls, name_or_path: str, *, trust_remote_code: bool = False) -> "Tokenizer":
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code))
        except (OSError, ValueError) as e:
            raise TokenizerError(f"cannot load a tokenizer from {name_or_path!r}: {e}") from e

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.hf.eos_token_id
        return [] if eos is None else [eos]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.hf(prompt)["input_ids"])

    def encode_pair(self, context: str, continuation: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """A scoring pair tokenized as lm-eval-harness does: the context's trailing spaces move into
        the continuation, context + continuation is encoded whole and split at the context's
        length (so a leading space is the continuation's, as the tokenizer would merge it)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = list(self.hf(context + continuation, add_special_tokens=add_special_tokens)["input_ids"])
        head = list(self.hf(context, add_special_tokens=add_special_tokens)["input_ids"])
        return whole[: len(head)], whole[len(head) :]

    def encode_messages(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not self.has_chat_template:
            raise TokenizerError("this model's tokenizer has no chat template: give jobs a 'prompt' instead of 'messages'")
        out = self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def stop_check(self, stops: Sequence[str]) -> StopCheck | None:
        """A cheap per-step check: decode only the tail that could hold a stop string."""
        if not stops:
            return None
        stops = tuple(stops)
        # a token decodes to at least one character except partial bytes: a margin covers those
        window = max(len(s) for s in stops) + 4

        def check(ids: list[int]) -> bool:
            tail = self.hf.decode(ids[-window:], skip_special_tokens=True)
            return any(s in tail for s in stops)

        return check

    def completion_text(self, ids: Sequence[int], stops: Sequence[str]) -> tuple[str, bool]:
        """The completion's text, cut before the first stop string; and whether one was found."""
        text = self.decode(ids)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)
