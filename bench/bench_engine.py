"""Benchmark batchgen's Engine against plain transformers generation on prefix-sharing workloads.

Systems, all on the same model, device, dtype and thread count:
  loop            model.generate, one row at a time (no batching, no sharing). Slow: with
                  --loop-sample K only K evenly spaced rows are timed and the wall time is
                  extrapolated linearly (marked `*`).
  batched         model.generate on left-padded batches of --peer-batch rows (no sharing);
                  prefill tokens = rows x longest prompt, per batch.
  generate_batch  transformers' continuous batching (paged cache, block-level prefix sharing);
                  prefill tokens = prompt tokens its scheduler actually sent to the model.
  batchgen        pipeline.engine.Engine; prefill tokens = engine.stats.prefill_tokens.

Every row generates exactly --max-new-tokens tokens: EOS is disabled everywhere (Engine gets
eos_token_ids=[]; generate gets eos_token_id=None with the model's own default cleared;
generate_batch gets eos_token_id=-1, its "no EOS" value), so throughputs compare the same
work. Rows that come back shorter are counted and flagged.

Each (workload, system) runs in a fresh process so ru_maxrss is that system's peak:
--isolate fork (default on CPU: the parent imports torch/transformers but never runs an op,
then forks one child per measurement) or spawn (re-invokes this script with --only SYSTEM,
the default when a GPU may be in use, since CUDA does not survive fork), or none (in-process,
RSS then is cumulative). Each child loads the model, runs a tiny warm-up through the same
code path, then times the workload.

Workload token ids are synthetic (see bench/workloads.py); --text FILE draws them from
FILE tokenized with the model's tokenizer instead.

    PYTHONPATH=. python -m bench.bench_engine --smoke
    PYTHONPATH=. python -m bench.bench_engine --workload all --loop-sample 16 --json bench.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

# Imported up front (no ops run) so forked children start warm.
import torch
import transformers  # noqa: F401
from transformers import GenerationConfig, LlamaConfig

from bench import workloads as W

SYSTEMS = ["loop", "batched", "generate_batch", "batchgen"]
RESULT_TAG = "BENCH_RESULT "


# -- model ------------------------------------------------------------------------------------

def _resolve(device: str, dtype: str):
    try:
        from pipeline.model import resolve_device, resolve_dtype
    except ImportError:  # pipeline/model.py not there yet
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                           ("cpu" if device == "auto" else device))
        dt = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}[dtype]
        return dev, dt
    dev = resolve_device(device)
    return dev, resolve_dtype(dtype, dev)


def tiny_model(device, dtype):
    """A 2-layer random Llama with the default model's vocabulary (fixed seed: same in every process)."""
    from transformers import AutoModelForCausalLM

    config = LlamaConfig(vocab_size=W.DEFAULT_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval(), None


def load(args):
    if args.model == "tiny":
        dev, dt = _resolve(args.device, args.dtype)
        return tiny_model(dev, dt)
    from pipeline.model import load_model

    return load_model(None if args.model == "default" else args.model, args.device, args.dtype)


def pad_id(model) -> int:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return int(eos) if eos is not None else 0


def build_workload(name: str, args, vocab: int) -> W.Workload:
    pool = None
    if args.text:
        if args.model == "tiny":
            raise SystemExit("--text needs a model with a tokenizer (not --model tiny)")
        from transformers import AutoTokenizer

        from pipeline.model import default_model_path

        tok_dir = str(default_model_path()) if args.model == "default" else args.model
        pool = AutoTokenizer.from_pretrained(tok_dir)(Path(args.text).read_text())["input_ids"]
    return W.build(name, scale=args.scale, seed=args.seed, vocab=vocab, pool=pool)


# -- the systems ------------------------------------------------------------------------------

def rows_of(wl: W.Workload) -> list[list[int]]:
    """One prompt per row: samples repeat their prompt (peers share nothing)."""
    return [p for p in wl.prompts for _ in range(wl.n)]


def gen_config(model, wl: W.Workload, max_new: int, **extra) -> GenerationConfig:
    sampling = {} if wl.greedy else dict(temperature=wl.temperature, top_k=0, top_p=1.0)
    return GenerationConfig(max_new_tokens=max_new, do_sample=not wl.greedy, eos_token_id=None,
                            pad_token_id=pad_id(model), **sampling, **extra)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run_loop(model, wl, max_new, args, timed_rows=None):
    rows = rows_of(wl)
    index = list(range(len(rows)))
    if timed_rows is not None and timed_rows < len(rows):
        step = len(rows) / timed_rows
        index = sorted({int(i * step) for i in range(timed_rows)})
    dev = model.device
    config = gen_config(model, wl, max_new)
    out = {}
    t = time.perf_counter()
    for i in index:
        ids = torch.tensor([rows[i]], device=dev)
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        out[i] = seq[0, ids.shape[1]:].tolist()
    _sync(dev)
    wall = time.perf_counter() - t
    return dict(wall_s=wall, rows_timed=len(index), prefill_tokens=sum(len(r) for r in rows), outputs=out)


@torch.inference_mode()
def run_batched(model, wl, max_new, args):
    rows = rows_of(wl)
    dev = model.device
    pad = pad_id(model)
    config = gen_config(model, wl, max_new)
    out, prefill = {}, 0
    t = time.perf_counter()
    for start in range(0, len(rows), args.peer_batch):
        chunk = rows[start:start + args.peer_batch]
        width = max(len(r) for r in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, r in enumerate(chunk):  # left padding
            ids[j, width - len(r):] = torch.tensor(r)
            mask[j, width - len(r):] = 1
        seq = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=config)
        for j, row in enumerate(seq[:, width:].tolist()):
            out[start + j] = row
        prefill += len(chunk) * width
    _sync(dev)
    return dict(wall_s=time.perf_counter() - t, prefill_tokens=prefill, outputs=out)


def cb_sizes(wl: W.Workload, max_new: int, args, device) -> tuple[int, int]:
    """(num_blocks, max_batch_tokens) for generate_batch; its defaults size the cache from free memory.

    Blocks: every distinct prompt token once (radix lower bound), plus per row a partial prompt
    block and its generated tokens, plus slack for prompts prefilled side by side in one batch
    (those cannot share: a block is shared only once it is computed). With fewer blocks it
    queues requests rather than failing; with many more only its RSS grows.
    """
    page = args.cb_page_size
    mbt = args.cb_max_batch_tokens or (512 if device.type == "cpu" else 2048)
    if args.cb_num_blocks:
        return args.cb_num_blocks, mbt
    longest = math.ceil(max(len(p) for p in wl.prompts) / page) + math.ceil(max_new / page) + 1
    blocks = math.ceil(wl.lower_bound / page) + wl.rows * (math.ceil(max_new / page) + 2)
    return blocks + 2 * math.ceil(mbt / page) + longest, mbt


@torch.inference_mode()
def run_generate_batch(model, wl, max_new, args):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import scheduler as cb_scheduler
    from transformers.generation.continuous_batching.requests import RequestStatus

    # Count the prompt tokens the scheduler actually sends to the model (after prefix matches).
    counter = {"prefill": 0}
    original = cb_scheduler.Scheduler._schedule_request

    def counting(self, state, *a, **kw):
        prefilling = state.status != RequestStatus.DECODING
        result = original(self, state, *a, **kw)
        if prefilling:
            counter["prefill"] += len(state.tokens_to_process)
        return result

    cb_scheduler.Scheduler._schedule_request = counting
    try:
        blocks, mbt = cb_sizes(wl, max_new, args, model.device)
        config = gen_config(model, wl, max_new, num_return_sequences=wl.n)
        config.eos_token_id = -1  # generate_batch's "no EOS"; None falls back to model.config's
        cb = ContinuousBatchingConfig(page_size=args.cb_page_size, num_blocks=blocks, max_batch_tokens=mbt,
                                      allow_block_sharing=True)
        t = time.perf_counter()
        results = model.generate_batch(inputs=wl.prompts, generation_config=config, continuous_batching_config=cb)
        _sync(model.device)
        wall = time.perf_counter() - t
    finally:
        cb_scheduler.Scheduler._schedule_request = original
    outs = list(results.values())  # input order; a parent's forked children come before it
    errors = [o.error for o in outs if o.error is not None]
    out = {i: list(o.generated_tokens) for i, o in enumerate(outs)}
    return dict(wall_s=wall, prefill_tokens=counter["prefill"], outputs=out, errors=len(errors) + wl.rows - len(outs),
                cb_num_blocks=blocks, cb_max_batch_tokens=mbt)


@torch.inference_mode()
def run_batchgen(model, wl, max_new, args):
    from pipeline.engine import Engine
    from pipeline.types import Request, SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=wl.temperature, n=wl.n)
    requests = [Request(i, p, params) for i, p in enumerate(wl.prompts)]
    engine = Engine(model, eos_token_ids=[], min_shared_tokens=args.min_shared_tokens,
                    max_batch_tokens=args.engine_max_batch_tokens)
    out = {}
    t = time.perf_counter()
    for c in engine.run(requests):
        out[c.key * wl.n + c.sample_index] = c.token_ids
    _sync(model.device)
    wall = time.perf_counter() - t
    s = engine.stats
    return dict(wall_s=wall, prefill_tokens=s.prefill_tokens, outputs=out, errors=s.rows - len(out),
                engine_stats=vars(s).copy())


