"""Decode at the memory limit: one group of B rows over a P-token shared prefix.

Decode tokens/s (rows / median decode step time) and peak RSS for batchgen's cascade path (prefix K/V stored
and read once), its copy path (prefix copied into every row), and batched `model.generate`
(left-padded full prompts). Memory: each system alone in a fresh forked process. Speed: all systems
in turns (`--repeat` each) in one process, so the host's drift hits them alike. `--device cuda`:
the step times are taken with the device synchronized, and memory is CUDA's peak allocation, not RSS
(bench/gpu_check.sh runs it so, with `--model` a random model of SmolLM2's shape).

    PYTHONPATH=. python -m bench.bench_decode --rows 8,32,128 --prefix 512,2048 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import statistics
import time

import torch

SUFFIX, NEW = 16, 16
DEVICE, DTYPE, MODEL = "cpu", "float32", None  # set by main() before the children fork


def _sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def prompts(b: int, p: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(100, 49000) for _ in range(p)]
    return [head + [rng.randrange(100, 49000) for _ in range(SUFFIX)] for _ in range(b)]


def run_engine(model, ps, cascade: bool) -> dict:
    from batchgen.pipeline.engine.engine import Engine
    from batchgen.pipeline.engine.types import Request, SamplingParams

    engine = Engine(model, eos_token_ids=[], min_shared_tokens=16, max_batch_tokens=10**9, cascade=cascade)
    steps = []
    real = engine.forward

    def timed(step, keep):
        _sync()
        t = time.perf_counter()
        out = real(step, keep)
        _sync()
        if step.n_dec == step.tokens:  # a decode step: one token per row, no prefill beside it
            steps.append(time.perf_counter() - t)
        return out

    engine.forward = timed
    t = time.perf_counter()
    engine.generate([Request(i, x, SamplingParams(max_new_tokens=NEW)) for i, x in enumerate(ps)])
    return {"wall": time.perf_counter() - t, "steps": steps, "path": engine.attention_path}


def warm_up(model) -> None:
    from batchgen.pipeline.engine.engine import Engine
    from batchgen.pipeline.engine.types import Request, SamplingParams

    if hasattr(model, "generate"):  # transformers' model
        with torch.inference_mode():
            model(input_ids=torch.tensor([[100, 101, 102]], device=next(model.parameters()).device))
    else:
        Engine(model, eos_token_ids=[]).generate([Request(0, [100, 101, 102], SamplingParams(max_new_tokens=1))])


def run_generate(model, ps) -> dict:
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            _sync()
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(ps, device=next(model.parameters()).device)  # equal lengths: no padding needed
    model.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                       logits_processor=LogitsProcessorList([Stamp()]))
    end = time.perf_counter()
    return {"wall": end - t, "steps": [b - a for a, b in zip(stamps, stamps[1:])], "path": "generate"}


def child(system: str, b: int, p: int, threads: int, queue) -> None:
    torch.set_num_threads(threads)
    from batchgen.pipeline.model.load import load_model

    base = _rss_mb()  # the interpreter and libraries: not the group's memory
    # the engine's paths on what a CLI run loads (batchgen's decoder), `generate` on transformers' model
    model, _ = load_model(MODEL, DEVICE, DTYPE, own_decoder=False if system == "generate" else None)
    # a 3-token warm-up pages the weights in and initializes the kernels (about 25 MB here)
    warm_up(model)
    warm = _rss_mb()
    ps = prompts(b, p)
    cuda = DEVICE.startswith("cuda")
    if cuda:  # the device's memory: the model's, then the group's peak above it
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    else:
        # peaks from here on: loading packs the weights in place
        # (`kernels.pack_in_place`), and while it does, the checkpoint's pages and the packed copies
        # are both mapped, a load-time peak that is not the group's
        reset = _reset_peak()
    out = run_generate(model, ps) if system == "generate" else run_engine(model, ps, system == "cascade")
    if cuda:
        out["peak_rss_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["group_mb"] = (torch.cuda.max_memory_allocated() - held) / 2**20
    else:
        peak = _status_mb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["peak_rss_mb"] = peak - base
        out["group_mb"] = peak - warm  # what the group itself added on top of the loaded, warmed model
    queue.put(out)


def speed_child(systems: list[str], b: int, p: int, threads: int, repeat: int, queue) -> None:
    """Decode step times of every system, measured in turns in one process: the host's speed drifts
    by tens of percent over minutes here, and turns make a slow spell hit every system alike."""
    torch.set_num_threads(threads)
    from batchgen.pipeline.model.load import load_model

    own = load_model(MODEL, DEVICE, DTYPE)[0] if set(systems) - {"generate"} else None
    hf = load_model(MODEL, DEVICE, DTYPE, own_decoder=False)[0] if "generate" in systems else None
    ps = prompts(b, p)
    steps: dict[str, list[float]] = {s: [] for s in systems}
    for _ in range(repeat):
        for system in systems:
            out = run_generate(hf, ps) if system == "generate" else run_engine(own, ps, system == "cascade")
            steps[system] += out["steps"]
    queue.put(steps)


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def kv_bytes_per_token(c, itemsize: int = 4) -> int:
    heads = getattr(c, "num_key_value_heads", c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * heads * head_dim * itemsize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,32,128")
    ap.add_argument("--prefix", default="512,2048")
    ap.add_argument("--systems", default="cascade,copy,generate")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-generate-tokens", type=int, default=20000,
                    help="skip batched generate when B*P exceeds this (its prefill alone takes minutes here)")
    ap.add_argument("--max-copy-gb", type=float, default=8.0, help="skip the copy path above this much K/V")
    ap.add_argument("--repeat", type=int, default=3, help="turns per system in the speed process")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (memory: CUDA's peak allocation)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="a model directory (default: the default model)")
    args = ap.parse_args()
    global DEVICE, DTYPE, MODEL
    DEVICE, DTYPE, MODEL = args.device, args.dtype, args.model
    import os

    from transformers import AutoConfig

    from batchgen.pipeline.model.load import default_model_path

    path = args.model or default_model_path()  # the parent loads no weights (nor CUDA): children start small
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(path), getattr(torch, args.dtype).itemsize)
    weights_mb = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                     if f.endswith(".safetensors")) / 2**20
    ctx = mp.get_context("fork")
    results = []
    print(f"{args.device}, {args.dtype}. K/V {per_token / 1024:.0f} KiB/token, weights {weights_mb:.0f} MB; "
          f"{'peak = CUDA peak allocation' if args.device.startswith('cuda') else 'peak RSS is above the'} "
          "interpreter's own; group = peak RSS during the run above the loaded, warmed model; bound = (P + B*(suffix+new)) x K/V "
          "+ weights\n")
    print("| B | P | system | decode tok/s | vs copy | peak RSS MB | RSS / bound | weights + group MB | bound MB "
          "| (weights + group) / bound |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for p in map(int, args.prefix.split(",")):
        for b in map(int, args.rows.split(",")):
            bound = (p + b * (SUFFIX + NEW)) * per_token / 2**20 + weights_mb
            row = {}
            systems = [x for x in args.systems.split(",")
                       if not (x == "generate" and b * p > args.max_generate_tokens)
                       and not (x == "copy" and b * p * per_token / 2**30 > args.max_copy_gb)]
            for system in systems:  # memory: each system alone in a fresh process
                q = ctx.Queue()
                proc = ctx.Process(target=child, args=(system, b, p, args.threads, q))
                proc.start()
                row[system] = q.get()
                proc.join()
            q = ctx.Queue()  # speed: all systems in turns in one process
            proc = ctx.Process(target=speed_child, args=(systems, b, p, args.threads, args.repeat, q))
            proc.start()
            steps = q.get()
            proc.join()
            for system, out in row.items():
                # every row decodes every step (no EOS): rows / median step time over all turns
                out.update(system=system, rows=b, prefix=p, bound_mb=bound, steps=steps[system],
                           decode_tok_s=b / statistics.median(steps[system]))
                results.append(out)
            for system, out in row.items():
                ratio = out["decode_tok_s"] / row["copy"]["decode_tok_s"] if "copy" in row else float("nan")
                held = weights_mb + out["group_mb"]
                print(f"| {b} | {p} | {system} | {out['decode_tok_s']:.1f} | {ratio:.2f}x | {out['peak_rss_mb']:.0f} "
                      f"| {out['peak_rss_mb'] / bound:.2f} | {held:.0f} | {bound:.0f} | {held / bound:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kv_bytes_per_token": per_token, "weights_mb": weights_mb, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
