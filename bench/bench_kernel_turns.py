"""Two builds of the compiled attention kernels in the engine, in alternating turns in one process.

The engine runs a `bench/corpus.py` workload on this checkout's kernels (`pipeline/model/cpu_attention.c`)
and on the same kernels built from another revision's sources (`--old REV`, read with `git show`), one
after the other, `--turns` times, so that both meet the same load on a shared machine. Per build and
phase it reports the wall time, the time in the compiled kernels, and the wall time over the phase's
two floors as `bench_profile` defines them (weight-matmul FLOPs at the linear rate for each forward's
own number of rows, plus attention FLOPs at the 2,048-row linear rate), both floors measured once in
the same process; medians over turns. With 1 thread every time is the thread's CPU time (wall time
on a loaded machine measures the load), the floors' rates too.

    python -m bench.bench_kernel_turns --workload samples --old HEAD~1 --turns 3 --threads 1
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.bench_attention import cpu_model
from bench.bench_profile import bucket, linear_rate, model_linears
from batchgen.pipeline.model import native


def old_library(rev: str, fold: int, head: int, out: Path) -> ctypes.CDLL:
    """The kernels of revision `rev`, built with this checkout's flags, loaded as `native` loads them."""
    # every C source of that revision's model package: its files are not this checkout's (they were split)
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "pipeline/model/"], capture_output=True,
                           check=True, text=True, cwd=native.SOURCE.parents[2]).stdout.split()
    for name in (n for n in names if n.endswith(".c")):
        text = subprocess.run(["git", "show", f"{rev}:{name}"], capture_output=True, check=True,
                              cwd=native.SOURCE.parents[2]).stdout
        (out / Path(name).name).write_bytes(text)
    target = out / "old.so"
    subprocess.run(["cc", *native.FLAGS, native.THREADING[0][0], f"-DBATCHGEN_G={fold}", f"-DBATCHGEN_D={head}",
                    "-o", str(target), str(out / native.SOURCE.name)], check=True)
    return native.declare(ctypes.CDLL(str(target)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="samples", choices=["fewshot", "system_prompt", "samples", "long_document"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=None, help="the workload's own if not given")
    p.add_argument("--old", default="HEAD~1", help="the git revision whose kernels to compare against")
    p.add_argument("--turns", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    from transformers import AutoTokenizer

    from bench import corpus
    from batchgen.pipeline.engine.engine import Engine
    from batchgen.pipeline.engine.types import Request, SamplingParams
    from batchgen.pipeline.model.load import load_model

    model, source = load_model(None, "cpu", args.dtype, own_decoder=True)
    tok = AutoTokenizer.from_pretrained(source)
    rows = corpus.WORKLOADS[args.workload](**({} if args.max_new_tokens is None else
                                               {"max_new_tokens": args.max_new_tokens}))
    reqs = [Request(i, tok(r["prompt"]).input_ids, SamplingParams(max_new_tokens=r["max_new_tokens"], n=r.get("n", 1)))
            for i, r in enumerate(rows)]
    c = model.config
    fold, head = c.num_attention_heads // c.num_key_value_heads, c.head_dim
    linear_params = sum(i * o for n, _, _, i, o in model_linears(model) if "lm_head" not in n)
    head_flops = 2 * c.vocab_size * c.hidden_size
    libs = {"new": native._lib(fold, head)}
    with tempfile.TemporaryDirectory() as tmp:
        libs["old"] = old_library(args.old, fold, head, Path(tmp))
    timer = {"kernel": 0.0, "gflop": 0.0}
    real_decode, real_prefill = native.decode_attention, native.prefill_attention

    def written(call, out):
        """`call(out)`; a library that writes float32 only (a revision before the kernels wrote bfloat16)
        writes into a float32 buffer, cast into `out` after the call, as the engine then cast it."""
        if out.dtype == torch.float32 or native._libs[(fold, head)] is libs["new"]:
            return call(out)
        wide = out.new_empty(out.shape, dtype=torch.float32)
        ok = call(wide)
        out.copy_(wide)
        return ok

    def decode(q, own_k, own_v, slot, own_len, anc_k, anc_v, anc_len, scale, out, **kw):
        timer["gflop"] += 4 * q.shape[1] * (int(own_len.sum()) + int(anc_len[anc_k != 0].sum())) * q.shape[2] / 1e9
        t = clock()
        ok = written(lambda o: real_decode(q, own_k, own_v, slot, own_len, anc_k, anc_v, anc_len, scale, o, **kw), out)
        timer["kernel"] += clock() - t
        return ok

    def prefill(q, hkv, t0, t1, own_k, own_v, own_cap, own_index, offset, anc_k, anc_v, anc_len, scale, out):
        n, before = t1 - t0, offset + anc_len * (anc_k != 0)
        timer["gflop"] += 4 * q.shape[1] * int((n * before + n * (n + 1) // 2).sum()) * q.shape[2] / 1e9
        t = clock()
        ok = written(lambda o: real_prefill(q, hkv, t0, t1, own_k, own_v, own_cap, own_index, offset, anc_k, anc_v,
                                            anc_len, scale, o), out)
        timer["kernel"] += clock() - t
        return ok

    native.decode_attention, native.prefill_attention = decode, prefill
    results = {name: defaultdict(lambda: defaultdict(list)) for name in libs}
    floors: dict[str, list] = defaultdict(list)  # per phase: (rows, weight-matmul FLOPs) of each forward
    for lib in libs.values():  # warm-up: each build's first calls, the probes, the allocator
        native._libs[(fold, head)] = lib
        Engine(model, eos_token_ids=[]).generate(reqs[:2])
    for turn in range(1, args.turns + 1):
        for name, lib in libs.items():
            native._libs[(fold, head)] = lib
            engine = Engine(model, eos_token_ids=[])
            real_forward, phases = engine.forward, defaultdict(lambda: defaultdict(float))

            def forward(step, keep, real_forward=real_forward, phases=phases, name=name, turn=turn):
                phase = "prefill" if step.n_dec == 0 else ("decode" if step.n_dec == step.tokens else "mixed")
                timer["kernel"] = timer["gflop"] = 0.0
                t = clock()
                out = real_forward(step, keep)
                ph = phases[phase]
                ph["wall"] += clock() - t
                ph["kernel"] += timer["kernel"]
                ph["gflop"] += timer["gflop"]
                if turn == 1 and name == "new":
                    floors[phase].append((step.tokens, 2 * linear_params * step.tokens + head_flops * len(keep)))
                return out

            engine.forward = forward
            engine.generate(reqs)
            for phase, ph in phases.items():
                for key, value in ph.items():
                    results[name][phase][key].append(value)
    native._libs[(fold, head)] = libs["new"]
    native.decode_attention, native.prefill_attention = real_decode, real_prefill
    needed = {bucket(m) for forwards in floors.values() for m, _ in forwards} | {2048}
    rates = {m: linear_rate(model.dtype, m, model, clock) for m in sorted(needed)}
    print(f"{cpu_model()}, {args.workload}, {args.dtype}, {args.threads} threads, {args.turns} turns, "
          f"old = {args.old}, {'CPU' if args.threads == 1 else 'wall'} time; linear rate {rates[2048]:.0f} GFLOP/s at 2,048 rows; medians\n")
    kind = "CPU" if args.threads == 1 else "wall"
    print(f"| phase | build | {kind} s | kernel s | attention GFLOP/s | matmul floor s | attention floor s "
          f"| {kind} / both floors |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for phase, forwards in floors.items():
        floor = sum(f / rates[bucket(m)] for m, f in forwards) / 1e9
        for name in ("old", "new"):
            ph = {k: statistics.median(v) for k, v in results[name][phase].items()}
            attention_floor = ph["gflop"] / rates[2048]
            print(f"| {phase} | {name} | {ph['wall']:.2f} | {ph['kernel']:.2f} | {ph['gflop'] / ph['kernel']:.0f} | "
                  f"{floor:.2f} | {attention_floor:.2f} | {ph['wall'] / (floor + attention_floor):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
