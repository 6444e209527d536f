"""The tokenizer stand-in (`batchgen.pipeline.text.fast_tokenizer`) is transformers' tokenizer, call for call:
ids, chat text and decoded text, on every tokenizer the tests build and on the default model's;
and it is used only where transformers was seen to load exactly it."""
import json
import pickle
import string
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from batchgen.pipeline.text.fast_tokenizer import StandIn
from batchgen.pipeline.text.tokenize import Tokenizer, TokenizerError
from tests.helpers.tiny_tokenizer import SPECIALS, make_tokenizer

# a template using what transformers' chat environment gives templates: its globals, filters and tags
RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% set d = dict(a=1) %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{% if loop.index > 6 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "<|im_start|>{{ m['role'] }}{% if m.get('reasoning_content') %} [{{ m['reasoning_content'] | trim }}]{% endif %}\n"
    "{% generation %}{{ m['content'] }}{% endgeneration %}<|im_end|>\n"
    "{% if m.name is defined %}{{ m | tojson }}{% endif %}{% endfor %}"
    "{{ ns.n }}{{ d | tojson }}{{ strftime_now('%Y') | length }}{{ eos_token }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level() -> PreTrainedTokenizerFast:
    """A small byte-level BPE (as GPT-2, Llama 3, SmolLM2): tokens can hold part of a character."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "Ünïcödé ✓ 日本語 emoji 🙂", "numbers 12345 and\ttabs"]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = RICH_TEMPLATE
    return hf


def without_unk() -> PreTrainedTokenizerFast:
    spec = json.loads(make_tokenizer().backend_tokenizer.to_str())
    spec["model"]["unk_token"] = None
    return PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def tiny(template=make_tokenizer().chat_template, **config):
    def build():
        hf = make_tokenizer()
        hf.chat_template = template
        return hf, config
    return build


VARIANTS = {
    "tiny": tiny(),
    "tiny-rich-template": tiny(RICH_TEMPLATE),
    "tiny-no-template": tiny(None),
    "tiny-split-special-tokens": tiny(split_special_tokens=True),
    "tiny-clean-up-spaces": tiny(clean_up_tokenization_spaces=True),  # a BPE: transformers skips the clean-up
    "byte-level": lambda: (byte_level(), {}),
    "without-unk": lambda: (without_unk(), {}),
}


def save(tmp_path, build):
    hf, config = build()
    hf.save_pretrained(tmp_path)
    if config:
        path = tmp_path / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return tmp_path


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(the stand-in's Tokenizer, transformers' own) for one of the tests' tokenizers, saved."""
    mp = pytest.MonkeyPatch()
    mp.setenv("BATCHGEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    d = save(tmp_path_factory.mktemp(request.param), VARIANTS[request.param])
    first = Tokenizer.load(str(d))  # through transformers: checked, and recorded
    assert not isinstance(first._tok, StandIn)
    ours = Tokenizer.load(str(d))
    mp.undo()
    assert isinstance(ours._tok, StandIn), f"{request.param}: the stand-in was not taken"
    return ours, Tokenizer(AutoTokenizer.from_pretrained(d))


TEXT = st.lists(st.one_of(st.sampled_from(list("ab the\n\t  ÜQ?.,'") + SPECIALS + ["✓", "日本", "🙂", " 's", " n't"]),
                          st.text(max_size=3)), max_size=25).map("".join)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT},
                                          optional={"reasoning_content": TEXT, "name": st.sampled_from(["x", "ü"])}),
                    min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(TEXT, max_size=6), chat=MESSAGES)
def test_same_ids_chat_text_and_decoded_text(pair, texts, chat):
    ours, theirs = pair
    assert ours.vocab_size == theirs.vocab_size and ours.eos_token_ids == theirs.eos_token_ids
    assert ours.has_chat_template == theirs.has_chat_template
    for text in texts:
        ids = theirs.encode_prompt(text)
        assert ours.encode_prompt(text) == ids
        assert ours.encode_pair(text, " and" + text) == theirs.encode_pair(text, " and" + text)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.token_texts(ids) == theirs.token_texts(ids)
        assert ours.completion_text(ids, ["a", "✓"]) == theirs.completion_text(ids, ["a", "✓"])
    assert ours.encode_texts(texts, False) == theirs.encode_texts(texts, False)
    if theirs.has_chat_template:
        rendered = theirs.render(chat)
        assert ours.render(chat) == rendered
        assert ours.encode_messages(chat) == theirs.encode_messages(chat)
        assert ours.encode_many([None, *texts], [chat] + [None] * len(texts)) == \
            theirs.encode_many([None, *texts], [chat] + [None] * len(texts))
        assert ours.decode(ours.encode_messages(chat)) == theirs.decode(theirs.encode_messages(chat))


NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")


@pytest.mark.parametrize("template,refused", [(RICH_TEMPLATE, [{"role": "tool", "content": "x"}]),
                                              (NO_SYSTEM, [{"role": "system", "content": "x"}])], ids=["tool", "system"])
def test_a_template_that_refuses_refuses_the_same(tmp_path, template, refused):
    """A template's own refusal (raise_exception) is the same error, and a template that refuses
    a system message (as Gemma's does) is stood in all the same."""
    d = save(tmp_path, tiny(template))
    Tokenizer.load(str(d))
    ours, theirs = Tokenizer.load(str(d)), Tokenizer(AutoTokenizer.from_pretrained(d))
    assert isinstance(ours._tok, StandIn)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.render(chat) == theirs.render(chat)
    with pytest.raises(TokenizerError) as want:
        theirs.render(refused)
    with pytest.raises(TokenizerError) as got:
        ours.render(refused)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("config", [{"pad_token": "<|newpad|>"}, {"extra_special_tokens": ["<|extra|>"]},
                                    {"tokenizer_class": "LlamaTokenizer"}], ids=str)
def test_a_tokenizer_transformers_makes_more_of_is_not_stood_in(tmp_path, config):
    """A special token named only in tokenizer_config.json is added by transformers (its backend is
    no longer tokenizer.json's); a tokenizer class of its own runs its own code: such directories
    keep loading through transformers."""
    d = save(tmp_path, tiny(**config))
    text = "the <|newpad|><|extra|>"
    want = AutoTokenizer.from_pretrained(d)(text)["input_ids"]
    for _ in range(2):
        tok = Tokenizer.load(str(d))
        assert not isinstance(tok._tok, StandIn)
        assert tok.encode_prompt(text) == want


def test_a_word_level_tokenizer_that_cleans_up_spaces_is_not_stood_in(tmp_path):
    vocab = {t: i for i, t in enumerate(SPECIALS + ["hi", ".", "?", "'s", "there"])}
    tok = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 clean_up_tokenization_spaces=True)
    hf.save_pretrained(tmp_path)
    for _ in range(2):
        assert not isinstance(Tokenizer.load(str(tmp_path))._tok, StandIn)


def test_changed_files_are_checked_again(tmp_path):
    """A record is of the files it was made from: a new chat template is rendered, not the old one."""
    d = save(tmp_path, tiny())
    Tokenizer.load(str(d))
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    for _ in range(2):
        tok = Tokenizer.load(str(d))
        assert tok.render([{"role": "user", "content": "hi"}]) == "[hi]"
    assert isinstance(tok._tok, StandIn)


def test_transformers_tokenizer_is_still_there_for_what_needs_it(tmp_path):
    """Constraints and lm-eval use transformers' tokenizer itself: loaded on first use."""
    d = save(tmp_path, tiny())
    Tokenizer.load(str(d))
    tok = Tokenizer.load(str(d))
    assert isinstance(tok._tok, StandIn) and type(tok.hf).__name__ == "TokenizersBackend"
    assert tok.hf("the cat")["input_ids"] == tok.encode_prompt("the cat")
    again = pickle.loads(pickle.dumps(Tokenizer.load(str(d))))  # as a Tokenizer of transformers' own pickles
    assert isinstance(again._tok, StandIn) and again.encode_prompt("the cat") == tok.encode_prompt("the cat")


@pytest.mark.slow
def test_the_default_models_tokenizer(tmp_path):
    from batchgen.pipeline.model.default_model import default_model_path

    source = str(default_model_path())
    Tokenizer.load(source)
    ours, theirs = Tokenizer.load(source), Tokenizer(AutoTokenizer.from_pretrained(source))
    assert isinstance(ours._tok, StandIn)
    texts = ["", "Hello world!", " leading and trailing  ", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>",
             "Ünïcödé, 日本語, emoji 🙂✓ and\ttabs\n\nlines", "It's 12,345.67 — isn't it?", string.printable,
             "<|im_end|><|im_start|>assistant\n", "a" * 300]
    chats = [json.loads(line)["messages"] for line in open(Path(__file__).parents[2] / "data/system_prompt.jsonl")]
    chats += [[{"role": "user", "content": t}] for t in texts] + [[{"role": "assistant", "content": "x"}]]
    for text in texts:
        ids = theirs.encode_prompt(text)
        assert ours.encode_prompt(text) == ids
        assert ours.decode(ids) == theirs.decode(ids) and ours.token_texts(ids) == theirs.token_texts(ids)
    for chat in chats:
        assert ours.render(chat) == theirs.render(chat) and ours.encode_messages(chat) == theirs.encode_messages(chat)
    assert ours.vocab_size == theirs.vocab_size and ours.eos_token_ids == theirs.eos_token_ids
