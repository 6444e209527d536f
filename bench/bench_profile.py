"""Where batchgen's time goes, against the weight-matmul floor, on a real-text workload.

Runs the engine in-process on a `bench/corpus.py` job file with the embedded model and splits each
forward's wall time into weight matmuls (the linear layers), attention (batchgen's attention
function) and the rest (norms, rotary embeddings, activations, sampling, Python). The floor of a
phase is its weight-matmul FLOPs (2 x tokens x linear parameters, plus 2 x logit rows x vocab x
hidden for the LM head) at the linear rate measured in the same process at the same shapes:
what the phase would cost if it were nothing but weight matmuls at full speed (each forward at
the rate measured for its own number of rows). Attention GFLOP
counts what its kernel calls compute (4 x query rows x keys x head size; half of it for causal
calls); the attention floor is those FLOPs at the GEMM rate (the linear rate at 2,048 rows): what
attention would cost with a kernel as fast as a GEMM. A phase's wall time is set against both
floors together. Decode calls also count the bytes of keys and values they must read (each row's
own, each anchor's once): at the memory read rate measured here, a third floor, which the first
two do not hold (a decoding row's own keys are read once per step whatever the kernel).
A second table splits attention's time: the compiled prefill and decode kernels' calls (each at
its own rate), the stores of new keys and values into their buffers (`Step.store`: where those
pages are written for the first time, their page faults), and the rest around them. The profile's
own counting of each call's FLOPs and bytes is timed and taken out of the engine's, the phases' and
attention's times.
The machine may drift while the workload runs: the GEMM rate at 2,048 rows is measured before the run
too, and a change of more than a tenth is reported (no ratio to a floor is firm then); a phase's
"linear / floor" (its linear layers' time against their floor) near 1 says its floors were taken at
the speed it ran at.

Then it counts the kernels (ATen ops that compute; views excluded) of one decode step, dynamic
and static (`Engine(static_decode=True)`, the shapes a CUDA graph can capture).

    python -m bench.bench_profile --workload fewshot --dtype float32
    python -m bench.bench_profile --workload fewshot_1k --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

from bench import corpus

VIEWS = {"aten::view", "aten::reshape", "aten::transpose", "aten::slice", "aten::select", "aten::as_strided",
         "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::t", "aten::permute", "aten::alias",
         "aten::_unsafe_view", "aten::detach", "aten::lift_fresh", "aten::empty", "aten::empty_strided",
         "aten::contiguous", "aten::_reshape_alias", "aten::split", "aten::chunk", "aten::narrow",
         "aten::result_type", "aten::resolve_conj", "aten::resolve_neg", "aten::is_nonzero", "aten::item",
         "aten::_local_scalar_dense", "aten::to", "aten::_to_copy", "aten::unbind", "aten::expand_as",
         "aten::view_as", "aten::empty_like", "aten::matmul", "aten::linear", "aten::dropout"}


def model_linears(model) -> list[tuple[str, object, str, int, int]]:
    """(name, holder, attribute, in, out) of every weight matmul the model's forwards run, each
    called as `getattr(holder, attribute)`: the decoder's fused layers (`batchgen.pipeline.model.decoder`) or a
    transformers model's `nn.Linear` modules."""
    from batchgen.pipeline.model.decoder import Decoder

    if isinstance(model, Decoder):
        c = model.config
        h, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
        shapes = {"qkv": (h, (c.num_attention_heads + 2 * c.num_key_value_heads) * d),
                  "o": (c.num_attention_heads * d, h), "gate": (h, inter), "up": (h, inter), "down": (inter, h),
                  "glu": (h, 2 * inter)}  # gate and up in one pass, with silu * up (`native.Gemm.glu`)
        out = [(f"layers.{i}.{n}", layer, n, *shapes[n]) for i, layer in enumerate(model.layers) for n in shapes
               if (n == "glu") == (layer.glu is not None) or n not in ("gate", "up", "glu")]
        return out + [("lm_head", model, "lm_head", h, c.vocab_size)]
    return [(n, m, "forward", m.in_features, m.out_features) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)]


