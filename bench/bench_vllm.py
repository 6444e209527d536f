"""batchgen with `--engine vllm` against vLLM's own offline paths, whole process against whole process.

Systems, each its own process, in alternating turns (A B C, B C A, ...: this machine's speed drifts):
  batchgen-vllm   `batchgen process --engine vllm --vllm bench/vllm_cpu_serve.sh`: batchgen reads, tokenizes,
                  sorts by prefix, starts `vllm serve` and sends token ids in prefix order
  vllm-generate   vLLM's own `LLM.generate` over all prompts in one call (bench/peers/vllm_run.py)
  vllm-run-batch  `vllm run-batch` on an OpenAI batch file of the same jobs in input order. 0.32's run-batch takes
                  chat requests only: a plain prompt goes as one user message under an identity chat template
                  (`--chat-template`: the message's text, nothing around it), so it computes the same prompt
                  tokens as the others (the table shows the counts; they must agree)

Workloads (bench/corpus.py, the default model SmolLM2-135M, float32, greedy, 16 new tokens):
  fewshot       64 five-shot jobs in 4 subjects
  fewshot_1k    1,024 five-shot jobs in 16 subjects
  shuffled_1k   fewshot_1k as chat jobs, shuffled as real files come (subjects interleaved), with every server's KV cache
                limited to about 4 subjects' headers (`--kv-subjects`): a server keeps a prefix only
                while it fits, so the order requests arrive in decides how much it recomputes

Reported per system: wall seconds (exec to exit; medians over turns), and computed prompt tokens: the
prompt tokens less the cached ones the server reports (batchgen's summary; run-batch's usage;
LLM.generate's num_cached_tokens). The overhead ratio is batchgen-vllm's wall over vllm-generate's,
taken turn by turn. vLLM runs once untimed first: its first start compiles the model.

    python -m bench.bench_vllm --workloads fewshot,shuffled_1k --turns 2
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import corpus
from bench.bench_engine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
WRAPPER = ROOT / "bench" / "vllm_cpu_serve.sh"
MAX_NUM_SEQS = 64  # vllm_run.py's
KV_BYTES = 2 << 30  # vllm_run.py's


def model_dir() -> str:
    """The default model as vLLM loads it (the twin without the GGUF quantization_config)."""
    from batchgen.pipeline.model.load import model_source
    from batchgen.pipeline.run.served import _vllm_model_dir

    return _vllm_model_dir(model_source(None)[1])


def workload(name: str, limit: int | None, questions: int = 64) -> list[dict]:
    if name == "fewshot":
        rows = corpus.fewshot(subjects=4, questions=16, max_new_tokens=16)
    else:
        rows = corpus.fewshot(subjects=16, questions=questions, max_new_tokens=16)
        if name == "shuffled_1k":
            random.Random(0).shuffle(rows)
    return rows[:limit] if limit else rows


def kv_bytes_for(rows: list[dict], model: str, subjects: int) -> int:
    """About `subjects` subjects' headers of KV (float32), at least one longest request's."""
    from tokenizers import Tokenizer

    config = json.load(open(os.path.join(model, "config.json")))
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    per_token = config["num_hidden_layers"] * heads * (config["hidden_size"] // config["num_attention_heads"]) * 2 * 4
    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    by_group: dict[str, list[str]] = {}
    for r in rows:
        by_group.setdefault(r["group"], []).append(r["prompt"])
    headers = {g: os.path.commonprefix(prompts) for g, prompts in by_group.items()}
    header = statistics.mean(len(tok.encode(h).ids) for h in headers.values())
    longest = max(len(tok.encode(r["prompt"]).ids) for r in rows) + 16
    return int(max(subjects * header, 2 * longest) * per_token), -(-longest // 128) * 128


def run_system(system: str, jobs: Path, rows: list[dict], work: Path, model: str, threads: int,
               kv: int, seqs: int = MAX_NUM_SEQS, max_len: int | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_THREADS": str(threads)}
    if kv % (1 << 30) == 0:  # the same KV everywhere: vllm_run.py's LLM() takes VLLM_CPU_KVCACHE_SPACE's over its own
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv >> 30)
    out = work / f"{system}.out"
    server_args = f"--max-num-seqs {seqs} --kv-cache-memory-bytes {kv}"
    if max_len:
        server_args += f" --max-model-len {max_len}"
    if system == "batchgen-vllm":
        cmd = [sys.executable, "-m", "batchgen", "process", str(jobs), "-o", str(out) + ".parquet", "--overwrite",
               "--engine", "vllm", "--vllm", str(WRAPPER), "--dtype", "float32", f"--vllm-arg={server_args}",
               "--threads", str(threads)]
    elif system == "vllm-generate":
        cmd = [str(WRAPPER), "python", str(ROOT / "bench" / "peers" / "vllm_run.py"), model, str(jobs), str(out),
               "1", "0", str(threads), "all"]
    else:  # vllm-run-batch: the same jobs as an OpenAI batch file, in the file's order (0.32's run-batch takes
        # /v1/chat/completions only: chat jobs render the model's own chat template, as batchgen does; a plain
        # prompt is one user message under a template that is its text alone)
        batch = work / "batch.jsonl"
        plain = "messages" not in rows[0]
        if not batch.exists():
            batch.write_text("".join(json.dumps({
                "custom_id": r["id"], "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "max_tokens": r["max_new_tokens"], "temperature": 0.0,
                         "messages": [{"role": "user", "content": r["prompt"]}] if plain else r["messages"]}})
                + "\n" for r in rows))
        cmd = [str(WRAPPER), "run-batch", "-i", str(batch), "-o", str(out), "--model", model,
               "--served-model-name", "m", "--dtype", "float32", "--enable-prefix-caching",
               "--enable-prompt-tokens-details", *server_args.split()]
        if plain:
            template = work / "identity.jinja"
            template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
            cmd += ["--chat-template", str(template), "--chat-template-content-format", "string"]
    began = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - began
    if p.returncode != 0:
        raise RuntimeError(f"{system} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    if system == "batchgen-vllm":
        s = json.loads(Path(str(out) + ".parquet.summary.json").read_text())
        return {"wall": wall, "prompt": s["prompt_tokens"], "cached": s["cached_tokens"],
                "start": s.get("vllm_start_seconds")}
    if system == "vllm-generate":
        line = next(json.loads(t) for t in reversed(p.stdout.splitlines()) if t.startswith("{"))
        return {"wall": wall, "cached": line["cached_tokens"], "prompt": None, "start": line["import_s"]}
    prompt = cached = 0
    for text in out.read_text().splitlines():
        usage = json.loads(text)["response"]["body"]["usage"]
        prompt += usage["prompt_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"wall": wall, "prompt": prompt, "cached": cached, "start": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="fewshot")
    ap.add_argument("--systems", default="batchgen-vllm,vllm-generate,vllm-run-batch")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-subjects", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--no-warm-up", action="store_true", help="vLLM's compile cache is warm already")
    ap.add_argument("--questions", type=int, default=64, help="questions per subject of the 1k shapes")
    ap.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="the servers' (vllm_run.py: 64)")
    args = ap.parse_args()
    model = model_dir()
    print(f"# {cpu_model()}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {args.threads} threads", flush=True)
    for name in args.workloads.split(","):
        rows = workload(name, args.limit, args.questions)
        kv, max_len = kv_bytes_for(rows, model, args.kv_subjects) if name == "shuffled_1k" else (KV_BYTES, None)
        if name == "shuffled_1k":  # chat jobs, as run-batch takes them (max-model-len: room for the template)
            rows = [{"id": r["id"], "group": r["group"], "max_new_tokens": r["max_new_tokens"],
                     "messages": [{"role": "user", "content": r["prompt"]}]} for r in rows]
            max_len += 128
        systems = args.systems.split(",")
        if name == "shuffled_1k":  # vllm_run.py takes plain prompts
            systems = [s for s in systems if s != "vllm-generate"]
        with tempfile.TemporaryDirectory(prefix=f"bench-vllm-{name}-") as d:
            work = Path(d)
            jobs = work / "jobs.jsonl"
            jobs.write_text("".join(json.dumps(r) + "\n" for r in rows))
            seqs = args.max_num_seqs
            if not args.no_warm_up:
                run_system(systems[0], jobs, rows, work, model, args.threads, kv, seqs, max_len)  # untimed: compiles on a cold cache
            results: dict[str, list[dict]] = {s: [] for s in systems}
            for turn in range(args.turns):
                for s in systems[turn % len(systems):] + systems[: turn % len(systems)]:
                    r = run_system(s, jobs, rows, work, model, args.threads, kv, seqs, max_len)
                    results[s].append(r)
                    print(json.dumps({"workload": name, "turn": turn, "system": s, **r}), flush=True)
            print(f"\n{name}: {len(rows)} jobs, KV {kv / 2**20:.0f} MiB, max-num-seqs {seqs}, medians of "
                  f"{args.turns} turns")
            print("| system | wall s | vLLM start s | prompt tokens | cached | computed |")
            print("|---|---:|---:|---:|---:|---:|")
            for s, rs in results.items():
                prompt = rs[-1]["prompt"] or results.get("batchgen-vllm", rs)[-1]["prompt"]
                cached = statistics.median(r["cached"] for r in rs)
                start = [r["start"] for r in rs if r["start"] is not None]
                print(f"| {s} | {statistics.median(r['wall'] for r in rs):.1f} | "
                      f"{statistics.median(start) if start else float('nan'):.1f} | {prompt} | {cached:.0f} | "
                      f"{prompt - cached:.0f} |")
            for peer in ("vllm-generate", "vllm-run-batch"):
                if "batchgen-vllm" in results and peer in results:
                    ratios = [a["wall"] / b["wall"] for a, b in zip(results["batchgen-vllm"], results[peer])]
                    print(f"wall batchgen-vllm / {peer}, per turn: {[round(x, 3) for x in ratios]}, "
                          f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
