"""Differential fuzz: the engine on three model paths, with random knobs, against plain uncached
`generate` one job at a time (tests/helpers/reference.py), sample for sample. Cases are drawn by
tests/engine/fuzz_cases.py; tests/engine/test_fuzz.py runs a fixed set of seeds.

    python -m tests.engine.fuzz_engine --seeds 2000:2100 [--dtype float32|bfloat16|both|drawn] [--threads 1]
                                       [--device cpu|cuda]

runs each seed's case (--dtype: in that dtype, in both, or in the dtype the seed draws, bfloat16
one time in five), prints one JSON line per finding and a summary line, and exits 1 on any float32
token mismatch, exception, missing or extra row, engine error or wrong finish_reason. In bfloat16,
greedy runs may part where the reference's logits are tied at bfloat16 precision (the rule
tests/helpers/reference.py's `bf16_tie` states); parts beyond that rule are reported as
"bf16 beyond tie rule" and do not fail: bfloat16 rounds differently across batch shapes even in
PyTorch's own kernels (the fuzz saw it on the 'hf' path with BATCHGEN_NATIVE=0 too). `--device`
runs the engine, its models and the references there (bench/gpu_check.sh: cuda).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers as T

from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.engine.types import Request, SamplingParams
from batchgen.pipeline.model.decoder import Decoder
from batchgen.pipeline.model.kernels import warm_vector_math
from batchgen.pipeline.model.load import ModelLoadError, load_model
from tests.engine.fuzz_cases import DTYPES, EOS, Case, Job, Knobs, case_of_seed
from tests.helpers.reference import bf16_tie, reference_generate

BF16_BEYOND_TIE = "bf16 beyond tie rule"


@dataclass
class Finding:
    """One sample (or one run, for kind 'exception') that is not as the reference says."""

    seed: int
    dtype: str
    path: str  # 'hf', 'load', 'load_nodecoder', or 'reference'
    kind: str  # tokens, BF16_BEYOND_TIE, missing, extra, error, finish_reason, exception
    job: int | None = None
    sample: int | None = None
    detail: dict = field(default_factory=dict)

    @property
    def fatal(self) -> bool:
        return self.kind != BF16_BEYOND_TIE


@dataclass
class CaseResult:
    seed: int
    dtype: str
    findings: list[Finding]
    model_code: dict[str, str]  # path -> hf-unpacked, decoder, hf-packed or refused
    uncached_reference: bool  # the reference fell back to greedy_without_cache
    seconds: float


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextlib.contextmanager
def _env(**values: str | None):
    """Environment variables set (None: unset) for the block's time."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        _set_env(k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            _set_env(k, v)


@torch.inference_mode()
def greedy_without_cache(model, prompt, max_new: int, eos) -> list[int]:
    """Greedy by a full forward per token, no KV cache: the reference where transformers' cached
    `generate` raises. It does on Mistral models built in memory from a config with `layer_types`
    (sliding and full layers), on prompts longer than the window: a mask of the window's width
    meets the whole cache ("The size of tensor a (283) must match the size of tensor b (5)").
    Slow, but the same greedy tokens by definition."""
    ids, out = list(prompt), []
    device = next(model.parameters()).device
    for _ in range(max_new):
        token = int(model(torch.tensor([ids], device=device)).logits[0, -1].float().argmax())
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out


def references(model, jobs: tuple[Job, ...]) -> tuple[list[list[int]], bool]:
    """Each job's greedy tokens (one per distinct prompt, max_new and stop), and whether any
    needed the uncached fallback."""
    done: dict = {}
    uncached = False
    for j in jobs:
        key = (j.prompt, j.max_new, j.stop)
        if key in done:
            continue
        eos = list(EOS) + list(j.stop)
        try:
            request = Request(0, list(j.prompt), SamplingParams(max_new_tokens=j.max_new))
            done[key] = reference_generate(model, request, eos)
        except RuntimeError:
            done[key] = greedy_without_cache(model, j.prompt, j.max_new, eos)
            uncached = True
    return [done[(j.prompt, j.max_new, j.stop)] for j in jobs], uncached