RUNNERS = {"loop": run_loop, "batched": run_batched, "generate_batch": run_generate_batch, "batchgen": run_batchgen}


# -- one measurement (runs in its own process) --------------------------------------------------

def measure(system: str, wl_name: str, args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    model, _ = load(args)
    load_s = time.perf_counter() - t0
    model.generation_config.eos_token_id = None  # or generate() fills the None we pass from here
    vocab = model.config.vocab_size
    wl = build_workload(wl_name, args, vocab)
    runner = RUNNERS[system]
    if not args.no_warmup:
        warm = W.Workload("warmup", [list(range(200, 232)), list(range(200, 224)) + [300] * 4], 0, "",
                          n=min(wl.n, 2), temperature=wl.temperature)
        runner(model, warm, 2, args)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    if system == "loop":
        r = run_loop(model, wl, args.max_new_tokens, args, timed_rows=args.loop_sample)
    else:
        r = runner(model, wl, args.max_new_tokens, args)
    outputs = r.pop("outputs")
    timed = r.get("rows_timed", wl.rows)
    lengths = [len(v) for v in outputs.values()]
    r.update(
        system=system, workload=wl_name, rows=wl.rows, rows_timed=timed, extrapolated=timed < wl.rows,
        wall_s_timed=r["wall_s"], wall_s=r["wall_s"] * wl.rows / timed,
        completion_tokens_timed=sum(lengths),
        completion_tokens=round(sum(lengths) * wl.rows / timed) if timed else 0,
        short_rows=sum(n != args.max_new_tokens for n in lengths) + timed - len(outputs),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        cuda_peak_mb=(torch.cuda.max_memory_allocated(model.device) / 2**20 if model.device.type == "cuda" else None),
        load_s=load_s, threads=torch.get_num_threads(), device=str(model.device), dtype=str(model.dtype),
        lower_bound=wl.lower_bound, prompt_tokens=wl.prompt_tokens, description=wl.description,
    )
    r.setdefault("errors", 0)
    r["tok_per_s"] = r["completion_tokens"] / r["wall_s"] if r["wall_s"] > 0 else float("nan")
    # greedy rows' ids, compared across systems in the parent (dropped before --json)
    r["all_outputs"] = {str(i): v for i, v in outputs.items()} if wl.greedy else {}
    return r


def _fork_child(system, wl_name, args, conn):
    try:
        conn.send(("ok", measure(system, wl_name, args)))
    except BaseException as e:  # report, never hang the parent
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
    finally:
        conn.close()


def run_isolated(system: str, wl_name: str, args) -> dict:
    if args.isolate == "none":
        return measure(system, wl_name, args)
    if args.isolate == "fork":
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_fork_child, args=(system, wl_name, args, child))
        p.start()
        child.close()
        try:
            status, payload = parent.recv()
        except EOFError:
            status, payload = "error", f"child died (exit code {p.join() or p.exitcode})"
        p.join()
        if status != "ok":
            raise RuntimeError(f"{system} on {wl_name} failed:\n{payload}")
        return payload
    cmd = [sys.executable, "-m", "bench.bench_engine", "--only", system, "--workload", wl_name, *forwarded(args)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise RuntimeError(f"{system} on {wl_name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}")


def forwarded(args) -> list[str]:
    out = []
    for name in ("model", "device", "dtype", "threads", "max_new_tokens", "scale", "loop_sample", "peer_batch",
                 "seed", "text", "min_shared_tokens", "engine_max_batch_tokens", "cb_page_size", "cb_num_blocks",
                 "cb_max_batch_tokens"):
        v = getattr(args, name)
        if v is not None:
            out += ["--" + name.replace("_", "-"), str(v)]
    if args.no_warmup:
        out.append("--no-warmup")
    return out


# -- report -----------------------------------------------------------------------------------

def agreement(results: dict[str, dict], wl_greedy: bool) -> dict[str, str]:
    """Greedy rows whose ids equal batchgen's, per system (over the rows both produced)."""
    ref = results.get("batchgen", {}).get("all_outputs")
    if not wl_greedy or not ref:
        return {}
    out = {}
    for name, r in results.items():
        if name == "batchgen":
            continue
        other = r.get("all_outputs", {})
        common = [k for k in other if k in ref]
        out[name] = f"{sum(other[k] == ref[k] for k in common)}/{len(common)}"
    return out


def table(wl_name: str, results: dict[str, dict], greedy: bool) -> str:
    any_r = next(iter(results.values()))
    bg = results.get("batchgen")
    agree = agreement(results, greedy)
    lines = [f"### {wl_name}: {any_r['description']}",
             f"rows {any_r['rows']}, prompt tokens {any_r['prompt_tokens']}, radix lower bound {any_r['lower_bound']}, "
             f"device {any_r['device']} {any_r['dtype']}, threads {any_r['threads']}", ""]
    lines.append("| system | wall s | prefill tok | completion tok | tok/s | peak RSS MB | batchgen speedup | greedy = batchgen |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        star = "*" if r["extrapolated"] else ""
        speed = f"{bg['tok_per_s'] / r['tok_per_s']:.2f}x" if bg and r["tok_per_s"] > 0 else "-"
        mem = f"{r['peak_rss_mb']:.0f}" + (f" (cuda {r['cuda_peak_mb']:.0f})" if r.get("cuda_peak_mb") else "")
        flag = f" ({r['short_rows']} short, {r['errors']} err)" if r["short_rows"] or r["errors"] else ""
        lines.append(f"| {name}{flag} | {r['wall_s']:.2f}{star} | {r['prefill_tokens']} | {r['completion_tokens']} | "
                     f"{r['tok_per_s']:.1f}{star} | {mem} | {speed} | {agree.get(name, '-') if name != 'batchgen' else 'ref'} |")
    notes = []
    if bg:
        notes.append(f"batchgen prefill / lower bound = {bg['prefill_tokens']}/{bg['lower_bound']} = "
                     f"{bg['prefill_tokens'] / bg['lower_bound']:.3f}")
    if any(r["extrapolated"] for r in results.values()):
        lo = results.get("loop")
        notes.append(f"* extrapolated from {lo['rows_timed']} of {lo['rows']} rows ({lo['wall_s_timed']:.2f} s timed)")
    return "\n".join(lines + [""] + notes)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="system_prompt", choices=[*W.WORKLOADS, "all"])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--model", default="default", help="default | tiny | PATH (save_pretrained dir or hub id in cache)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--scale", type=float, default=1.0, help="multiply jobs per shared prefix (floor 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=None, help="draw prompt tokens from this text file (model tokenizer)")
    p.add_argument("--loop-sample", type=int, default=None, help="time only K loop rows, extrapolate")
    p.add_argument("--peer-batch", type=int, default=32)
    p.add_argument("--min-shared-tokens", type=int, default=16)
    p.add_argument("--engine-max-batch-tokens", type=int, default=65536)
    p.add_argument("--cb-page-size", type=int, default=32)
    p.add_argument("--cb-num-blocks", type=int, default=None, help="default: sized from the workload")
    p.add_argument("--cb-max-batch-tokens", type=int, default=None,
                   help="default 512 on CPU (fewer prompts per prefill batch: more block sharing, faster), else 2048")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--isolate", choices=["auto", "fork", "spawn", "none"], default="auto")
    p.add_argument("--json", default=None, help="save raw numbers here")
    p.add_argument("--smoke", action="store_true", help="--model tiny, all workloads and systems, --scale 0.05, --threads 1")
    p.add_argument("--only", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)  # worker mode
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.scale, args.workload, args.systems = "tiny", 0.05, "all", ",".join(SYSTEMS)
        # one thread: on a small shared CPU, OpenMP threads spin against other load (seen: 30x slower)
        args.threads = args.threads or 1
        args.device = "cpu" if args.device == "auto" else args.device
    if args.isolate == "auto":
        gpu_possible = args.device != "cpu" and (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd"))
        args.isolate = "spawn" if gpu_possible else "fork"
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.only:
        r = measure(args.only, args.workload, args)
        print(RESULT_TAG + json.dumps(r), flush=True)
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    names = list(W.WORKLOADS) if args.workload == "all" else [args.workload]
    report = {"args": vars(args), "workloads": {}}
    t_all = time.perf_counter()
    for wl_name in names:
        results = {}
        for system in systems:
            print(f"[{wl_name}] {system} ...", file=sys.stderr, flush=True)
            results[system] = run_isolated(system, wl_name, args)
        greedy = W.build(wl_name, scale=args.scale).greedy
        print(table(wl_name, results, greedy) + "\n", flush=True)
        agree = agreement(results, greedy)
        for r in results.values():
            r.pop("all_outputs", None)
            r["greedy_agree_with_batchgen"] = agree.get(r["system"])
            bg = results.get("batchgen")
            r["batchgen_speedup"] = bg["tok_per_s"] / r["tok_per_s"] if bg and r["tok_per_s"] > 0 else None
        report["workloads"][wl_name] = results
    print(f"total {time.perf_counter() - t_all:.1f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
