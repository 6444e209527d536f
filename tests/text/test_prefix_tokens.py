"""Shared text prefixes tokenized once (pipeline/text/prefix_tokens.py) give exactly the ids of
tokenizing each text whole, on every tokenizer it takes; the others it refuses."""
import functools
import json

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import AddedToken, Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, processors, trainers

import batchgen.pipeline.text.pieces as pieces_module
from batchgen.pipeline.text.pieces import _UNSAFE, Pieces, pack_ids
from batchgen.pipeline.text.prefix_tokens import PrefixTokens, cut_rule, refusal
from batchgen.pipeline.text.tokenize import Tokenizer
from tests.helpers.cli_helpers import run, write_jsonl
from tests.helpers.tiny_tokenizer import make_tokenizer

# what could move a token boundary across a cut: spaces and their runs, other whitespace, digits,
# contractions, symbols, non-ASCII letters, emoji, added tokens' text (with a space, with rstrip)
PIECES = ["a", "b", "the", "Hello", "word", " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "1", "23", "4567", ".",
          ",", "!?", "-", "'", "'s", "'t", "'re", "'ll", "don't", "Ü", "ñ", "é", "日本", "Ωμέγα", "😀", "👍🏽", "▁",
          "\u00a0", "\r\n", "\u3000", "\x1c", "’", "'S",
          "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<", ">", "my name", "<r>"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=24).map("".join)
SHARED = st.lists(TEXT, min_size=1, max_size=3).flatmap(
    lambda heads: st.lists(st.tuples(st.sampled_from(heads), TEXT).map("".join), min_size=1, max_size=10))
CORPUS = ["Hello word, the words of the world don't stop. It's 1234 or 56.7 é ñ Ü 日本 😀",
          "runs  of   spaces    and\n\n  lines \n\n\n or\t\ttabs   \n  "] * 3