def run_engine(model, knobs: Knobs, jobs: tuple[Job, ...]) -> dict:
    requests = [Request(i, list(j.prompt), SamplingParams(max_new_tokens=j.max_new, n=j.n, stop_token_ids=j.stop))
                for i, j in enumerate(jobs)]
    with _env(BATCHGEN_NATIVE=None if knobs.native else "0"):
        engine = Engine(model, eos_token_ids=list(EOS), **knobs.engine_kwargs())
        return {(c.key, c.sample_index): c for c in engine.run(requests)}


def compare(case: Case, path: str, ref_model, want_all: list[list[int]], got: dict) -> list[Finding]:
    """Every sample against its job's reference tokens; finish_reason where the tokens agree."""
    dtype, jobs = case.model.dtype, case.jobs

    def finding(kind, job, sample, **detail):
        return Finding(case.seed, dtype, path, kind, job, sample, detail)

    out = []
    expected = {(i, s) for i, j in enumerate(jobs) for s in range(j.n)}
    out += [finding("extra", k[0], k[1]) for k in sorted(set(got) - expected)]
    for i, (j, want) in enumerate(zip(jobs, want_all)):
        for s in range(j.n):
            c = got.get((i, s))
            if c is None:
                out.append(finding("missing", i, s))
            elif c.error:
                out.append(finding("error", i, s, error=str(c.error)))
            elif c.token_ids != want:
                g = c.token_ids
                first = next((k for k, (a, b) in enumerate(zip(g, want)) if a != b), min(len(g), len(want)))
                if dtype == "bfloat16" and bf16_tie(ref_model, list(j.prompt), want, g):
                    continue
                kind = BF16_BEYOND_TIE if dtype == "bfloat16" else "tokens"
                out.append(finding(kind, i, s, first_diff=first, prompt_len=len(j.prompt), want=want, got=g))
            else:
                reason = "stop" if want and want[-1] in set(EOS) | set(j.stop) else "length"
                if c.finish_reason != reason:
                    out.append(finding("finish_reason", i, s, got=c.finish_reason, want=reason))
    return out


def _load(path: str, directory: Path, dtype: str, device: str = "cpu"):
    with _env(BATCHGEN_DECODER="0" if path == "load_nodecoder" else None):
        return load_model(str(directory), device, dtype)[0]


def _reload(directory: Path, dtype: torch.dtype, device: str = "cpu"):
    try:
        model = T.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")
    except ValueError:
        model = T.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager")
    return model.eval().to(device)


@torch.no_grad()
def _perturb(model, scale: float, seed: int):
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))
    return model


