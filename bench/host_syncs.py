"""Host synchronisations per engine step, counted on any device (a CPU included).

On a GPU, `.item()`, `.tolist()` and `.cpu()` of a device tensor each wait for every kernel queued
before them: a decode loop that makes them every step cannot run ahead of the device, and a CUDA
graph cannot hold them. Those calls go through `torch.Tensor`'s Python methods, so counting them
needs no GPU: `counting()` wraps the methods with counters while an engine runs (the implicit
conversions `int()`, `float()` and `bool()` of a tensor are counted as `scalar`), and `StepSplit`
attributes each call to the engine step it falls in (a step runs from one `Engine.forward` to the
next: the forward, then sampling its logits), so decode steps are told from prefill steps.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import torch

METHODS = {"item": "item", "tolist": "tolist", "cpu": "cpu", "__int__": "scalar", "__float__": "scalar",
           "__bool__": "scalar", "numpy": "numpy"}


@dataclass
class StepSplit:
    """Counts per step kind: calls made since the last forward began are the last step's."""

    counts: Counter = field(default_factory=Counter)
    current: str | None = None  # the kind of the step running: "decode" or "prefill"
    steps: Counter = field(default_factory=Counter)
    before: Counter = field(default_factory=Counter)  # calls before the first forward (planning)

    def hit(self, kind: str) -> None:
        if self.current is None:
            self.before[kind] += 1
        else:
            self.counts[(self.current, kind)] += 1

    def begin(self, decode: bool) -> None:
        self.current = "decode" if decode else "prefill"
        self.steps[self.current] += 1

    def per_step(self, step_kind: str = "decode") -> dict[str, float]:
        """Calls of each kind per step of `step_kind`, and their total as `all`."""
        n = self.steps[step_kind]
        out = {kind: self.counts[(step_kind, kind)] / n if n else 0.0 for kind in sorted(set(METHODS.values()))}
        out["all"] = sum(out.values())
        return out


@contextlib.contextmanager
def counting(engine) -> Iterator[StepSplit]:
    """Count host synchronisations of `engine`'s runs inside the block, step by step. The engine's
    `forward` is wrapped on the instance; torch.Tensor's methods on the class (every tensor)."""
    split = StepSplit()
    saved = {name: getattr(torch.Tensor, name) for name in METHODS}
    own = {name for name in METHODS if name in vars(torch.Tensor)}  # else inherited from the C base
    had_forward = "forward" in vars(engine)

    def counted(name: str, kind: str):
        real = saved[name]

        def method(self, *args, **kwargs):
            split.hit(kind)
            return real(self, *args, **kwargs)

        return method

    real_forward = engine.forward

    def forward(step, keep):
        split.begin(step.n_dec == step.tokens and step.n_dec > 0)  # one token per decoding row, nothing else
        return real_forward(step, keep)

    engine.forward = forward
    for name, kind in METHODS.items():
        setattr(torch.Tensor, name, counted(name, kind))
    try:
        yield split
    finally:
        for name, real in saved.items():
            if name in own:
                setattr(torch.Tensor, name, real)
            else:
                delattr(torch.Tensor, name)
        if had_forward:
            engine.forward = real_forward
        else:
            del engine.forward  # the class's method again
