"""Constrained decoding's cost: B rows under one shared prefix, decoding T tokens, each row with a
JSON Schema (its own matcher; masks filled in one parallel call and applied in the batched
sampling step) against the same rows unconstrained, on the default model (SmolLM2-135M).

The schema (an array of at least 50 objects) cannot complete within T tokens, so both systems
decode every row for exactly T steps, the constrained rows through JSON's structure, keys,
strings and numbers. Decode time = the run's wall time minus a 1-token run's (the same prefill).
Both systems run in turns in one process (`--repeat` each, median), since this VM's speed drifts.
Since that drift can exceed the difference, the time spent choosing tokens (the engine's one
batched `sample` call per step: processors, masks, argmax) is also timed on its own: its increase
over the free rows' is the constraint's cost, whatever the forward's speed at that moment.

    PYTHONPATH=. python -m bench.bench_constrained --rows 32 --new 64 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "array", "minItems": 50, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 120},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                   "ok": {"type": "boolean"}}}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    from batchgen.jobs.params import Constraint
    from batchgen.pipeline.engine.engine import Engine
    from batchgen.pipeline.model.load import load_model
    from batchgen.pipeline.text.tokenize import Tokenizer
    from batchgen.pipeline.engine.types import Request, SamplingParams

    model, source = load_model(None, "cpu", "float32")
    tok = Tokenizer.load(source)
    head = ("You are a data generator. Produce realistic records of people for a test database, one JSON "
            "array per request, and nothing else. ") * 4
    prompts = [tok.encode_messages([{"role": "system", "content": head},
                                    {"role": "user", "content": f"Batch {i}: people from town {i}."}])
               for i in range(args.rows)]
    factory = tok.grammars.factory(Constraint("json_schema", json.dumps(SCHEMA)))

    import batchgen.pipeline.engine.engine as core

    choosing = [0.0]
    plain_sample = core.sample

    def timed_sample(logits, rows):
        t = time.perf_counter()
        out = plain_sample(logits, rows)
        choosing[0] += time.perf_counter() - t
        return out

    core.sample = timed_sample

    def run(constrained: bool, new: int) -> float:
        reqs = [Request(i, x, SamplingParams(max_new_tokens=new), grammar=factory if constrained else None)
                for i, x in enumerate(prompts)]
        engine = Engine(model, eos_token_ids=[], max_batch_tokens=args.rows * (len(max(prompts, key=len)) + new))
        choosing[0] = 0.0
        t = time.perf_counter()
        done = list(engine.run(reqs))
        wall = time.perf_counter() - t
        if new > 1:
            sampling[name_of(constrained)].append(choosing[0])
        assert len(done) == args.rows and all(len(c.token_ids) == new for c in done), "rows ended early"
        assert engine.stats.batches == 1
        if constrained and new > 1:
            text = tok.decode(done[0].token_ids)
            assert text.startswith("[{"), text
        return wall

    def name_of(constrained: bool) -> str:
        return "constrained" if constrained else "free"

    sampling: dict[str, list[float]] = {"free": [], "constrained": []}
    run(True, 2)  # warm-up: compiles the grammar, builds llguidance's tokenizer
    sampling["constrained"].clear()
    walls: dict[str, list[float]] = {"free": [], "constrained": []}
    prefill: dict[str, list[float]] = {"free": [], "constrained": []}
    for _ in range(args.repeat):
        for name, constrained in (("free", False), ("constrained", True)):
            prefill[name].append(run(constrained, 1))
            walls[name].append(run(constrained, args.new))
    decode = {k: statistics.median(w) - statistics.median(prefill[k]) for k, w in walls.items()}
    print(f"B={args.rows} rows, {args.new} new tokens, float32, {torch.get_num_threads()} threads, "
          f"median of {args.repeat}")
    steps = args.new - 1
    pick = {k: statistics.median(v) / args.new * 1e3 for k, v in sampling.items()}  # ms per step
    print("| rows | ms / step free | ms / step JSON Schema | wall overhead | choosing ms / step free | "
          "choosing ms / step JSON Schema | its cost / free step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.rows} | {decode['free'] / steps * 1e3:.1f} | {decode['constrained'] / steps * 1e3:.1f} | "
          f"{decode['constrained'] / decode['free'] - 1:+.1%} | {pick['free']:.2f} | {pick['constrained']:.2f} | "
          f"{(pick['constrained'] - pick['free']) / (decode['free'] / steps * 1e3):+.1%} |")


if __name__ == "__main__":
    main()
