"""A small character-level tokenizer with a chat template, built in memory (no downloads).

Its vocabulary fits the tiny models' 256 ids; it adds a BOS token by default, like many real ones.
"""
from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(extra_merges: list[tuple[str, str]] = ()) -> PreTrainedTokenizerFast:
    chars = sorted(set(string.printable) - set(string.whitespace) | {"▁", "\n"})
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    # a few merges make multi-character tokens, so token and string boundaries differ
    merges = [("t", "h"), ("th", "e"), ("▁", "th"), ("▁th", "e"), ("i", "n"), ("▁", "a"), ("e", "r"), *extra_merges]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert len(vocab) <= 256
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf
