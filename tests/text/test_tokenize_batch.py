"""Batch tokenization gives exactly the ids of one-at-a-time tokenization, and `validate`/`plan`
load the tokenizer without importing torch."""
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from batchgen.pipeline.text.tokenize import Tokenizer
from tests.helpers.tiny_tokenizer import SPECIALS, make_tokenizer

TEXT = st.lists(st.sampled_from(list("ab the\n\t  ÜQ?") + SPECIALS), max_size=30).map("".join)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": TEXT}), min_size=1, max_size=3)
TOK = Tokenizer(make_tokenizer())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(TEXT.map(lambda t: (t, None)), MESSAGES.map(lambda m: (None, m))), max_size=12))
def test_batch_ids_equal_one_at_a_time(jobs):
    prompts, chats = [p for p, _ in jobs], [c for _, c in jobs]
    got = TOK.encode_many(prompts, chats)
    want = [TOK.encode_prompt(p) if p is not None else TOK.encode_messages(c) for p, c in jobs]
    assert got == want


@settings(max_examples=60, deadline=None)
@given(st.lists(TEXT, max_size=12), st.booleans())
def test_counts_and_batches_of_ids_are_one_at_a_time_tokenization(texts, special):
    kept = []
    lengths = TOK.encode_texts(texts, special, kept.extend)  # ids handed over a batch at a time
    want = [list(TOK.hf(t, add_special_tokens=special)["input_ids"]) for t in texts]
    assert kept == want and lengths == [len(w) for w in want]
    assert TOK.encode_texts(texts, special) == lengths  # counts alone: no id lists made


def test_a_tokenizer_without_chat_template_fails_only_the_chat_jobs():
    hf = make_tokenizer()
    hf.chat_template = None
    got = Tokenizer(hf).encode_many(["hello", None], [None, [{"role": "user", "content": "hi"}]])
    assert got[0] == TOK.encode_prompt("hello") and "no chat template" in str(got[1])


@pytest.mark.slow
@pytest.mark.parametrize("command", ["validate", "plan"])
@pytest.mark.parametrize("adapters", [False, True])
def test_validate_and_plan_never_import_torch(tmp_path, model_dir, command, adapters):
    """Also with adapters (a registered one, a bad one, one by path): checked from their files."""
    src = tmp_path / "jobs.jsonl"
    rows = [{"prompt": f"Shared words for all of them. Job {i}"} for i in range(5)]
    flags = []
    if adapters:
        from tests.helpers.tiny_adapters import make_adapter
        from tests.helpers.tiny_models import make_model

        good = make_adapter(make_model("llama"), tmp_path / "good", rank=2)
        rows[1]["adapter"], rows[2]["adapter"], rows[3]["adapter"] = "a", str(good), str(tmp_path / "none")
        flags = ["--adapter", f"a={good}"]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = ("import sys; sys.argv = ['batchgen', %r, %r, '--model', %r, *%r]\n"
            "from batchgen.pipeline.cli import main\n"  # the script's own exit (os._exit) would skip the check below
            "try:\n    main()\n"
            "except SystemExit as e:\n    assert not e.code or %r, e.code\n"  # validate: 1 for the bad one
            "assert 'torch' not in sys.modules, 'torch was imported'\nprint('ok')") % (
                command, str(src), str(model_dir), flags, adapters and command == "validate")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