def linear_rate(dtype: torch.dtype, m: int, model, clock=time.perf_counter) -> float:
    """GFLOP/s of the model's own linear layers (one layer's) at M rows, run as the engine runs them."""
    from batchgen.pipeline.model import kernels
    from batchgen.pipeline.model.decoder import Decoder

    if isinstance(model, Decoder):
        calls = [(getattr(holder, attr), i, o) for name, holder, attr, i, o in model_linears(model)
                 if name.startswith("layers.0.")]
        fast = []
    else:
        layers = [l for l in model.modules() if isinstance(l, torch.nn.Linear)][:7]
        calls = [(l, l.in_features, l.out_features) for l in layers]
        fast = kernels.fast_linears(model)
    x = {i: torch.randn(m, i, dtype=dtype) for _, i, _ in calls}
    flops = sum(2 * m * i * o for _, i, o in calls)
    with torch.inference_mode(), kernels.linears_on_onednn(fast):
        for _ in range(2):
            for f, i, _ in calls:
                f(x[i])
        t = clock()
        for _ in range(5):
            for f, i, _ in calls:
                f(x[i])
    return flops * 5 / (clock() - t) / 1e9


def read_bandwidth(gb: float = 1.0) -> float:
    """GB/s of reading a buffer far larger than the caches (a sum over `gb` of float32) on the
    process's threads: what a decode step's keys and values stream at, at best."""
    x = torch.ones(int(gb * 1e9 / 4))
    x.sum()
    t = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * gb / (time.perf_counter() - t)


