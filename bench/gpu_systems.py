"""The systems bench/gpu_check.py measures in one process on one device, and how each is measured.

Every system gets the same token ids and generates exactly `max_new` tokens per row (no EOS: the
model is a random one of SmolLM2's shape, and a length-bound run makes the systems' work equal):
- batchgen: its engine on the model `load_model` gives for the device (transformers' model code on a
  GPU; batchgen's own decoder on a CPU), eager, static-shape decode steps where the device is CUDA;
- generate: batched `model.generate`, left-padded, `hf_batch` rows per call (bench/hf_run.py's way);
- generate_batch: transformers' continuous batching, pages shared between prompts, sized explicitly.

Per run: wall time (the device synchronized), completion tokens, and peak memory (CUDA: the most
allocated above what was allocated at the start; CPU: peak RSS, its high-water mark reset first).
Per decode step (`per_step`): events of `torch.profiler` by the difference of two runs that differ
only in `extra` more new tokens, divided by `extra`: on CUDA kernels launched, device kernels,
stream synchronisations and host-device copies; on a CPU the aten operators (nested ones included).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

Run = Callable[[list[list[int]], int], dict]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batchgen(model) -> Run:
    from batchgen.pipeline.engine.engine import Engine
    from batchgen.pipeline.engine.types import Request, SamplingParams

    def run(prompts: list[list[int]], max_new: int) -> dict:
        engine = Engine(model, eos_token_ids=[])
        out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=max_new)) for i, p in enumerate(prompts)])
        s = engine.stats
        return {"completion_tokens": sum(len(c.token_ids) for c in out), "decode_steps": s.decode_steps,
                "prefill_tokens": s.prefill_tokens, "static_decode": engine.static_decode}

    return run


def generate(model, hf_batch: int) -> Run:
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None  # length-bound, as the others

    def run(prompts: list[list[int]], max_new: int) -> dict:
        config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
        device, n = next(model.parameters()).device, 0
        for start in range(0, len(prompts), hf_batch):
            chunk = prompts[start : start + hf_batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            n += out.shape[0] * (out.shape[1] - width)
        return {"completion_tokens": n, "rows_per_call": hf_batch}

    return run


def generate_batch(model, page: int = 32, max_batch_tokens: int = 2048) -> Run:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    def run(prompts: list[list[int]], max_new: int) -> dict:
        config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        tokens = sum(len(p) + max_new for p in prompts)
        # every request's pages fit at once; the defaults take a share of all memory (slow on a CPU)
        blocks = tokens // page + 2 * len(prompts) + 8
        cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens,
                                      allow_block_sharing=True,
                                      auto_switch_to_flash=False)  # flash kernels come from the Hub: no network
        with torch.inference_mode():
            out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb,
                                       progress_bar=False)
        return {"completion_tokens": sum(len(o.generated_tokens) for o in out.values()), "page_size": page,
                "num_blocks": blocks, "max_batch_tokens": max_batch_tokens}

    return run


# -- measuring ---------------------------------------------------------------------------------

def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:  # 5: reset the peak RSS (VmHWM), Linux 4.0+
            f.write("5")
        return True
    except OSError:
        return False


def timed(run: Run, prompts: list[list[int]], max_new: int, device: torch.device) -> dict:
    """One run: its own result, wall seconds, and its peak memory in MB."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start_mem = torch.cuda.memory_allocated(device)
    else:
        reset = _reset_rss_peak()
        start_mem = _status_mb("VmRSS")
    sync(device)
    t = time.perf_counter()
    out = run(prompts, max_new)
    sync(device)
    out["wall_s"] = time.perf_counter() - t
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        out.update(peak_mb=peak / 2**20, peak_above_start_mb=(peak - start_mem) / 2**20, memory="cuda allocated")
    else:
        peak = _status_mb("VmHWM") if reset else float("nan")
        out.update(peak_mb=peak, peak_above_start_mb=peak - start_mem, memory="peak RSS")
    return out


def _is_device(event) -> bool:
    return str(getattr(event, "device_type", "")).rsplit(".", 1)[-1] in ("CUDA", "PrivateUse1")


def event_counts(prof, device: torch.device) -> dict[str, int]:
    events = list(prof.events())
    out = {"aten_ops": sum(e.name.startswith("aten::") and not _is_device(e) for e in events)}
    if device.type == "cuda":
        host = [e for e in events if not _is_device(e)]
        out["kernels"] = sum(_is_device(e) and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()
                             for e in events)
        out["launches"] = sum(("LaunchKernel" in e.name or "GraphLaunch" in e.name) for e in host)
        out["graph_launches"] = sum("GraphLaunch" in e.name for e in host)
        out["syncs"] = sum(e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
                           for e in host)
        out["memcpy"] = sum("Memcpy" in e.name for e in host)
    return out


def per_step(run: Run, prompts: list[list[int]], max_new: int, extra: int, device: torch.device) -> dict:
    """Profiler events per decode step: (events at max_new + extra) - (events at max_new), / extra."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    counts = []
    for n in (max_new, max_new + extra):
        with profile(activities=activities) as prof:
            run(prompts, n)
            sync(device)
        counts.append(event_counts(prof, device))
    # None where more tokens added none: generate_batch runs its loop on a thread of its own, whose
    # CPU operators this thread's profiler does not record (CUDA kernels it records device-wide)
    return {k: (counts[1][k] - counts[0][k]) / extra if counts[1][k] > counts[0][k] else None for k in counts[0]}


def batchgen_host_syncs(model, prompts: list[list[int]], max_new: int) -> dict:
    """`.item()`, `.tolist()`, `.cpu()` and scalar conversions per decode step of batchgen's engine
    (bench/host_syncs.py), on any device."""
    from batchgen.pipeline.engine.engine import Engine
    from batchgen.pipeline.engine.types import Request, SamplingParams
    from bench.host_syncs import counting

    engine = Engine(model, eos_token_ids=[])
    with counting(engine) as split:
        engine.generate([Request(i, p, SamplingParams(max_new_tokens=max_new)) for i, p in enumerate(prompts)])
    return {"decode_steps": split.steps["decode"], **split.per_step()}