def _byte_level(prefix_space: bool, template: bool) -> RustTokenizer:
    """A small byte-level BPE trained here, with added tokens of each kind (one holding a space,
    one with rstrip) and, with `template`, a BOS and an EOS around each text."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["my name", AddedToken("<r>", rstrip=True)])
    if template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[
            ("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    return tok


def _edited(backend: RustTokenizer, edit) -> RustTokenizer:
    spec = json.loads(backend.to_str())
    edit(spec)
    return RustTokenizer.from_str(json.dumps(spec))


def _metaspace(scheme: str) -> RustTokenizer:
    def edit(spec):
        spec["pre_tokenizer"]["prepend_scheme"] = scheme
    return _edited(make_tokenizer()._tokenizer, edit)


TOKENIZERS = {
    "metaspace-first": lambda: make_tokenizer()._tokenizer,  # the tests' and the bench's tiny one (a BOS)
    "metaspace-always": lambda: _metaspace("always"),
    "metaspace-never": lambda: _metaspace("never"),
    "byte-level": lambda: _byte_level(False, False),
    "byte-level-bos-eos": lambda: _byte_level(False, True),
    "byte-level-prefix-space": lambda: _byte_level(True, True),
}
BACKENDS = {name: make() for name, make in TOKENIZERS.items()}


@functools.cache
def _default_backend():
    from batchgen.pipeline.model.default_model import default_model_path

    return Tokenizer.load(str(default_model_path()))._fast_backend()  # SmolLM2's byte-level BPE


def _plain(backend, texts, special):
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special)]


def _check_every_cut(backend, texts):
    """The claim itself: at every stable cut, whole = head + prefix alone + rest alone + tail."""
    rule = cut_rule(backend)
    assert rule is not None
    for text in texts:
        whole = _plain(backend, [text], True)[0]
        for c in (c for c in range(len(text)) if rule.stable(text, c)):
            parts = _plain(backend, [text[:c], text[c:]], False)
            assert whole == [*rule.head, *parts[0], *parts[1], *rule.tail], (text[:c], text[c:])


def _check_reuse(backend, texts, special, batch=4):
    """Batches through one cache (prefixes met in earlier batches reused) give the plain ids."""
    reuse = PrefixTokens(cut_rule(backend), step=2)  # cuts every few characters: many in short texts
    got_ids, got_counts = [], []
    for start in range(0, len(texts), batch):
        counts, ids = reuse.encode(backend, texts[start:start + batch], special, True)
        got_counts += counts
        got_ids += ids
        assert reuse.encode(backend, texts[start:start + batch], special, False)[0] == counts
    want = _plain(backend, texts, special)
    assert got_ids == want and got_counts == [len(w) for w in want]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_every_stable_cut_splits_the_ids_exactly(name, texts):
    _check_every_cut(BACKENDS[name], texts)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(texts=SHARED, special=st.booleans())
def test_texts_through_shared_prefixes_get_the_plain_ids(name, texts, special):
    _check_reuse(BACKENDS[name], texts, special)


@pytest.mark.slow
@settings(max_examples=50, deadline=None)
@given(texts=SHARED, special=st.booleans())
def test_the_default_models_tokenizer_through_shared_prefixes(texts, special):
    backend = _default_backend()
    _check_every_cut(backend, texts[:3])
    _check_reuse(backend, texts, special)


@pytest.mark.slow
def test_the_default_models_tokenizer_is_taken_as_byte_level():
    rule = cut_rule(_default_backend())
    assert rule is not None and rule.kind == "ByteLevel" and rule.head == rule.tail == () and rule.guarded == ()


@pytest.mark.parametrize("name,text,c", [
    ("byte-level", "Hello   word", 6),  # after a space: the run's `\s+(?!\S)` match crosses it
    ("byte-level", "Hello word", 3),  # inside a word
    ("byte-level", "Hello\n\n  word", 7),  # after a newline: the same
    ("byte-level", "Hello my name is", 8),  # inside the added token "my name"
    ("byte-level", "Hello <r> word", 9),  # after an added token that takes the spaces after it
    ("metaspace-first", "the the", 2),  # inside a word
])
def test_the_cuts_refused_would_change_the_ids(name, text, c):
    """Why each condition of a stable cut is there: without it, these cuts would give other ids."""
    backend = BACKENDS[name]
    rule = cut_rule(backend)
    parts = _plain(backend, [text[:c], text[c:]], False)
    assert _plain(backend, [text], False)[0] != parts[0] + parts[1]
    assert not rule.stable(text, c)


def _refused():
    tiny = make_tokenizer()._tokenizer

    def normalizer(spec):
        spec["normalizer"] = {"type": "NFC"}

    def no_split(spec):
        spec["pre_tokenizer"]["split"] = False

    def sequence(spec):
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [spec["pre_tokenizer"]]}

    def dropout(spec):
        spec["model"]["dropout"] = 0.5

    def bert(spec):
        spec["post_processor"] = {"type": "BertProcessing", "sep": ["</s>", 2], "cls": ["<s>", 1]}

    split_special = make_tokenizer()._tokenizer
    split_special.encode_special_tokens = True
    return {"normalizer": _edited(tiny, normalizer), "metaspace without split": _edited(tiny, no_split),
            "a sequence of pre-tokenizers": _edited(tiny, sequence), "dropout": _edited(tiny, dropout),
            "a BertProcessing": _edited(tiny, bert), "split special tokens": split_special}


@pytest.mark.parametrize("name", ["normalizer", "metaspace without split", "a sequence of pre-tokenizers",
                                  "dropout", "a BertProcessing", "split special tokens"])
def test_tokenizers_without_a_proof_get_no_cuts_and_the_plain_ids(name):
    backend = _refused()[name]
    assert cut_rule(backend) is None
    if name != "split special tokens":
        assert refusal(json.loads(backend.to_str())) is not None
    hf = make_tokenizer()
    hf._tokenizer = backend  # what Tokenizer runs: the plain path
    hf.split_special_tokens = backend.encode_special_tokens  # as `Tokenizer._fast_backend` sets it up
    tok = Tokenizer(hf)
    assert tok._shared_prefixes(tok._fast_backend()) is None


@pytest.mark.parametrize("special", [True, False])
def test_encode_texts_reuses_long_shared_prefixes_with_the_plain_ids(special):
    """Through `Tokenizer.encode_texts` (the default cut spacing, batches of many texts)."""
    tok = Tokenizer(make_tokenizer())
    heads = [f"System {g}: " + " ".join(["the words of a long shared system prompt"] * 12) for g in range(3)]
    texts = [f"{heads[i % 3]}\nTask {i}: do  it 'now'" for i in range(60)] + ["short", "", heads[0]]
    kept = []
    counts = tok.encode_texts(texts, special, kept.extend)
    want = _plain(tok._fast_backend(), texts, special)
    assert kept == want and counts == [len(w) for w in want] and tok.encode_texts(texts, special) == counts
    assert tok._prefixes._cache  # the prefixes were shared


def _jobs(tmp_path):
    head = "You are a careful assistant. " * 10
    rows = [{"id": i, "prompt": f"{head}Question {i}: what is {i} + {i}?  Answer briefly."} for i in range(40)]
    rows += [{"id": "chat", "messages": [{"role": "system", "content": head}, {"role": "user", "content": "hi"}]},
             {"id": "long", "prompt": head * 20, "max_new_tokens": 4}, "{not json"]
    return write_jsonl(tmp_path / "jobs.jsonl", rows)


@pytest.mark.parametrize("command", [["plan", "--json"], ["validate"]])
def test_plan_and_validate_say_the_same_with_and_without_shared_prefixes(tmp_path, model_dir, monkeypatch, command):
    src = _jobs(tmp_path)
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("BATCHGEN_PREFIX_TOKENS", switch)
        result = run([*command[:1], str(src), *command[1:], "--max-new-tokens", "8"], model_dir, ok=False)
        outputs.append((result.exit_code, result.output))
    assert outputs[0] == outputs[1]
    if command[0] == "plan":  # token counts: of the prompts, of the prefixes shared
        assert json.loads(outputs[0][1])["prompt_tokens"] > 0
    else:  # the long prompt's count, in its error
        assert "prompt of 5" in outputs[0][1] and outputs[0][0] == 1


@pytest.mark.slow
def test_process_gives_the_same_results_with_and_without_shared_prefixes(tmp_path, model_dir, monkeypatch):
    import pyarrow.parquet as pq

    src, tables = _jobs(tmp_path), []
    for switch in ("1", "0"):
        monkeypatch.setenv("BATCHGEN_PREFIX_TOKENS", switch)
        out = tmp_path / f"out-{switch}.parquet"
        run(["process", str(src), "-o", str(out), "--max-new-tokens", "3", "--device", "cpu"], model_dir)
        tables.append(pq.read_table(out, columns=["id", "completion", "prompt_tokens", "cached_tokens"]).to_pylist())
    assert tables[0] == tables[1] and len(tables[0]) == 41


def test_the_cache_stays_bounded_and_exact_as_prefixes_come_and_go(monkeypatch):
    import batchgen.pipeline.text.prefix_tokens as prefix_tokens

    monkeypatch.setattr(prefix_tokens, "_MAX_PREFIXES", 8)
    monkeypatch.setattr(prefix_tokens, "_MAX_IDS", 400)
    backend = BACKENDS["metaspace-first"]
    reuse = PrefixTokens(cut_rule(backend), step=16)
    for g in range(30):  # each group's prefix shared by its batch, then never again
        texts = [f"group {g} shares these words, then {i} of its own" for i in range(5)]
        assert reuse.encode(backend, texts, True, True)[1] == _plain(backend, texts, True)
        assert len(reuse._cache) <= 8 and reuse._ids == sum(len(ids) // reuse.width for ids, _ in
                                                             reuse._cache.values()) <= 400
        extending = sorted(p for p, (_, base) in reuse._cache.items() if base is not None)
        assert sorted(p for ps in reuse._longer.values() for p in ps) == extending  # none found but cached
    assert reuse._cache  # prefixes were kept (the newest)


@pytest.mark.parametrize("name", ["metaspace-first", "byte-level"])
def test_a_longer_shared_prefix_is_taken_only_where_its_cut_is_stable_in_the_text(name):
    """Two texts make "... th" a cached prefix (their common part ends in " e"); a later text
    starting with it goes on "the": there the prefix ends inside a word, and is not taken."""
    backend = BACKENDS[name]
    reuse = PrefixTokens(cut_rule(backend), step=4)
    batches = [["a long shared start, th e1", "a long shared start, th e2"],
               ["a long shared start, the end", "a long shared start, th e3"]]
    for texts in batches:
        for special in (True, False):
            assert reuse.encode(backend, texts, special, True)[1] == _plain(backend, texts, special)
    assert "a long shared start, th" in reuse._cache


def _stable_cuts(rule, text, start=0):
    return [c for c in range(start + 1, len(text)) if rule.stable(text, c)]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=6), cut=st.integers(0, 60), width=st.sampled_from([2, 4]))
def test_texts_through_their_pieces_get_the_plain_ids(name, texts, cut, width):
    """Each text from 0 or from one of its stable cuts, twice through one cache (its pieces
    tokenized, then looked up): the plain encoder's ids of that part, packed."""
    backend = BACKENDS[name]
    rule = cut_rule(backend)
    starts = []
    for text in texts:
        cuts = _stable_cuts(rule, text)
        starts.append(cuts[cut % len(cuts)] if cuts and cut % 3 else 0)
    want = [pack_ids(ids, width) for ids in _plain(backend, [t[s:] for t, s in zip(texts, starts)], False)]
    pieces = Pieces(rule.guarded, width)
    assert pieces.encode(backend, texts, starts) == want
    assert pieces.encode(backend, texts, starts) == want  # from the kept pieces


