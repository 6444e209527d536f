"""The differential fuzz's cases: a tiny random model, a random job set with the engine's edge cases,
and random engine knobs, all drawn from one seed (see tests/engine/fuzz_engine.py, which runs them).

A seed always draws the same case (the draws' order is part of that: change it and every seed
means another case). The jobs mix nested prompt families (A, A+B, A+B+C), prompts equal to
another job's shared prefix, one-token prompts, duplicates, long standalone prompts, n samples
and extra stop token ids.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import torch
import transformers as T

from tests.helpers import tiny_models

EOS = (tiny_models.COMMON["eos_token_id"],)
VOCAB = tiny_models.VOCAB
LLAMA_FAMILY = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config, "mistral": T.MistralConfig}
OTHERS = ("gemma2", "phi3", "gpt2", "gpt_neox", "opt")  # tests/helpers/tiny_models.py's configs
PATHS = ("hf", "load", "load_nodecoder")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelSpec:
    """A tiny model: a Llama-family config drawn key by key, or one of tiny_models' configs with
    its key/value heads redrawn."""

    family: str
    dtype: str  # "float32" or "bfloat16"
    config_kwargs: dict = field(default_factory=dict)  # Llama family only
    kv_heads: int | None = None  # gemma2 and phi3 only

    def config(self) -> T.PretrainedConfig:
        if self.family in LLAMA_FAMILY:
            config = LLAMA_FAMILY[self.family](**self.config_kwargs)
        else:
            config = tiny_models.CONFIGS[self.family]()
            if self.kv_heads:
                config.num_key_value_heads = self.kv_heads
        return config

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def has_layer_types(self) -> bool:
        return "layer_types" in self.config_kwargs


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    max_new: int
    n: int
    stop: tuple[int, ...]  # extra stop token ids, beside EOS


@dataclass(frozen=True)
class Knobs:
    """Engine keyword arguments, and BATCHGEN_NATIVE (`native`)."""

    min_shared_tokens: int
    max_batch_tokens: int
    step_tokens: int
    cascade: bool
    join: bool
    static_decode: bool
    native: bool

    def engine_kwargs(self) -> dict:
        return dict(min_shared_tokens=self.min_shared_tokens, max_batch_tokens=self.max_batch_tokens,
                    step_tokens=self.step_tokens, cascade=self.cascade, join=self.join,
                    static_decode=self.static_decode)


@dataclass(frozen=True)
class Case:
    """One seed's model and jobs, and the knobs each model path runs the engine with:
    'hf' the in-memory transformers model; 'load' `load_model(dir)` (batchgen's own decoder for the
    Llama family); 'load_nodecoder' `load_model` with BATCHGEN_DECODER=0 (transformers' code, packed)."""

    seed: int
    model: ModelSpec
    jobs: tuple[Job, ...]
    runs: tuple[tuple[str, Knobs], ...]

    def build_model(self) -> torch.nn.Module:
        return tiny_models.model_from_config(self.model.config(), self.seed, self.model.torch_dtype)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def draw_model(rng: random.Random) -> ModelSpec:
    family = rng.choice(list(LLAMA_FAMILY) * 3 + list(OTHERS))
    dtype = "bfloat16" if rng.random() < 0.2 else "float32"
    if family not in LLAMA_FAMILY:
        return ModelSpec(family, dtype, kv_heads=rng.choice([1, 2, 4]) if family in ("gemma2", "phi3") else None)
    heads = rng.choice([2, 4, 8])
    kv_heads = rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0])
    kw = dict(**tiny_models.COMMON, hidden_size=64,
              intermediate_size=rng.choice([96, 128]), num_hidden_layers=rng.choice([1, 2, 2, 3]),
              num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=512, tie_word_embeddings=rng.random() < 0.4)
    if family == "qwen3" or rng.random() < 0.5:
        kw["head_dim"] = rng.choice([8, 16, 16, 32, 32, 64])
    if family in ("llama", "qwen3"):
        kw["attention_bias"] = rng.random() < 0.3
    if family == "llama":
        kw["mlp_bias"] = rng.random() < 0.3
    if family == "mistral":
        kw["sliding_window"] = rng.choice([5, 12, 40, None])
        if kw["sliding_window"] is not None:
            kw.setdefault("head_dim", 64 // heads)
            if rng.random() < 0.3:
                kw["layer_types"] = [rng.choice(["sliding_attention", "full_attention"])
                                     for _ in range(kw["num_hidden_layers"])]
    if family in ("qwen2", "qwen3") and rng.random() < 0.3:
        kw.update(use_sliding_window=True, sliding_window=rng.choice([7, 12, 33]),
                  max_window_layers=rng.choice([0, 1]))
    if rng.random() < 0.2:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": rng.choice([1e4, 5e5, 100.0])}
    return ModelSpec(family, dtype, config_kwargs=kw)


def draw_jobs(rng: random.Random, max_jobs: int) -> tuple[Job, ...]:
    prompts: list[list[int]] = []
    for _ in range(rng.randint(1, 3)):  # nested families: A, A+B, A+B+C, A+B+D, maybe A+E
        a = _tokens(rng, rng.choice([1, 2, 3, 5, 8, 15, 30, 60, 120]))
        b = _tokens(rng, rng.choice([1, 2, 4, 10, 40]))
        c = _tokens(rng, rng.choice([1, 3, 20, 90]))
        family = [a, a + b, a + b + c, a + b + _tokens(rng, rng.randint(1, 12))]
        if rng.random() < 0.5:
            family.append(a + _tokens(rng, rng.randint(1, 50)))
        prompts += rng.sample(family, rng.randint(2, len(family)))
    for _ in range(rng.randint(0, 3)):  # one-token prompts, sometimes repeated
        prompts += [[rng.randrange(3, VOCAB)]] * rng.choice([1, 1, 2, 3])
    for _ in range(rng.randint(0, 3)):  # long standalone prompts
        prompts.append(_tokens(rng, rng.randint(1, 300)))
    for _ in range(rng.randint(0, 3)):  # a cut of an existing prompt, or a duplicate
        p = rng.choice(prompts)
        prompts.append(p[: rng.randint(1, len(p))] if rng.random() < 0.6 else list(p))
    rng.shuffle(prompts)
    jobs = []
    for p in prompts[:max_jobs]:
        max_new = rng.choice([1, 1, 2, 3, 5, 8, 13, 20, 40, rng.randint(1, 40)])
        n = rng.choice([1, 1, 1, 2, 3])
        stop = (rng.randrange(3, VOCAB),) if rng.random() < 0.15 else ()
        jobs.append(Job(tuple(p), max_new, n, stop))
    return tuple(jobs)


def draw_knobs(rng: random.Random) -> Knobs:
    return Knobs(min_shared_tokens=rng.choice([1, 1, 2, 4, 8, 32]),
                 max_batch_tokens=rng.choice([20, 40, 64, 100, 250, 1000, 100_000]),
                 step_tokens=rng.choice([8, 16, 33, 128, 2048]),
                 cascade=rng.random() < 0.75, join=rng.random() < 0.8,
                 static_decode=rng.random() < 0.3, native=rng.random() < 0.8)


def case_of_seed(seed: int, dtype: str | None = None) -> Case:
    """The seed's case; `dtype` replaces the drawn dtype (drawn: bfloat16 one time in five)."""
    rng = random.Random(seed)
    model = draw_model(rng)
    jobs = draw_jobs(rng, max_jobs=rng.choice([4, 8, 14, 20]))
    runs = tuple((path, draw_knobs(rng)) for path in PATHS)
    if dtype is not None:
        model = replace(model, dtype=dtype)
    return Case(seed, model, jobs, runs)


def _sliding(spec: ModelSpec) -> bool:
    kw = spec.config_kwargs
    return spec.family == "gemma2" or kw.get("use_sliding_window", False) or (
        spec.family == "mistral" and kw.get("sliding_window") is not None)


def _gqa(spec: ModelSpec) -> bool:
    config = spec.config()
    kv = getattr(config, "num_key_value_heads", None)
    return kv is not None and kv < config.num_attention_heads


def features(case: Case) -> set[str]:
    """What a case exercises, for choosing a covering set of seeds (tests/engine/test_fuzz.py)."""
    out = {f"arch:{case.model.family}"}
    out |= {"sliding window"} if _sliding(case.model) else set()
    out |= {"gqa"} if _gqa(case.model) else set()
    out |= {"layer_types"} if case.model.has_layer_types else set()
    prompts = sorted({j.prompt for j in case.jobs}, key=len)
    if any(j.n > 1 for j in case.jobs):
        out.add("n > 1")
    if any(len(p) == 1 for p in prompts):
        out.add("one-token prompt")
    if len(prompts) < len(case.jobs):
        out.add("duplicate prompt")
    if any(j.stop for j in case.jobs):
        out.add("stop ids")
    longer = {p: [q for q in prompts if len(q) > len(p) and q[: len(p)] == p] for p in prompts}
    if any(longer[p] and any(longer[q] for q in longer[p]) for p in prompts):
        out.add("nested prefixes")  # p < q < r
    if any(len({q[len(p)] for q in longer[p]}) >= 2 for p in prompts):
        out.add("prompt == shared prefix")  # p is exactly where two longer prompts part
    if len(case.jobs) >= 14:
        out.add("14+ jobs")
    if len(prompts[-1]) >= 200:
        out.add("200+ token prompt")
    for path, k in case.runs:
        # batchgen's own decoder runs the 'load' path of the Llama family
        code = "decoder" if path == "load" and case.model.family in LLAMA_FAMILY else "transformers"
        knobs = [f"{name}={'on' if getattr(k, name) else 'off'}"
                 for name in ("cascade", "join", "static_decode", "native")]
        knobs += ["min_shared_tokens=1" if k.min_shared_tokens == 1 else "min_shared_tokens>1",
                  "max_batch_tokens<=64" if k.max_batch_tokens <= 64 else "max_batch_tokens>64",
                  "step_tokens<=16" if k.step_tokens <= 16 else "step_tokens>16"]
        out |= {f"{code}:{knob}" for knob in knobs}
    return out