def bucket(rows: int) -> int:
    """The power of two at or above `rows`: the row counts whose linear rate is measured."""
    return 1 << max(0, (rows - 1).bit_length())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="fewshot", choices=[*corpus.WORKLOADS, "fewshot_1k"],
                   help="a workload at its own defaults; fewshot_1k: bench_engine's 1,024 jobs in 16 subjects")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--max-new-tokens", type=int, default=None, help="the workload's own if not given")
    p.add_argument("--anchors", default="matmul", choices=["matmul", "matmul-avx512", "tiles"],
                   help="the compiled decode kernel's anchors (batchgen.pipeline.model.native.ANCHORS): tiles is the kernel "
                        "the matrix products replaced")
    p.add_argument("--json", default=None)
    p.add_argument("--model-code", default="batchgen", choices=["batchgen", "transformers"],
                   help="batchgen's own decoder (pipeline/model/decoder.py) or transformers' model code")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from batchgen.pipeline.model import attention
    from batchgen.pipeline.engine.engine import Engine
    from batchgen.pipeline.model.load import load_model
    from batchgen.pipeline.engine.types import Request, SamplingParams

    from batchgen.pipeline.model.decoder import Decoder

    model, source = load_model(None, "cpu", args.dtype, own_decoder=args.model_code == "batchgen")
    tok = AutoTokenizer.from_pretrained(source)
    build, kwargs = (corpus.fewshot, {"subjects": 16, "questions": 64}) if args.workload == "fewshot_1k" \
        else (corpus.WORKLOADS[args.workload], {})
    rows = build(**kwargs, **({} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}))
    reqs = [Request(i, tok(r["prompt"]).input_ids, SamplingParams(max_new_tokens=r["max_new_tokens"], n=r.get("n", 1)))
            for i, r in enumerate(rows)]
    config = model.config
    linears = model_linears(model)
    linear_params = sum(i * o for n, _, _, i, o in linears if "lm_head" not in n)
    head_flops = 2 * config.vocab_size * config.hidden_size

    Engine(model, eos_token_ids=[]).generate(reqs[:2])  # warm-up: kernels, probes, allocator
    # the GEMM rate before the run too: a shared machine drifts, and floors taken at a faster (or slower)
    # moment than the phases ran would read as the engine's own gap (BENCHMARKS.md, "ninth session")
    rate_before = linear_rate(model.dtype, 2048, model)
    engine = Engine(model, eos_token_ids=[])
    phases = defaultdict(lambda: defaultdict(float, by_rows=[]))
    timer = {"attention": 0.0, "linear": 0.0, "attention_gflop": 0.0, "kv_gb": 0.0}
    split_keys = ("decode_kernel", "decode_gflop", "prefill_kernel", "prefill_gflop", "store")  # attention's parts
    timer.update(dict.fromkeys(split_keys, 0.0), counting=0.0)
    real_attention, real_linear = attention.attend, torch.nn.Linear.forward

    def timing(fn, key):  # perf_counter around every call: light enough for a decode step's 200 linears
        def timed(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            timer[key] += time.perf_counter() - t
            return out
        return timed

    real_attend = attention._attend

    def attend(q, k, v, mask, scale, softcap, causal=False, decode=False):  # FLOPs of every kernel call
        b, hq, n, d = q.shape
        timer["attention_gflop"] += 4 * b * hq * n * k.shape[2] * d / (2 if causal else 1) / 1e9
        return real_attend(q, k, v, mask, scale, softcap, causal, decode)

    real_native = attention.native.decode_attention

    def native_attend(q, own_k, own_v, slot, own_len, anc_k, anc_v, anc_len, scale, out, **kw):
        t = time.perf_counter()  # this counting is the profile's own work: taken out of the phase's times
        own = int(own_len.sum())
        gflop = 4 * q.shape[1] * (own + int(anc_len[anc_k != 0].sum())) * q.shape[2] / 1e9
        timer["attention_gflop"] += gflop
        timer["decode_gflop"] += gflop
        # the bytes a decode call must read at least: every row's own keys and values, each anchor's once
        anchors = {(int(a), int(n)) for a, n in zip(anc_k.tolist(), anc_len.tolist()) if a}
        read = own + sum(n for _, n in anchors)
        timer["kv_gb"] += 2 * read * own_k.shape[1] * own_k.shape[3] * own_k.element_size() / 1e9
        timer["counting"] += time.perf_counter() - t
        t = time.perf_counter()
        result = real_native(q, own_k, own_v, slot, own_len, anc_k, anc_v, anc_len, scale, out,
                             **{"anchors": args.anchors, **kw})
        timer["decode_kernel"] += time.perf_counter() - t
        return result

    real_prefill = attention.native.prefill_attention

    def prefill_attend(q, hkv, t0, t1, own_k, own_v, own_cap, own_index, offset, anc_k, anc_v, anc_len, scale, out):
        t = time.perf_counter()
        n, before = t1 - t0, offset + anc_len * (anc_k != 0)  # a token at own index i reads before + i + 1 keys
        keys = int((n * before + n * (n + 1) // 2).sum())
        gflop = 4 * q.shape[1] * keys * q.shape[2] / 1e9
        timer["attention_gflop"] += gflop
        timer["prefill_gflop"] += gflop
        timer["counting"] += time.perf_counter() - t
        t = time.perf_counter()
        result = real_prefill(q, hkv, t0, t1, own_k, own_v, own_cap, own_index, offset, anc_k, anc_v, anc_len,
                              scale, out)
        timer["prefill_kernel"] += time.perf_counter() - t
        return result

    from batchgen.pipeline.model.step import Step

    real_store = Step.store
    Step.store = timing(real_store, "store")
    attention._attend = attend
    attention.native.decode_attention = native_attend
    attention.native.prefill_attention = prefill_attend
    attention.attend = timing(real_attention, "attention")  # both model codes call it per layer
    if not isinstance(model, Decoder):  # transformers' model code: oneDNN's linears, switched on per forward
        engine.model.linears = [(m, timing(f, "linear")) for m, f in engine.model.linears]
    if isinstance(model, Decoder):  # its fused layers are callables on the layers
        packed = [(holder, attr, getattr(holder, attr)) for _, holder, attr, _, _ in linears]
    else:  # packed in place by load_model: oneDNN's for good
        packed = [(m, "forward", m.forward) for m in model.modules()
                  if isinstance(m, torch.nn.Linear) and "forward" in vars(m)]
    for holder, name, f in packed:
        setattr(holder, name, timing(f, "linear"))
    torch.nn.Linear.forward = timing(real_linear, "linear")
    real_forward = engine.forward

    def forward(step, keep):
        phase = "prefill" if step.n_dec == 0 else ("decode" if step.n_dec == step.tokens else "mixed")
        timer.update(dict.fromkeys(timer, 0.0))
        t = time.perf_counter()
        out = real_forward(step, keep)
        ph = phases[phase]
        ph["wall"] += time.perf_counter() - t - timer["counting"]
        ph["forwards"] += 1
        ph["tokens"] += step.tokens
        ph["attention"] += timer["attention"] - timer["counting"]
        ph["counting"] += timer["counting"]
        ph["linear_measured"] += timer["linear"]
        ph["attention_gflop"] += timer["attention_gflop"]
        ph["kv_gb"] += timer["kv_gb"]
        for key in split_keys:
            ph[key] += timer[key]
        flops = 2 * linear_params * step.tokens + head_flops * len(keep)
        ph["flops"] += flops
        ph["by_rows"].append((step.tokens, flops))  # each forward's floor at its own row count's rate
        return out

    engine.forward = forward
    t = time.perf_counter()
    engine.generate(reqs)
    total = time.perf_counter() - t - sum(ph["counting"] for ph in phases.values())
    attention.attend = real_attention
    attention._attend = real_attend
    Step.store = real_store
    attention.native.decode_attention = real_native
    attention.native.prefill_attention = real_prefill
    torch.nn.Linear.forward = real_linear
    for holder, name, f in packed:
        setattr(holder, name, f)
    # each forward's floor at the rate of its own row count (rounded up to a power of two): a
    # decode step of 5 rows runs its GEMMs far below the 2,048-row rate, and so would any engine
    needed = {bucket(m) for ph in phases.values() for m, _ in ph["by_rows"]} | {64, 2048}
    rates = {m: linear_rate(engine.dtype, m, model) for m in sorted(needed)}
    bandwidth = read_bandwidth()

    print(f"## {args.workload}, {args.dtype}, {args.model_code}'s model code, anchors {args.anchors}, "
          f"{args.threads} threads: {len(reqs)} jobs, prefill "
          f"{engine.stats.prefill_tokens} tokens, {engine.stats.completion_tokens} new tokens, {total:.1f} s in the engine")
    print(f"linear rate here: {rates[2048]:.0f} GFLOP/s at 2048 rows (the GEMM rate of the attention floor), "
          f"{rates[64]:.0f} at 64 rows (oneDNN); memory read {bandwidth:.1f} GB/s (the decode KV floor)")
    drift = rates[2048] / rate_before
    print(f"before the run, {rate_before:.0f} GFLOP/s at 2048 rows: "
          + ("steady" if abs(drift - 1) <= 0.1 else f"the machine drifted by {drift - 1:+.0%}: "
             "no ratio to a floor below is firm") + "\n")
    print("| phase | forwards | tokens | wall s | linear s | attention s | other s | matmul floor s | linear / floor "
          "| wall / floor | attention GFLOP | attention GFLOP/s | attention floor s | wall / both floors "
          "| decode KV read GB | KV read floor s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    report = {"total_s": total, "rates": rates, "rate_before_2048": rate_before, "phases": {}}
    for name in ("prefill", "mixed", "decode"):
        ph = phases.get(name)
        if not ph:
            continue
        floor = sum(f / rates[bucket(m)] for m, f in ph.pop("by_rows")) / 1e9
        attention_floor = ph["attention_gflop"] / rates[2048]  # attention's FLOPs at the GEMM rate
        other = ph["wall"] - ph["linear_measured"] - ph["attention"]
        print(f"| {name} | {ph['forwards']:.0f} | {ph['tokens']:.0f} | {ph['wall']:.2f} | {ph['linear_measured']:.2f} | "
              f"{ph['attention']:.2f} | {other:.2f} | {floor:.2f} | {ph['linear_measured'] / floor:.2f} | "
              f"{ph['wall'] / floor:.2f} | "
              f"{ph['attention_gflop']:.0f} | {ph['attention_gflop'] / max(ph['attention'], 1e-9):.0f} | "
              f"{attention_floor:.2f} | {ph['wall'] / (floor + attention_floor):.2f} | {ph['kv_gb']:.1f} | "
              f"{ph['kv_gb'] / bandwidth:.2f} |")
        report["phases"][name] = {**ph, "floor_s": floor, "attention_floor_s": attention_floor,
                                  "kv_read_floor_s": ph["kv_gb"] / bandwidth}
    # attention's column split: the compiled kernels' calls (their own FLOPs and rate) and the rest of
    # `attention.attend` around them (KV stores, views, the PyTorch path where a kernel is not taken)
    print("\n| phase | prefill kernel s | its GFLOP/s | decode kernel s | its GFLOP/s | KV stores s | rest of attention s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, ph in report["phases"].items():
        glue = ph["attention"] - ph["prefill_kernel"] - ph["decode_kernel"] - ph["store"]
        print(f"| {name} | {ph['prefill_kernel']:.2f} | {ph['prefill_gflop'] / max(ph['prefill_kernel'], 1e-9):.0f} | "
              f"{ph['decode_kernel']:.2f} | {ph['decode_gflop'] / max(ph['decode_kernel'], 1e-9):.0f} | "
              f"{ph['store']:.2f} | {glue:.2f} |")
    report["kernels_per_decode_step"] = {mode: kernels_per_decode_step(model, reqs, mode == "static")
                                         for mode in ("dynamic", "static")}
    print(f"\nkernels per decode step (32 rows): {report['kernels_per_decode_step']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def kernels_per_decode_step(model, reqs, static: bool) -> int:
    """ATen ops that compute (no views) in one decode step of 32 rows."""
    from batchgen.pipeline.engine.engine import Engine

    engine = Engine(model, eos_token_ids=[], static_decode=static)
    counts = []
    real = engine.forward

    def forward(step, keep):
        if step.n_dec != step.tokens or counts:
            return real(step, keep)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = real(step, keep)
        counts.append(sum(e.count for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::"))
                          and e.key not in VIEWS))
        return out

    engine.forward = forward
    engine.generate(reqs[:32])
    return counts[0]


if __name__ == "__main__":
    raise SystemExit(main())
