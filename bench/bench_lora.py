"""A decode step's cost with LoRA adapters mixed in (pipeline/model/lora.py), on the default model.

One decode step of `--rows` rows, each with `--context` own tokens in its slot, through batchgen's
decoder (and with `--hf` transformers' model code too), its rows spread round-robin over 0 (every
row on the base model), 1 or 8 adapters, or `--adapters` as given. The adapters are random PEFT
LoRA checkpoints of `--rank` on all seven projections, written in peft's file layout (no peft
import needed to make them). Every configuration runs in turns, `--repeat` rounds of `--steps`
steps each, so the host's drift hits them alike; it prints each one's median step time, wall
and CPU (the thread's own time: on a shared host, waits for a core stay out of it), and their
ratios to the base model's.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.bench_lora --rows 64 --rank 8 --repeat 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, config, rank: int, seed: int) -> Path:
    """A random LoRA adapter of `rank` on every projection, as peft's `save_pretrained` lays it out."""
    from safetensors.torch import save_file

    from batchgen.pipeline.model.adapter_files import base_shape

    shape, g = base_shape(config), torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.layers):
        for proj in TARGETS:
            fan_in, fan_out = shape.shapes[proj]
            part = "self_attn" if proj[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
    return directory


def decode_step(forward, rows: int, context: int, adapters: int):
    """A decode step of `rows` rows over `context` own tokens each, rows round-robin over adapters 0..n
    (0 alone when n is 0; 1..n otherwise: every row on an adapter)."""
    from batchgen.pipeline.model.kv import RowKV
    from batchgen.pipeline.model.step import Decode, build

    kv = RowKV(forward.layer_shapes(), rows, context + 8, forward.dtype, forward.device)
    for s in kv.take(rows):
        kv.advance(s, context)  # the keys stay zeros: the cost does not depend on their values
    decode = [Decode(s, 0, adapter=1 + s % adapters if adapters else 0) for s in range(rows)]
    return build(decode, [100 + s for s in range(rows)], [], kv, forward.device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--adapters", default="0,1,8", help="adapter counts to compare (0: the base model)")
    p.add_argument("--steps", type=int, default=5, help="steps per turn")
    p.add_argument("--repeat", type=int, default=5, help="turns of every configuration")
    p.add_argument("--hf", action="store_true", help="also transformers' model code")
    args = p.parse_args()

    from batchgen.pipeline.model import kernels
    from batchgen.pipeline.model.adapter_files import inspect_adapter
    from batchgen.pipeline.model.hf import HFModel
    from batchgen.pipeline.model.load import load_model

    threads = kernels.set_threads()
    counts = [int(x) for x in args.adapters.split(",")]
    codes = {"decoder": load_model(None, "cpu", "float32")[0]}
    if args.hf:
        codes["transformers"] = HFModel(load_model(None, "cpu", "float32", own_decoder=False)[0])
    with tempfile.TemporaryDirectory() as tmp:
        config = codes["decoder"].config
        infos = [inspect_adapter(write_adapter(Path(tmp) / f"a{i}", config, args.rank, i), config)
                 for i in range(max(counts))]
        for forward in codes.values():
            forward.set_adapters(infos)
        steps = {(code, n): decode_step(f, args.rows, args.context, n) for code, f in codes.items() for n in counts}
        times = {key: [] for key in steps}
        cpu = {key: [] for key in steps}
        keep = torch.arange(args.rows)
        with torch.inference_mode():
            for key, step in steps.items():  # warm-up: oneDNN's first calls, the rotary table
                codes[key[0]].forward(step, keep)
            for _ in range(args.repeat):
                for key, step in steps.items():
                    for _ in range(args.steps):
                        t, c = time.perf_counter(), time.thread_time()
                        codes[key[0]].forward(step, keep)
                        times[key].append(time.perf_counter() - t)
                        cpu[key].append(time.thread_time() - c)
    print(f"threads {threads}, rows {args.rows}, context {args.context}, rank {args.rank}, all 7 projections")
    for (code, n), ts in times.items():
        med, base = statistics.median(ts), statistics.median(times[(code, counts[0])])
        c, c0 = statistics.median(cpu[(code, n)]), statistics.median(cpu[(code, counts[0])])
        print(f"{code:12s} adapters {n:2d}: wall {med * 1e3:8.2f} ms/step x{med / base:.2f} (min {min(ts) * 1e3:.2f}), "
              f"cpu {c * 1e3:8.2f} ms/step x{c / c0:.2f} of {counts[0]} adapters")


if __name__ == "__main__":
    main()
