"""Constrained decoding on a tiny random-weight model (its free output is noise): every output of
a JSON Schema job parses and validates, regex and choice jobs match, rows with and without
constraints share batches and prefixes, and a grammar that dead-ends fails its row alone."""
import json
import re

import jsonschema
import pytest
from tokenizers import Tokenizer as RustTokenizer
from transformers import PreTrainedTokenizerFast

from batchgen.jobs.params import Constraint
from tests.helpers.jobsets import SYSTEM, tokenizer
from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.text.grammar import GrammarError, Grammars
from batchgen.pipeline.engine.types import Request, SamplingParams
from tests.helpers.tiny_models import make_model
from tests.helpers.tiny_tokenizer import make_tokenizer

EOS = [2]


def schemas() -> list[dict]:
    """Nested schemas: objects in objects, arrays of objects, enums, integers and numbers with
    ranges, required and optional fields (bounded, as a schema for a model should be)."""
    person = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 10},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    return [
        person,
        {"type": "object", "additionalProperties": False, "required": ["verdict", "score"],
         "properties": {"verdict": {"enum": ["good", "bad", "unsure"]},
                        "score": {"type": "number", "minimum": 0, "maximum": 10},
                        "reasons": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}},
        {"type": "object", "additionalProperties": False, "required": ["people"],
         "properties": {"people": {"type": "array", "items": person, "minItems": 1, "maxItems": 2}}},
        {"type": "object", "additionalProperties": False, "required": ["a"],
         "properties": {"a": {"type": "object", "additionalProperties": False, "required": ["b"],
                              "properties": {"b": {"type": "object", "additionalProperties": False,
                                                   "required": ["c"],
                                                   "properties": {"c": {"type": "boolean"}}}}}}},
        {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
        {"type": "object", "additionalProperties": False, "required": ["id", "tags", "meta"],
         "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
                        "meta": {"type": "object", "additionalProperties": False, "required": ["ok"],
                                 "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"],
                                                                                    "maxLength": 5}}}}},
    ]


REGEXES = [r"[A-Z]{3}-\d{2}", r"(yes|no), because [a-z]{2,5}\.", r"\d{1,3}(\.\d)?"]
CHOICES = [["positive", "negative", "neutral"], ["A", "B", "C", "D"], ["the cat", "the dog"]]


def constrained_jobs(tok, grammars: Grammars):
    """60 schema jobs (some n > 1, some sampled), 9 regex and 9 choice jobs, 6 free ones; all under
    one shared system prompt."""
    jobs = []  # (request, kind, spec)
    ss = schemas()
    for i in range(60):
        schema = ss[i % len(ss)]
        params = SamplingParams(max_new_tokens=160, temperature=0.0 if i % 3 else 0.8, seed=i, n=1 + (i % 4 == 0))
        c = Constraint("json_schema", json.dumps(schema))
        jobs.append((Request(i, tok.encode_prompt(SYSTEM + f"Record {i} as JSON:"), params, grammar=grammars.factory(c)),
                     "json", schema))
    for i in range(9):
        key = len(jobs)
        kind, spec = ("regex", REGEXES[i % 3]) if i % 2 else ("choice", CHOICES[i % 3])
        c = Constraint(kind, spec if kind == "regex" else json.dumps(spec))
        params = SamplingParams(max_new_tokens=30, temperature=0.7 * (i % 2), seed=i, n=1 + (i == 4))
        jobs.append((Request(key, tok.encode_prompt(SYSTEM + f"Answer {i}:"), params, grammar=grammars.factory(c)),
                     kind, spec))
        c2 = Constraint("choice", json.dumps(CHOICES[i % 3]))
        jobs.append((Request(key + 1, tok.encode_prompt(SYSTEM + f"Pick {i}:"), SamplingParams(max_new_tokens=30),
                             grammar=grammars.factory(c2)), "choice", CHOICES[i % 3]))
    for i in range(6):
        jobs.append((Request(len(jobs), tok.encode_prompt(SYSTEM + f"Say {i}"), SamplingParams(max_new_tokens=8)),
                     None, None))
    return jobs


def test_every_constrained_output_parses_and_matches():
    tok = tokenizer()
    jobs = constrained_jobs(tok, Grammars(tok.hf))
    engine = Engine(make_model("llama"), eos_token_ids=EOS, min_shared_tokens=4)
    done = list(engine.run([r for r, _, _ in jobs]))
    assert len(done) == sum(r.params.n for r, _, _ in jobs)
    checked = {"json": 0, "regex": 0, "choice": 0}
    for c in done:
        request, kind, spec = jobs[c.key]
        assert c.error is None and c.cached_tokens > 0  # constraints leave prefix sharing alone
        text = tok.decode(c.token_ids)
        if kind is None:
            continue
        assert c.finish_reason == "stop", (kind, text)
        if kind == "json":
            jsonschema.validate(json.loads(text), spec)
        elif kind == "regex":
            assert re.fullmatch(spec, text), (spec, text)
        else:
            assert text in spec
        checked[kind] += 1
    assert checked["json"] >= 50 and checked["regex"] >= 4 and checked["choice"] >= 9
    # sampled samples of one job differ; rows really were constrained in shared batches
    assert engine.stats.cascade_batches > 0