@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_the_spaces_pieces_are_cut_at_are_exactly_the_stable_cuts(text):
    """Where `Pieces` cuts a text at every space (none after whitespace, none at its start), those
    are its stable cuts (the tests' tiny tokenizer guards no added token)."""
    rule = cut_rule(BACKENDS["metaspace-first"])
    assert rule.guarded == ()
    if _UNSAFE.search(text) or text.startswith(" "):
        return
    assert [k for k, ch in enumerate(text) if ch == " "] == _stable_cuts(rule, text)


def test_the_pieces_kept_stay_bounded_and_exact(monkeypatch):
    monkeypatch.setattr(pieces_module, "_MAX_PIECES", 16)
    monkeypatch.setattr(pieces_module, "_MAX_PIECE_CHARS", 6)
    backend = BACKENDS["byte-level"]
    pieces = Pieces(cut_rule(backend).guarded, 2)
    for g in range(20):
        texts = [f"word{g} and {i} more words, longerthansix {i + g}" for i in range(5)]
        assert pieces.encode(backend, texts, [0] * 5) == [pack_ids(ids, 2) for ids in _plain(backend, texts, False)]
        assert len(pieces._spaced) <= 16 and all(len(p) <= 6 for p in pieces._spaced)
    assert "and" in pieces._spaced  # met in the last batches: kept
