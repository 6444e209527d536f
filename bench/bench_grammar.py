"""Grammar engines for constrained decoding: xgrammar against llguidance, on the default model's
tokenizer (SmolLM2, 49,152 tokens), one matcher per row, as the engine uses them.

Per engine: the tokenizer set-up (once per run), compiling S distinct nested JSON Schemas (once per
distinct schema), and the per-step cost at B rows: fill every row's token bitmask, then advance
every row by one allowed token (a seeded random walk over the mask, the same policy for both).
Every number is the median of `--repeat` turns, both engines in turns in one process.

    PYTHONPATH=. python -m bench.bench_grammar --rows 32 --schemas 16 --steps 64

xgrammar is not a batchgen dependency: install it by hand to run this (`pip install --no-deps
xgrammar apache-tvm-ffi`; its triton requirement is for GPUs and not needed here).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def schemas(count: int) -> list[dict]:
    """Nested schemas (objects, arrays, enums, numbers, required fields), each a little different."""
    out = []
    for i in range(count):
        out.append({
            "type": "object", "additionalProperties": False,
            "required": ["name", "score", "tags", "meta"],
            "properties": {
                "name": {"type": "string", "maxLength": 12 + i},
                "score": {"type": "integer", "minimum": 0, "maximum": 100 + i},
                "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                "tags": {"type": "array", "items": {"enum": ["a", "b", f"c{i}"]}, "maxItems": 4},
                "meta": {"type": "object", "additionalProperties": False, "required": ["ok"],
                         "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}}},
            },
        })
    return out


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def fill(self, matchers, bitmask) -> None:
        import llguidance.torch as lt

        for i, m in enumerate(matchers):  # serial, as the engine fills them (see pipeline/text/grammar.py)
            lt.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, m, token: int) -> None:
        m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, m, token: int) -> None:
        m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


def allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def turn(engine, hf, vocab: int, args) -> dict[str, float]:
    ss = schemas(args.schemas)
    t = time.perf_counter()
    compiled = [engine.compile(s) for s in ss]
    compile_ms = (time.perf_counter() - t) * 1e3 / len(ss)
    rng = random.Random(0)
    matchers = [engine.matcher(compiled[r % len(compiled)]) for r in range(args.rows)]
    bitmask = torch.zeros((args.rows, (vocab + 31) // 32), dtype=torch.int32)
    fill_s = accept_s = 0.0
    steps = 0
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.fill(matchers, bitmask)
        fill_s += time.perf_counter() - t
        picks = [rng.choice(allowed(bitmask[i], vocab)) for i in range(len(matchers))]
        t = time.perf_counter()
        for m, p in zip(matchers, picks):
            engine.accept(m, p)
        accept_s += time.perf_counter() - t
        for i, m in enumerate(matchers):  # a finished row's slot takes a new row (continuous batching)
            if engine.done(m):
                matchers[i] = engine.matcher(compiled[rng.randrange(len(compiled))])
        steps += 1
    return {"compile_ms": compile_ms, "fill_ms": fill_s * 1e3 / steps, "accept_ms": accept_s * 1e3 / steps}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--schemas", type=int, default=16)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from batchgen.pipeline.model.load import default_model_path

    hf = AutoTokenizer.from_pretrained(default_model_path())
    vocab = len(hf)
    engines, setup = [], {}
    for cls in (LLGuidance, XGrammar):
        t = time.perf_counter()
        engines.append(cls(hf, vocab))
        setup[cls.name] = time.perf_counter() - t
    results: dict[str, list[dict]] = {e.name: [] for e in engines}
    for _ in range(args.repeat):
        for e in engines:
            results[e.name].append(turn(e, hf, vocab, args))
    print(f"B={args.rows} rows, {args.schemas} schemas, {args.steps} steps, vocab {vocab}, median of {args.repeat}")
    print("| engine | tokenizer set-up s | compile ms / schema | mask fill ms / step (B rows) | advance ms / step |")
    print("|---|---:|---:|---:|---:|")
    for name, turns in results.items():
        med = {k: statistics.median(t[k] for t in turns) for k in turns[0]}
        print(f"| {name} | {setup[name]:.2f} | {med['compile_ms']:.1f} | {med['fill_ms']:.2f} | {med['accept_ms']:.3f} |")


if __name__ == "__main__":
    main()