def test_constraints_change_no_prefill_work():
    tok = tokenizer()
    jobs = constrained_jobs(tok, Grammars(tok.hf))[:20]
    free = [Request(r.key, r.prompt_ids, SamplingParams(max_new_tokens=4, n=r.params.n)) for r, _, _ in jobs]
    bound = [Request(r.key, r.prompt_ids, SamplingParams(max_new_tokens=4, n=r.params.n), grammar=r.grammar)
             for r, _, _ in jobs]
    model = make_model("qwen2")
    stats = []
    for reqs in (free, bound):
        engine = Engine(model, eos_token_ids=[], min_shared_tokens=4)
        cached = sorted((c.key, c.cached_tokens) for c in engine.run(reqs))
        stats.append((engine.stats.prefill_tokens, engine.stats.prefix_nodes, cached))
    assert stats[0] == stats[1]


def tokenizer_without_unk() -> PreTrainedTokenizerFast:
    """The tiny tokenizer with no <unk>: a character outside its vocabulary has no token at all."""
    spec = json.loads(make_tokenizer().backend_tokenizer.to_str())
    spec["model"]["unk_token"] = None
    return PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def test_a_grammar_dead_end_fails_its_row_alone():
    hf = tokenizer_without_unk()
    grammars = Grammars(hf)
    prompt = hf(SYSTEM + "Spell it:")["input_ids"]
    dead = grammars.factory(Constraint("regex", "ab\u00e9"))  # no token writes 'é'
    fine = grammars.factory(Constraint("choice", json.dumps(["ok", "fine"])))
    reqs = [Request(0, prompt, SamplingParams(max_new_tokens=10, n=2), grammar=dead),
            Request(1, prompt + [40], SamplingParams(max_new_tokens=10), grammar=fine),
            Request(2, prompt + [41], SamplingParams(max_new_tokens=10))]
    got = {(c.key, c.sample_index): c for c in Engine(make_model("llama"), eos_token_ids=EOS).run(reqs)}
    for s in (0, 1):
        c = got[(0, s)]
        assert c.finish_reason == "error" and "dead end after 2 tokens" in c.error, c.error
        assert hf.decode(c.token_ids) == "ab"
    assert got[(1, 0)].error is None and hf.decode(got[(1, 0)].token_ids) in ("ok", "fine")
    assert got[(2, 0)].error is None and len(got[(2, 0)].token_ids) == 10


@pytest.mark.parametrize("constraint, message", [
    (Constraint("regex", "(["), "invalid regex"),
    (Constraint("json_schema", '{"type": "foo"}'), "foo"),
    (Constraint("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'), "nope"),
])
def test_a_constraint_that_cannot_compile_is_refused_with_the_reason(constraint, message):
    grammars = Grammars(make_tokenizer())
    with pytest.raises(GrammarError, match=message):
        grammars.factory(constraint)


# A constraint holding a special token's text: llguidance spells the text it forces with the
# Hugging Face tokenizer, which reads "</s>" as the EOS token; the row then ended at once with
# '{"t":"' as a complete output. The text must be written with ordinary tokens.
SPECIAL_TEXT = [
    ("json_schema", {"type": "object", "additionalProperties": False, "required": ["t"],
                     "properties": {"t": {"const": "</s>"}}}, ['{"t":"</s>"}']),
    ("regex", r"end: </s>", ["end: </s>"]),
    ("regex", r"end: <\|im_end\|>", ["end: <|im_end|>"]),  # a special token that is not EOS here
    ("choice", ["<s> or </s>", "</s> and <s>"], ["<s> or </s>", "</s> and <s>"]),
]


def special_constraint(kind, spec) -> Constraint:
    return Constraint(kind, spec if kind == "regex" else json.dumps(spec))


@pytest.mark.parametrize("kind, spec, want", SPECIAL_TEXT)
def test_a_constraint_holding_a_special_tokens_text_writes_that_text(kind, spec, want):
    tok = tokenizer()
    grammars = Grammars(tok.hf)
    specials = set(tok.hf.all_special_ids)
    reqs = [Request(0, tok.encode_prompt(SYSTEM + "Write it:"), SamplingParams(max_new_tokens=40),
                    grammar=grammars.factory(special_constraint(kind, spec))),
            Request(1, tok.encode_prompt(SYSTEM + "Write it again:"),
                    SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, n=2),
                    grammar=grammars.factory(special_constraint(kind, spec)))]
    done = list(Engine(make_model("llama"), eos_token_ids=EOS + [5]).run(reqs))
    assert len(done) == 3
    for c in done:
        text = tok.decode(c.token_ids)
        assert c.error is None and c.finish_reason == "stop", (c.finish_reason, text)
        assert text in want and not specials & set(c.token_ids), (text, c.token_ids)
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), spec)
        elif kind == "regex":
            assert re.fullmatch(spec, text)


