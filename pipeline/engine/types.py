"""Plain data the engine passes around: requests in, completions and counters out.

The engine sees token ids only; text lives in the tokenize module and jobs/.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable, NamedTuple

from batchgen.pipeline.errors import BatchgenError

if TYPE_CHECKING:
    from batchgen.pipeline.engine.constrain import Matcher

# Called with a row's generated ids; returns True when a stop string has appeared.
StopCheck = Callable[[list[int]], bool]
# Makes a fresh grammar matcher for one sample of a constrained request (each sample has its own).
MatcherFactory = Callable[[], "Matcher"]
# A conversation's next turn, called as a sample's turn ends with (its sample index, the turn's
# generated ids, its finish reason "stop" or "length"): the next turn's request, whose prompt is
# the whole conversation so far as the caller renders it (the engine cuts the row's keys and
# values at their longest common prefix with it and prefills only the rest), or None when the
# conversation is over. It raises `TurnError` when no next turn can be made (the sample fails).
NextTurn = Callable[[int, list[int], str], "Request | None"]


class TurnError(BatchgenError):
    """A conversation's next turn cannot be made (its prompt outgrows the context window, say):
    that sample fails alone, with this message."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    n: int = 1
    # logits processors, in the order transformers' generate applies them (see pipeline/engine/sampling.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    repetition_penalty: float = 1.0  # transformers' (prompt and generated tokens), 1 is off
    presence_penalty: float = 0.0  # OpenAI's (generated tokens only), 0 is off
    frequency_penalty: float = 0.0  # OpenAI's (generated tokens only), 0 is off
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many new tokens
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end a sample, like EOS
    logprobs: int | None = None  # report each new token's logprob and this many alternatives; None: off

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
    # score the prompt's tokens from this index on: the logprob of each given all before it
    # (scoring jobs: the continuations; echo: from 1); with max_new_tokens 0 nothing is generated
    score_from: int | None = None
    # at most this many prompt tokens in a shared prefix (None: as many as `shared_length` allows):
    # a job's requests (its continuations, its rolling windows) all stop at one node of the tree
    shareable: int | None = None
    # the LoRA adapter it runs with: an index into the forward's adapters (`Forward.set_adapters`),
    # 0 the base model. A prefix's keys and values depend on it: requests share prefixes only
    # with requests of the same adapter
    adapter: int = 0
    # a conversation: its next turn, made when a sample's turn ends (`NextTurn`); None: one turn
    next_turn: NextTurn | None = None
    # own tokens a row may need beyond its prompt and max_new_tokens: a conversation's later turns,
    # which continue in its slot (a turn that outgrows it reruns its prompt in a later pass)
    reserve: int = 0

    @property
    def fed_len(self) -> int:
        return fed_length(len(self.prompt_ids), self.params.max_new_tokens, self.score_from)

    @property
    def shared_len(self) -> int:
        return shared_length(len(self.prompt_ids), self.params.max_new_tokens, self.score_from, self.shareable)

    @property
    def shape(self) -> "RequestShape":
        return RequestShape(len(self.prompt_ids), self.fed_len, self.params.max_new_tokens, self.params.n)


def fed_length(prompt_len: int, max_new_tokens: int, score_from: int | None) -> int:
    """Prompt tokens a request runs through the model: all, or all but the last when nothing is
    generated (a scored token's logprob comes from the logits before it)."""
    return prompt_len - (max_new_tokens == 0 and score_from is not None)


def shared_length(prompt_len: int, max_new_tokens: int, score_from: int | None, shareable: int | None = None) -> int:
    """Prompt tokens a shared prefix may hold for a request: all it runs but the last, whose logits
    start generation or score the last prompt token (so every row runs a token of its own), at
    most `shareable`. Scored tokens may lie in a shared prefix: their logprobs are computed once
    there, when it is prefilled, for every row below it. The engine's tree holds this much of each
    request (`Request.shared_len`), and `batchgen plan`'s index of each job (`expand.index_entry`)."""
    n = max(0, fed_length(prompt_len, max_new_tokens, score_from) - 1)
    return n if shareable is None else min(n, shareable)


class RequestShape(NamedTuple):
    """What `batchgen plan` needs of a request: its prompt tokens, the ones it runs, its budget of
    new tokens and its samples."""

    prompt_tokens: int
    fed: int
    max_new_tokens: int
    n: int


@dataclass
class TokenLogprob:
    """A generated token's logprob under the model's unprocessed distribution (before temperature,
    top-k/p or penalties), and the most likely alternatives there, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


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
    logprobs: list[TokenLogprob] | None = None  # per generated token, when the request asked
    prompt_logprobs: list[float] | None = None  # per scored prompt token (score_from on)
    prompt_greedy: list[bool] | None = None  # whether each scored prompt token was the argmax there
    # a conversation's sample: each of its turns' completions, in order, this one (its last) included
    turns: list["Completion"] | None = None


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
    compiled_attention_layers: int = 0  # layer calls through batchgen's compiled CPU kernels ...
    pytorch_attention_layers: int = 0  # ... and through PyTorch's
    own_decoder_forwards: int = 0  # forwards through batchgen's own decoder (pipeline/model/decoder.py) ...
    transformers_forwards: int = 0  # ... and through transformers' model code
    turns: int = 0  # conversations' turns after their first, each from the conversation so far
    carried_tokens: int = 0  # of their prompts, tokens whose keys and values the row kept from its last turn
    turn_reruns: int = 0  # turns that did not fit their row's slot: prefilled again in a later pass

    def add(self, other: "RunStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
