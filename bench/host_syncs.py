"""Host synchronisations per engine step, counted on any device (a CPU included).

On a GPU, `.item()`, `.tolist()` and `.cpu()` of a device tensor each wait for every kernel queued
before them: a decode loop that makes them every step cannot run ahead of the device, and a CUDA
graph cannot hold them. Those calls go through `torch.Tensor`'s Python methods, so counting them
needs no GPU: `counting()` wraps the methods with counters while an engine runs (the implicit
conversions `int()`, `float()` and `bool()` of a tensor are counted as `scalar`), and `StepSplit`
attributes each call to the engine step it falls in (a step runs from one `Engine.forward` to the
next: the forward, then sampling its logits), so decode steps are told from prefill steps.

Uploads are counted beside them (`upload`, not in `all`): `torch.tensor(..., device=...)`,
`torch.as_tensor(..., device=...)` and `copy_` from a host tensor. On a GPU each copies host memory
to the device and, from pageable memory, waits for the copy; on a CPU they are the same calls.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import torch

METHODS = {"item": "item", "tolist": "tolist", "cpu": "cpu", "__int__": "scalar", "__float__": "scalar",
           "__bool__": "scalar", "numpy": "numpy"}
SYNCS = sorted(set(METHODS.values()))


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
        out = {kind: self.counts[(step_kind, kind)] / n if n else 0.0 for kind in SYNCS}
        out["all"] = sum(out.values())
        out["upload"] = self.counts[(step_kind, "upload")] / n if n else 0.0
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
    real_tensor, real_as_tensor, real_copy = torch.tensor, torch.as_tensor, torch.Tensor.copy_

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            split.hit("upload")
        return real_tensor(*args, **kwargs)

    def as_tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            split.hit("upload")
        return real_as_tensor(*args, **kwargs)

    def copy_(self, src, *args, **kwargs):
        if isinstance(src, torch.Tensor) and src.device.type == "cpu":
            split.hit("upload")
        return real_copy(self, src, *args, **kwargs)

    def forward(step, keep):
        split.begin(step.n_dec == step.tokens and step.n_dec > 0)  # one token per decoding row, nothing else
        return real_forward(step, keep)

    engine.forward = forward
    torch.tensor, torch.as_tensor = tensor, as_tensor
    own_copy = "copy_" in vars(torch.Tensor)
    torch.Tensor.copy_ = copy_
    for name, kind in METHODS.items():
        setattr(torch.Tensor, name, counted(name, kind))
    try:
        yield split
    finally:
        torch.tensor, torch.as_tensor = real_tensor, real_as_tensor
        if own_copy:
            torch.Tensor.copy_ = real_copy
        else:
            del torch.Tensor.copy_
        for name, real in saved.items():
            if name in own:
                setattr(torch.Tensor, name, real)
            else:
                delattr(torch.Tensor, name)
        if had_forward:
            engine.forward = real_forward
        else:
            del engine.forward  # the class's method again
