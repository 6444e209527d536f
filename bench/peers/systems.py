"""The systems `bench_engine` runs: what each one is, what it needs set up, and its command line.

Every system is its own process, run the way a user runs it. The peers run from the venvs and
converted models that `bench/peers/setup.sh` builds under one directory (`--peers`, or
`BATCHGEN_PEERS`); a peer whose files are not there is skipped, saying which file is missing.
Every system is float32 unless its name says bf16; those are the like-with-like bfloat16 peers:
`batchgen --dtype bfloat16`, OpenVINO's own CPU default (bf16 compute and u8 KV on a CPU with
AVX-512 BF16), vLLM's `dtype=bfloat16`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class System:
    name: str
    about: str
    needs: tuple[str, ...] = ()  # paths under the peers directory
    warm_up: bool = False  # run once, untimed, before the turns (vLLM compiles its model on a cold cache)


SYSTEMS = {s.name: s for s in (
    System("batchgen", "`batchgen process`, float32, batchgen's own decoder"),
    System("batchgen-bf16", "`batchgen process --dtype bfloat16`"),
    System("batchgen-transformers", "`batchgen process`, float32, on transformers' model code (BATCHGEN_DECODER=0)"),
    System("batchgen-pytorch-attention", "`batchgen process`, float32, attention on PyTorch's kernels, not batchgen's "
           "compiled ones (BATCHGEN_NATIVE=0)"),
    System("batchgen-onednn", "`batchgen process`, float32, linear layers on oneDNN's GEMM, not batchgen's (BATCHGEN_GEMM=0)"),
    System("openvino", "OpenVINO GenAI, continuous batching, prefix caching off, f32 compute and KV",
           ("ov/bin/python", "ov_model")),
    System("openvino-prefix-warm", "OpenVINO, prefix caching on, one request per group first, then the rest; f32",
           ("ov/bin/python", "ov_model")),
    System("openvino-bf16-prefix-warm", "as openvino-prefix-warm, at OpenVINO's CPU default precision (bf16, u8 KV)",
           ("ov/bin/python", "ov_model")),
    System("ctranslate2-static", "CTranslate2, one generate_batch per group, its common prefix as static_prompt",
           ("ct2/bin/python", "ct2_model", "src/tokenizer.json")),
    System("vllm-prefix", "vLLM's CPU build, automatic prefix caching, one generate over all jobs; float32",
           ("vllm/bin/python", "src"), warm_up=True),
    System("vllm-bf16-prefix", "as vllm-prefix, dtype=bfloat16", ("vllm/bin/python", "src"), warm_up=True),
    System("llamacpp-shared", "llama.cpp, f32 GGUF and KV, each group's common prefix decoded once for all its jobs",
           ("llamacpp/bin/python", "model-f32.gguf")),
    System("hf-batched", "batched `model.generate`, left padding, 16 rows a call"),
    System("hf-batched-bf16", "as hf-batched, in bfloat16"),
)}


def is_batchgen(name: str) -> bool:
    return name.startswith("batchgen")


def missing(name: str, peers: Path) -> str | None:
    """The first file the system needs that is not under `peers`, or None when it is set up."""
    for need in SYSTEMS[name].needs:
        if not (peers / need).exists():
            return str(peers / need)
    return None


def command(name: str, jobs: Path, out: Path, times: Path, threads: int, peers: Path, device: str = "cpu",
            model: str | None = None) -> tuple[list[str], dict]:
    """The command line of one run and the environment it adds. A batchgen run writes its forwards'
    times to `times` (`bench.timed_batchgen`); a runner prints its own on its last line. `device` and
    `model` (a directory; None: the default model) reach batchgen and hf-batched only."""
    t = str(threads)
    if is_batchgen(name):
        cmd = [sys.executable, "-m", "bench.timed_batchgen", str(times), "process", str(jobs), "-o", str(out),
               "--overwrite", "--device", device, "--threads", t,
               "--dtype", "bfloat16" if name == "batchgen-bf16" else "float32", *(["--model", model] if model else [])]
        env = {"batchgen-transformers": {"BATCHGEN_DECODER": "0"}, "batchgen-pytorch-attention": {"BATCHGEN_NATIVE": "0"},
               "batchgen-onednn": {"BATCHGEN_GEMM": "0"}}
        return cmd, env.get(name, {})
    if name.startswith("hf-batched"):
        dtype = "bfloat16" if name.endswith("bf16") else "float32"
        return [sys.executable, "-m", "bench.hf_run", str(jobs), str(out), t, "16", dtype, device, model or ""], {}
    python = str(peers / SYSTEMS[name].needs[0])
    model = str(peers / SYSTEMS[name].needs[1])
    if name.startswith("openvino"):
        prefix, calls = ("0", "all") if name == "openvino" else ("1", "warm")
        precision = "default" if "bf16" in name else "f32"
        return [python, str(HERE / "ov_run.py"), model, str(jobs), str(out), prefix, "0", t, calls, precision], {}
    if name == "ctranslate2-static":
        tokenizer = str(peers / SYSTEMS[name].needs[2])
        return [python, str(HERE / "ct2_run.py"), model, tokenizer, str(jobs), str(out), "static", "0", t], {}
    if name.startswith("vllm"):
        dtype = "bfloat16" if "bf16" in name else "float32"
        return [python, str(HERE / "vllm_run.py"), model, str(jobs), str(out), "1", "0", t, "all", dtype], {}
    if name == "llamacpp-shared":
        return [python, str(HERE / "llamacpp_run.py"), model, str(jobs), str(out), "shared", "0", t, "f32"], {}
    raise ValueError(name)
