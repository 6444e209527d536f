"""Host synchronisations per decode step, counted on the CPU (bench/host_syncs.py): on a GPU each
`.item()`, `.tolist()` or `.cpu()` waits for the device, so the decode loop's count is held here as an
upper bound that a regression fails. Measured (tiny Llama, 6 rows decoding 24 tokens each): 2 per
decode step on every path, the `.tolist()` of the rows' finite flags and of the chosen tokens, which
the loop needs on the host to finish rows; none in the model's forward. Uploads (host-to-device
copies, which on a GPU wait as well) per decode step: 1 on static decode steps, the path a GPU takes
(the step's ids, positions and write indices in one copy; group members and the rows whose logits
are kept are reused while they do not change); before that change 4.8."""
from __future__ import annotations

import random

import pytest
import torch

from bench.host_syncs import counting
from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.engine.types import Request, SamplingParams
from tests.helpers.tiny_models import make_decoder, make_model

NEW = 24
MOST_PER_DECODE_STEP = 2  # the measured count: lower it when a change removes one
MOST_UPLOADS_STATIC = 1


def requests() -> list[Request]:
    rng = random.Random(0)
    head = [rng.randrange(10, 250) for _ in range(40)]
    return [Request(i, head + [rng.randrange(10, 250) for _ in range(5 + i)], SamplingParams(max_new_tokens=NEW))
            for i in range(6)]


def counted(engine: Engine):
    with counting(engine) as split:
        out = engine.generate(requests())
    assert all(len(c.token_ids) == NEW for c in out)
    assert split.steps["decode"] == NEW - 1  # one prefill step gives every row its first token
    return split


@pytest.mark.parametrize("native", ["0", None])
@pytest.mark.parametrize("static", [True, False])
def test_host_syncs_per_decode_step_on_transformers_model_code(static, native, monkeypatch):
    """The path a GPU takes (transformers' model code, PyTorch's attention, static decode steps), and
    its CPU neighbours."""
    if native is not None:
        monkeypatch.setenv("BATCHGEN_NATIVE", native)
    split = counted(Engine(make_model("llama"), eos_token_ids=[], min_shared_tokens=4, static_decode=static))
    per = split.per_step()
    print(f"static={static} native={native}: {per}")
    assert per["item"] == per["cpu"] == per["numpy"] == 0
    assert per["all"] <= MOST_PER_DECODE_STEP
    if static:
        assert per["upload"] <= MOST_UPLOADS_STATIC


def test_host_syncs_per_decode_step_on_batchgen_s_decoder(tmp_path):
    _, decoder = make_decoder("llama", tmp_path)
    per = counted(Engine(decoder, eos_token_ids=[], min_shared_tokens=4)).per_step()
    print(f"decoder: {per}")
    assert per["all"] <= MOST_PER_DECODE_STEP + 1  # its forward reads one scalar on the host (a CPU-only path)


def test_the_counter_sees_a_sync_added_to_the_step(monkeypatch):
    """One `.item()` more in every forward shows as one more per decode step: the bound above can fail."""
    engine = Engine(make_model("llama"), eos_token_ids=[], min_shared_tokens=4, static_decode=True)
    before = counted(engine).per_step()
    real = engine.forward

    def forward(step, keep):
        logits = real(step, keep)
        torch.zeros(1).item()
        return logits

    monkeypatch.setattr(engine, "forward", forward)
    after = counted(engine).per_step()
    assert after["item"] == before["item"] + 1 and after["all"] == before["all"] + 1
    assert torch.Tensor.item is not None and "item" not in vars(torch.Tensor)  # the methods are back as they were
