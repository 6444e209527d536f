"""Plain data the engine passes around: requests in, completions and counters out.

The engine sees token ids only; text lives in the tokenize module and jobs/.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable

if TYPE_CHECKING:
    from pipeline.grammar import Matcher

# Called with a row's generated ids; returns True when a stop string has appeared.
StopCheck = Callable[[list[int]], bool]
# Makes a fresh grammar matcher for one sample of a constrained request (each sample has its own).
MatcherFactory = Callable[[], "Matcher"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    n: int = 1
    # logits processors, in the order transformers' generate applies them (see pipeline/logits.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    repetition_penalty: float = 1.0  # transformers' (prompt and generated tokens), 1 is off
    presence_penalty: float = 0.0  # OpenAI's (generated tokens only), 0 is off
    frequency_penalty: float = 0.0  # OpenAI's (generated tokens only), 0 is off
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many new tokens
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end a sample, like EOS

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class Request:
    """One tokenized job: everything the engine needs, nothing it must not see."""

    key: Hashable  # the caller's handle for the job (index into its job list)
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: StopCheck | None = None
    grammar: MatcherFactory | None = None  # a constrained request: its samples' tokens follow a grammar


@dataclass
class Completion:
    """One sample of one request."""

    key: Hashable
    sample_index: int
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or string, grammar complete), "length" or "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens reused from a shared prefix, not computed for this job
    error: str | None = None  # set when the job failed alone during generation


@dataclass
class RunStats:
    """Counters for one run; prefill_tokens counts tokens actually run through the model."""

    jobs: int = 0
    rows: int = 0  # jobs x samples
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    decode_steps: int = 0
    batches: int = 0
    prefix_nodes: int = 0  # shared prefixes prefilled once
    cascade_batches: int = 0  # batches whose shared prefix was read once (cascade attention)
    admitted_rows: int = 0  # rows that took slots finished rows freed in a batch in flight
    oom_splits: int = 0  # batches split (or prefill chunks halved) after running out of memory

    def add(self, other: "RunStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