def check_case(case: Case, workdir: Path, perturb_reference: float = 0.0, device: str = "cpu") -> CaseResult:
    """Run the case's three model paths on `device`; `perturb_reference` (a noise scale) changes the
    reference models' weights only, to show that the checker fails."""
    start = time.perf_counter()
    directory = workdir / f"model-{case.seed}-{case.model.dtype}"
    try:
        return _check(case, directory, perturb_reference, start, device)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _check(case: Case, directory: Path, perturb_reference: float, start: float, device: str) -> CaseResult:
    model = case.build_model()
    model.save_pretrained(directory)
    model = model.to(device)
    ref_hf = _perturb(model, perturb_reference, case.seed) if perturb_reference else model
    # Mistral with `layer_types`: the model transformers builds in memory is not the one it reads
    # back from the directory (in memory its attention modules have no sliding_window, read back
    # they have the saved config's) and they generate other tokens. The load paths read the
    # directory, so they compare against the model read back, as tests/model/test_decoder_sweep.py
    # does. For the other configs the two are the same model.
    ref_loaded = ref_hf
    if case.model.has_layer_types:
        ref_loaded = _reload(directory, model.dtype, device)
        ref_loaded = _perturb(ref_loaded, perturb_reference, case.seed) if perturb_reference else ref_loaded
    findings, codes, uncached = [], {}, False
    try:
        want_hf, uncached = references(ref_hf, case.jobs)
        want_loaded, u = references(ref_loaded, case.jobs) if ref_loaded is not ref_hf else (want_hf, False)
        uncached |= u
    except Exception:  # noqa: BLE001 - a reference that fails is a finding, not a crash
        tb = traceback.format_exc(limit=-3)
        return CaseResult(case.seed, case.model.dtype, [Finding(case.seed, case.model.dtype, "reference", "exception",
                                                                detail=dict(traceback=tb))], {}, False,
                          time.perf_counter() - start)
    for path, knobs in case.runs:
        try:
            if path == "hf":
                engine_model, ref, want, codes[path] = model, ref_hf, want_hf, "hf-unpacked"
            else:
                try:
                    engine_model = _load(path, directory, case.model.dtype, device)
                except ModelLoadError:
                    codes[path] = "refused"
                    continue
                ref, want = ref_loaded, want_loaded
                codes[path] = "decoder" if isinstance(engine_model, Decoder) else "hf-packed"
            got = run_engine(engine_model, knobs, case.jobs)
            findings += compare(case, path, ref, want, got)
        except Exception:  # noqa: BLE001 - the engine raising is a finding
            findings.append(Finding(case.seed, case.model.dtype, path, "exception",
                                    detail=dict(knobs=asdict(knobs), traceback=traceback.format_exc(limit=-6))))
    return CaseResult(case.seed, case.model.dtype, findings, codes, uncached, time.perf_counter() - start)


def _seeds(text: str) -> range:
    first, _, end = text.partition(":")
    return range(int(first), int(end) if end else int(first) + 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.engine.fuzz_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=_seeds, default=_seeds("0:100"), help="START:END (END excluded) or one seed")
    ap.add_argument("--dtype", choices=[*DTYPES, "both", "drawn"], default="float32",
                    help="every case in this dtype, each in both, or the seed's own draw (bfloat16 1 in 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (set OMP_NUM_THREADS too)")
    ap.add_argument("--device", default="cpu", help="where the engine, its models and the references run")
    ap.add_argument("--max-seconds", type=float, default=0, help="start no seed after this long (0: no limit); "
                    "the summary names the seeds that ran")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    T.utils.logging.disable_progress_bar()
    warm_vector_math()  # as tests/conftest.py: the references' rotary tables need an accurate first cos
    dtypes = {"both": DTYPES, "drawn": (None,)}.get(args.dtype, (args.dtype,))
    counts: Counter = Counter()
    codes: Counter = Counter()
    fatal = 0
    ran = None  # the last seed started
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="batchgen-fuzz-") as tmp:
        for seed in args.seeds:
            if args.max_seconds and time.perf_counter() - start > args.max_seconds:
                break
            ran = seed
            for dtype in dtypes:
                result = check_case(case_of_seed(seed, dtype), Path(tmp), device=args.device)
                counts[f"cases {result.dtype}"] += 1
                counts["uncached references"] += result.uncached_reference
                codes.update(f"{path}:{code}" for path, code in result.model_code.items())
                for f in result.findings:
                    counts[f.kind] += 1
                    fatal += f.fatal
                    print(json.dumps(asdict(f)), flush=True)
    summary = dict(summary=True, seeds=f"{args.seeds.start}:{ran + 1 if ran is not None else args.seeds.start}", dtype=args.dtype, device=args.device,
                   fatal=fatal,
                   counts=dict(sorted(counts.items())), model_codes=dict(sorted(codes.items())),
                   seconds=round(time.perf_counter() - start, 1))
    print(json.dumps(summary), flush=True)
    return 1 if fatal else 0


if __name__ == "__main__":
    raise SystemExit(main())