def forced_text(grammars: Grammars, constraint: Constraint, hf, limit: int = 64) -> str:
    """Walk a grammar that allows one text, taking the lowest allowed token at each step."""
    from batchgen.pipeline.engine.constrain import allowed_tokens

    m = grammars.factory(constraint)()
    ids = []
    while not m.accepting and len(ids) < limit:
        allowed = allowed_tokens([m], m.n_vocab)[0].nonzero().flatten().tolist()
        assert allowed, (m.error, hf.decode(ids))
        ids.append(allowed[0])
        m.accept(allowed[0])
    assert m.error is None and m.accepting
    assert not set(hf.all_special_ids) & set(ids), ids
    return hf.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_the_default_models_eos_text_in_a_constraint_is_written_as_text():
    """SmolLM2's EOS is <|im_end|>: a schema or regex holding that text is written out."""
    from batchgen.pipeline.model.load import default_model_path
    from batchgen.pipeline.text.tokenize import Tokenizer

    hf = Tokenizer.load(str(default_model_path())).hf
    assert hf.eos_token == "<|im_end|>"
    grammars = Grammars(hf)
    schema = {"type": "object", "additionalProperties": False, "required": ["t"],
              "properties": {"t": {"const": "<|im_end|>"}}}
    assert forced_text(grammars, Constraint("json_schema", json.dumps(schema)), hf) == '{"t":"<|im_end|>"}'
    assert forced_text(grammars, Constraint("regex", r"end: <\|im_end\|>"), hf) == "end: <|im_end|>"
    assert forced_text(grammars, Constraint("regex", r"<\|endoftext\|>!"), hf) == "<|endoftext|>!"


def test_min_tokens_holds_back_a_constraints_end_and_a_text_complete_before_it_fails_its_row():
    """min_tokens holds back EOS while the grammar allows more; a text complete before it (3
    digits of \\d{1,3}, a choice) ends its row with an error, never as a silent short `stop`."""
    tok = tokenizer()
    grammars = Grammars(tok.hf)
    digits = grammars.factory(Constraint("regex", r"\d{1,3}"))
    yes_no = grammars.factory(Constraint("choice", json.dumps(["yes", "no"])))
    prompt = tok.encode_prompt(SYSTEM + "Count:")
    reqs = [Request(m, prompt + [40 + m], SamplingParams(max_new_tokens=10, min_tokens=m, temperature=0.9, n=4),
                    grammar=digits) for m in (2, 3, 4)]
    reqs.append(Request(5, prompt, SamplingParams(max_new_tokens=10, min_tokens=5), grammar=yes_no))
    done = list(Engine(make_model("llama"), eos_token_ids=EOS).run(reqs))
    assert len(done) == 13
    for c in done:
        text = tok.decode(c.token_ids)
        if c.key in (2, 3):
            assert c.finish_reason == "stop" and c.error is None and re.fullmatch(r"\d{1,3}", text), text
            assert len(c.token_ids) >= c.key
        else:
            complete = 3 if c.key == 4 else len(c.token_ids)
            assert c.finish_reason == "error" and c.error == (
                f"its constraint's text is complete after {complete} tokens, before min_tokens ({c.key}): "
                "it allows no more; lower min_tokens"), (c.finish_reason, c.error, text)


def test_validate_refuses_a_choice_with_min_tokens_naming_both_fields(tmp_path, model_dir):
    from tests.helpers.cli_helpers import run, write_jsonl

    src = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "x", "choice": ["yes", "no"], "min_tokens": 5},
                                                {"prompt": "x", "regex": "[a-z]+", "min_tokens": 5, "id": "ok"}])
    res = run(["validate", str(src)], model_dir, ok=False)
    assert res.exit_code == 1
    assert (f"{src}:1: field 'min_tokens' is 5, but 'choice' is set: a choice ends where its text does, so "
            "min_tokens cannot hold back its end; remove one of them") in res.output, res.output
    assert f"{src}:2" not in res.output
    res = run(["validate", str(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "x", "choice": ["a"]}])),
               "--min-tokens", "2"], model_dir, ok=False)
    assert "field 'choice' is set, with min_tokens 2 (the default)" in res.output, res.output
