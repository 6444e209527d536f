"""The Python half of bench/gpu_check.sh: the model a device run benchmarks, the in-process bench of
batchgen, batched `generate` and `generate_batch` (bench/gpu_systems.py), and the summary.

    python -m bench.gpu_check model --shape .gpu/smollm2 --dest /tmp/smollm2-random [--layers N]
    python -m bench.gpu_check bench --model DIR --device cuda --dtype bfloat16 --size full --out OUT
    python -m bench.gpu_check summary --out OUT

`model`: a random model of SmolLM2-135M's exact shape (its config, its tokenizer; weights drawn from a
seed), saved with the tokenizer as a model directory every step loads: the real weights do not fit
what a run carries, and per token a random model costs what the real one does. `--layers` cuts it for
the CPU check. Without `--shape` the shape is read from the default model's converted directory.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
from pathlib import Path

SIZES = {  # workload -> (bench.corpus builder, its arguments) per size
    "full": {"system_prompt": ("system_prompt", dict(groups=8, jobs=8, max_new_tokens=16)),
             "system_prompt_decode": ("system_prompt", dict(groups=8, jobs=8, max_new_tokens=64)),
             "fewshot": ("fewshot", dict(subjects=4, questions=16, max_new_tokens=16))},
    "tiny": {"system_prompt": ("system_prompt", dict(groups=2, jobs=2, max_new_tokens=4))},
}
TURNS = {"full": 2, "tiny": 1}
PROFILE = {"full": (16, 4, 8), "tiny": (2, 2, 2)}  # (rows, new tokens, extra new tokens) of the per-step profile
SYSTEMS = ("batchgen", "generate", "generate_batch")
HF_BATCH = 16  # rows per `generate` call, as bench_engine's hf-batched system


def build_model(shape: Path | None, dest: Path, layers: int | None, seed: int = 0) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape is None:
        from batchgen.pipeline.model.load import default_model_path

        shape = Path(default_model_path())
    config = AutoConfig.from_pretrained(shape)
    if layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    for f in shape.iterdir():  # the tokenizer's files (the config and weights are the ones just saved)
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, dest / f.name)
    info = {"shape_from": str(shape), "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads, "vocab": config.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters())}
    (dest / "bench_model.json").write_text(json.dumps(info, indent=1))
    return info


def workload(name: str, size: str, tokenizer) -> tuple[list[list[int]], int]:
    from bench import corpus

    builder, kwargs = SIZES[size][name]
    rows = getattr(corpus, builder)(**kwargs)
    return [tokenizer(r["prompt"]).input_ids for r in rows], kwargs["max_new_tokens"]


def device_info(device) -> dict:
    import torch
    import transformers

    info = {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}
    if device.type == "cuda":
        info.update(name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    memory_gb=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1))
    else:
        info["name"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def bench(model_dir: Path, device_name: str, dtype: str, size: str, out: Path, systems: list[str]) -> dict:
    import torch
    from transformers import AutoTokenizer

    from bench import gpu_systems as gs
    from batchgen.pipeline.model.load import load_model, resolve_device

    device = resolve_device(device_name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    runs: dict[str, gs.Run] = {}
    if "batchgen" in systems:
        engine_model = load_model(str(model_dir), device_name, dtype)[0]
        runs["batchgen"] = gs.batchgen(engine_model)
    if {"generate", "generate_batch"} & set(systems):
        hf = load_model(str(model_dir), device_name, dtype, pack_weights=False, own_decoder=False)[0]
        if "generate" in systems:
            runs["generate"] = gs.generate(hf, HF_BATCH)
        if "generate_batch" in systems:
            runs["generate_batch"] = gs.generate_batch(hf)
    report = {"info": device_info(device), "dtype": dtype, "size": size, "turns": TURNS[size],
              "model": json.loads((model_dir / "bench_model.json").read_text()), "workloads": {}}
    rows, new, extra = PROFILE[size]
    for name in SIZES[size]:
        prompts, max_new = workload(name, size, tok)
        result = report["workloads"][name] = {"jobs": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                                              "max_new_tokens": max_new, "systems": {}}
        for s, run in runs.items():  # an untimed warm-up: kernels load, caches allocate
            try:
                run(prompts[:2], 2)
            except Exception as e:  # noqa: BLE001 - one system failing costs its column, not the table
                result["systems"][s] = {"failed": f"warm-up: {type(e).__name__}: {str(e)[:300]}"}
        ready = [s for s in runs if s not in result["systems"]]
        for turn in range(TURNS[size]):
            for s in ready[turn % len(ready):] + ready[: turn % len(ready)]:  # turns, rotated
                entry = result["systems"].setdefault(s, {"runs": []})
                if "failed" in entry:
                    continue
                try:
                    entry["runs"].append(gs.timed(runs[s], prompts, max_new, device))
                except Exception as e:  # noqa: BLE001
                    entry["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
                said = entry.get("failed") or f"{entry['runs'][-1]['wall_s']:.2f} s"
                print(f"[{name}] turn {turn + 1} {s}: {said}", flush=True)
        for s in ready:
            entry = result["systems"][s]
            if entry.get("runs"):
                walls = [r["wall_s"] for r in entry["runs"]]
                entry["wall_s"] = statistics.median(walls)
                entry["completion_tokens"] = entry["runs"][-1]["completion_tokens"]
                entry["tokens_per_s"] = entry["completion_tokens"] / entry["wall_s"]
                entry["peak_mb"] = max(r["peak_mb"] for r in entry["runs"])
                entry["peak_above_start_mb"] = max(r["peak_above_start_mb"] for r in entry["runs"])
            if "failed" not in entry and name == next(iter(SIZES[size])):  # per-step counts: the first workload
                try:
                    entry["per_decode_step"] = gs.per_step(runs[s], prompts[:rows], new, extra, device)
                except Exception as e:  # noqa: BLE001
                    entry["per_decode_step"] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
                if s == "batchgen":
                    entry["host_syncs_per_decode_step"] = gs.batchgen_host_syncs(engine_model, prompts[:rows], new + extra)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # after every workload: a run cut short by its time limit keeps what it measured
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(report, indent=1))
        (out / "bench.md").write_text(table(report))
    print(table(report))
    return report


def table(report: dict) -> str:
    info, model = report["info"], report["model"]
    lines = [f"Device: {info.get('name')} ({info['device']}); torch {info['torch']}, transformers "
             f"{info['transformers']}, Python {info['python']}; {report['dtype']}; a random model of SmolLM2-135M's "
             f"shape ({model['layers']} layers, {model['parameters'] / 1e6:.1f}M parameters); medians of "
             f"{report['turns']} turns; every row generates exactly max_new_tokens.", "",
             "Per decode step (the difference of two runs that differ only in more new tokens): kernels and "
             "stream synchronisations on CUDA, aten operators on every device (generate_batch's loop runs on its "
             "own thread: its operators are not seen).", "",
             "| workload | system | wall s | tokens/s | batchgen faster by | kernels / decode step | syncs / step "
             "| aten ops / step | peak MB | above start MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, w in report["workloads"].items():
        ref = w["systems"].get("batchgen", {}).get("wall_s")
        for s, e in w["systems"].items():
            label = f"{name} ({w['jobs']} jobs, {w['prompt_tokens']} prompt tokens, {w['max_new_tokens']} new)"
            if "wall_s" not in e:
                lines.append(f"| {label} | {s} | failed: {e.get('failed', '?')[:100]} | | | | | | | |")
                continue
            step = e.get("per_decode_step", {})
            cell = lambda k: f"{step[k]:.1f}" if isinstance(step.get(k), float) else "-"  # noqa: E731
            lines.append(f"| {label} | {s} | {e['wall_s']:.2f} | {e['tokens_per_s']:.0f} | "
                         f"{e['wall_s'] / ref:.2f}x | {cell('kernels')} | {cell('syncs')} | {cell('aten_ops')} | "
                         f"{e['peak_mb']:.0f} | {e['peak_above_start_mb']:.0f} |" if ref else
                         f"| {label} | {s} | {e['wall_s']:.2f} | {e['tokens_per_s']:.0f} | - | {cell('kernels')} | "
                         f"{cell('syncs')} | {cell('aten_ops')} | {e['peak_mb']:.0f} | {e['peak_above_start_mb']:.0f} |")
    for name, w in report["workloads"].items():
        h = w["systems"].get("batchgen", {}).get("host_syncs_per_decode_step")
        if h:
            lines += ["", f"batchgen's host synchronisations per decode step ({name}, {h['decode_steps']} decode steps): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in h.items() if k != "decode_steps" and v)
                      + " (`all`: `.item()`, `.tolist()`, `.cpu()`, scalar conversions; `upload`: host-to-device "
                      "copies beside them; bench/host_syncs.py)"]
    return "\n".join(lines) + "\n"


# -- the summary ---------------------------------------------------------------------------------

def _junit(path: Path) -> dict:
    """pytest's --junitxml, per dtype (the bfloat16 tests say so in their names): tests passed, failed
    (errors included), skipped, and the failures' names."""
    import xml.etree.ElementTree as ET

    out: dict = {}
    for c in ET.parse(path).getroot().iter("testcase"):
        name = c.get("name", "")
        tally = out.setdefault("bfloat16" if "bfloat16" in name else "float32",
                               {"passed": 0, "failed": 0, "skipped": 0, "failures": []})
        kinds = {child.tag for child in c}
        if kinds & {"failure", "error"}:
            tally["failed"] += 1
            tally["failures"].append(name)
        elif "skipped" in kinds:
            tally["skipped"] += 1
        else:
            tally["passed"] += 1
    return out


def _last_json(path: Path) -> dict | None:
    for line in reversed(path.read_text().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def summary(out: Path) -> dict:
    """Everything a run left under OUT in one JSON and one Markdown page."""
    steps = []
    if (out / "steps.tsv").exists():
        for line in (out / "steps.tsv").read_text().splitlines():
            name, rc, seconds, note = (line.split("\t") + ["", "", ""])[:4]
            steps.append({"step": name, "rc": int(rc), "seconds": float(seconds), "note": note})
    result: dict = {"steps": steps}
    if (out / "env.json").exists():
        result["install"] = json.loads((out / "env.json").read_text())
    if (out / "equivalence.xml").exists():
        result["equivalence"] = _junit(out / "equivalence.xml")
    if (out / "fuzz.jsonl").exists():
        result["fuzz"] = _last_json(out / "fuzz.jsonl")
        result["fuzz_findings"] = [json.loads(x) for x in (out / "fuzz.jsonl").read_text().splitlines()
                                   if x.startswith("{") and '"summary"' not in x][:50]
    if (out / "bench.json").exists():
        result["bench"] = json.loads((out / "bench.json").read_text())
    lines = ["# GPU check", "", "| step | exit | seconds | note |", "|---|---:|---:|---|"]
    lines += [f"| {s['step']} | {s['rc']} | {s['seconds']:.0f} | {s['note']} |" for s in steps]
    install = result.get("install", {})
    lines += ["", f"Python {install.get('python', '?')}; installed from the carried wheels: "
              f"{', '.join(install.get('installed', {})) or 'nothing'}; unsatisfied: "
              f"{'; '.join(install.get('unsatisfied', [])) or 'none'}", "", "## Equivalence", ""]
    for dtype, tests in result.get("equivalence", {}).items():
        lines.append(f"- tests/engine/test_engine.py, {dtype}: {tests['passed']} passed, {tests['failed']} failed, "
                     f"{tests['skipped']} skipped" + (f" (failed: {', '.join(tests['failures'])})" if tests["failures"] else ""))
    fuzz = result.get("fuzz")
    if fuzz:
        lines.append(f"- fuzz (seeds {fuzz['seeds']}, {fuzz['device']}, float32 and bfloat16): fatal {fuzz['fatal']}, "
                     f"counts {fuzz['counts']} (bfloat16 parts beyond the tie rule do not fail: fuzz_engine.py)")
    elif (out / "fuzz.jsonl").exists():
        lines.append("- fuzz: no summary line (it did not finish); see fuzz.jsonl and fuzz.log")
    if "bench" in result:
        lines += ["", "## Speed, kernels per decode step, memory", "", table(result["bench"])]
    for extra in ("bench_decode.md", "bench_engine.md"):
        if (out / extra).exists():
            lines += ["", f"## {extra[:-3]}", "", (out / extra).read_text()]
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="a random model of SmolLM2's shape, saved with its tokenizer")
    m.add_argument("--shape", type=Path, default=None, help="config and tokenizer files (make gpu-wheels: .gpu/smollm2)")
    m.add_argument("--dest", type=Path, required=True)
    m.add_argument("--layers", type=int, default=0, help="fewer layers than SmolLM2's 30 (the CPU check)")
    b = sub.add_parser("bench", help="batchgen, generate and generate_batch in one process")
    b.add_argument("--model", type=Path, required=True)
    b.add_argument("--device", default="cuda")
    b.add_argument("--dtype", default="bfloat16")
    b.add_argument("--size", choices=list(SIZES), default="full")
    b.add_argument("--systems", default=",".join(SYSTEMS))
    b.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summary", help="OUT/summary.md and OUT/summary.json from what the steps left")
    s.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.command == "model":
        print(json.dumps(build_model(args.shape, args.dest, args.layers or None)))
    elif args.command == "bench":
        if args.device == "cpu":
            import torch

            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
        report = bench(args.model, args.device, args.dtype, args.size, args.out, args.systems.split(","))
        failed = [f"{w}/{s}" for w, r in report["workloads"].items() for s, e in r["systems"].items() if "wall_s" not in e]
        return 1 if failed else 0
    else:
        print((args.out / "summary.md").read_text() if summary(args.out) else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
