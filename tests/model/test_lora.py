"""LoRA adapters in a forward (pipeline/model/lora.py) on both model codes, batchgen's decoder and
transformers' model code: steps that mix the base model's tokens and several adapters' (decode
tokens, fresh suffixes, a continued chunk, a prefix and a row anchored on it) give, per row, the
logits of peft's merged model (`merge_and_unload`) for that row's adapter, over its whole sequence,
uncached, in float32."""
import pytest
import torch

from batchgen.pipeline.model.adapter_files import AdapterError, inspect_adapter
from batchgen.pipeline.model.hf import HFModel
from batchgen.pipeline.model.kv import PrefixKV, RowKV
from batchgen.pipeline.model.step import Decode, Segment, StaticDecode, build
from tests.helpers.tiny_adapters import make_adapter, merged
from tests.helpers.tiny_models import make_decoder

CPU = torch.device("cpu")
ARCHS = ["llama", "qwen2", "mistral"]  # mistral: a sliding window of 12, which the sequences cross
# (rank, targets, alpha, rslora, more LoraConfig): every projection in some adapter, ranks 1, 8, 64
ADAPTERS = [
    (1, ("q_proj", "v_proj"), 4, False, {}),
    (8, ("k_proj", "o_proj", "gate_proj", "down_proj"), 8, True, {}),
    (64, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 32, False, {}),
    (8, ("v_proj", "up_proj"), 16, False, {"layers_to_transform": [1]}),  # one layer of two
]


class Setup:
    def __init__(self, arch, directory):
        self.model, self.decoder = make_decoder(arch, directory / "base")
        self.hf = HFModel(make_decoder(arch, directory / "base2")[0])  # the same weights (seed 0), its own copy
        self.paths = [make_adapter(self.model, directory / f"a{i}", rank=r, targets=t, alpha=alpha, rslora=rs,
                                   seed=i + 1, **more) for i, (r, t, alpha, rs, more) in enumerate(ADAPTERS)]
        self.infos = [inspect_adapter(p, self.model.config) for p in self.paths]
        self.references = [self.model] + [merged(self.model, p) for p in self.paths]


@pytest.fixture(scope="module", params=ARCHS)
def setup(request, tmp_path_factory):
    return Setup(request.param, tmp_path_factory.mktemp(request.param))


def _ids(n, seed):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def mixed_steps(forward, adapters=(0, 1, 2, 3, 4, 1, 2), static=False):
    """Three steps on `forward`, rows of these adapters; returns per row (adapter, its whole sequence,
    {position: logits}) for every position any step computed logits at.
    1: each row but the last two prefills its prompt (a suffix of its slot), and a prefix of the
       last adapter's fills its own buffer; 2: those rows decode a token, the last row but one
       continues the prefix (anchored on it), the last prefills; 3: every row decodes
       (through `StaticDecode` where `static`)."""
    shapes = forward.layer_shapes()
    kv = RowKV(shapes, 8, 64, torch.float32, CPU)
    rows = [{"adapter": a, "ids": _ids(9 + 3 * i, i), "slot": kv.take(1)[0], "base": 0, "anchor": None,
             "logits": {}} for i, a in enumerate(adapters)]
    first, anchored, last = rows[:-2], rows[-2], rows[-1]
    prefix_ids = _ids(14, 99)
    prefix = PrefixKV(shapes, len(prefix_ids), torch.float32, CPU)
    anchored.update(base=len(prefix_ids), anchor=prefix, full=prefix_ids)

    def run(decode, segments, owners, use_static=False):
        step = StaticDecode(kv, CPU).build(decode, [r["ids"][-1] for r in owners]) if use_static else \
            build(decode, [r["ids"][-1] for r in owners[: len(decode)]], segments, kv, CPU)
        with torch.inference_mode():
            logits = forward.forward(step, torch.arange(step.tokens))
        return step, logits

    segs = [(Segment(0, 0, kv.k, kv.v, r["slot"], 0, 0, adapter=r["adapter"]), r["ids"]) for r in first]
    segs.append((Segment(0, 0, prefix.k, prefix.v, 0, 0, 0, adapter=anchored["adapter"]), prefix_ids))
    step, logits = run([], segs, [])
    for r, (seg, _) in zip(first, segs):
        r["logits"].update({p: logits[seg.t0 + p] for p in range(len(r["ids"]))})
        kv.advance(r["slot"], len(r["ids"]))
    for r in first:
        r["ids"].append(_ids(1, r["slot"] + 50)[0])
    segs = [(Segment(0, 0, kv.k, kv.v, r["slot"], 0, r["base"], r["anchor"], r["adapter"]), r["ids"])
            for r in (anchored, last)]
    step, logits = run([Decode(r["slot"], 0, None, r["adapter"]) for r in first], segs, first)
    for t, r in enumerate(first):
        r["logits"][len(r["ids"]) - 1] = logits[t]
        kv.advance(r["slot"])
    for r, (seg, ids) in zip((anchored, last), segs):
        r["logits"].update({r["base"] + p: logits[seg.t0 + p] for p in range(len(ids))})
        kv.advance(r["slot"], len(ids))
    for r in rows:
        r["ids"].append(_ids(1, r["slot"] + 70)[0])
    decode = [Decode(r["slot"], r["base"], r["anchor"], r["adapter"]) for r in rows]
    step, logits = run(decode, [], rows, use_static=static)
    for r in rows:
        r["logits"][r["base"] + len(r["ids"]) - 1] = logits[r["slot"]]  # static: token i is slot i's
    return [(r["adapter"], (r.get("full") or []) + r["ids"], r["logits"]) for r in rows]


def _compare(setup, results, atol=1e-4, logprobs=False, top=None):
    """Every logit (or log-probability) within atol of the reference's; with `top`, only at the
    reference's `top` most likely tokens of each position (what logprobs and top_logprobs report)."""
    worst = 0.0
    norm = (lambda z: z.log_softmax(-1)) if logprobs else (lambda z: z)  # noqa: E731
    for adapter, ids, logits in results:
        with torch.inference_mode():
            want = norm(setup.references[adapter](torch.tensor([ids])).logits[0])
        for p, got in logits.items():
            diff = (norm(got) - want[p]).abs()
            if top is not None:
                diff = diff[want[p].topk(top).indices]
            worst = max(worst, float(diff.max()))
    assert worst < atol, worst
    return worst


@pytest.mark.parametrize("code", ["decoder", "hf"])
def test_mixed_steps_equal_peft_merged_models(setup, code):
    forward = setup.decoder if code == "decoder" else setup.hf
    forward.set_adapters(setup.infos)
    _compare(setup, mixed_steps(forward))
    _compare(setup, mixed_steps(forward, static=True))


def test_every_adapter_changes_the_logits(setup):
    """What makes the comparisons above able to fail: each adapter's merged model is far from the
    base model's on the same sequence."""
    ids = torch.tensor([_ids(30, 5)])
    with torch.inference_mode():
        base = setup.model(ids).logits
        for m in setup.references[1:]:
            assert (m(ids).logits - base).abs().max() > 0.05


@pytest.mark.parametrize("code", ["decoder", "hf"])
@pytest.mark.parametrize("factor", [1.02, 0.98])
def test_a_wrong_scaling_breaks_the_comparison(setup, code, factor, monkeypatch):
    import dataclasses

    from batchgen.pipeline.model import lora

    real = lora.inspect_adapter
    monkeypatch.setattr(lora, "inspect_adapter", lambda path, base: dataclasses.replace(
        real(path, base), scaling=real(path, base).scaling * factor))
    forward = setup.decoder if code == "decoder" else setup.hf
    forward.set_adapters(setup.infos)
    with pytest.raises(AssertionError):
        _compare(setup, mixed_steps(forward))


@pytest.mark.parametrize("code", ["decoder", "hf"])
def test_a_base_only_step_is_bit_identical_with_adapters_set(setup, code, tmp_path):
    """Adapters set change nothing for the base model's tokens: the same logits, bit for bit."""
    arch = type(setup.model).__name__
    model, decoder = make_decoder({"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                                   "MistralForCausalLM": "mistral"}[arch], tmp_path)
    forward = decoder if code == "decoder" else HFModel(model)
    before = mixed_steps(forward, adapters=(0,) * 7)
    forward.set_adapters(setup.infos)
    after = mixed_steps(forward, adapters=(0,) * 7)
    for (_, ids_a, la), (_, ids_b, lb) in zip(before, after):
        assert ids_a == ids_b and la.keys() == lb.keys()
        assert all(torch.equal(la[p], lb[p]) for p in la)


def test_step_lora_groups_tokens_by_adapter():
    """Per adapter present, its token indices: a slice where they are consecutive, none for base tokens."""
    from batchgen.pipeline.model.kv import LayerShape

    kv = RowKV([LayerShape(1, 4, 4)], 4, 8, torch.float32, CPU)
    decode = [Decode(0, 0, adapter=2), Decode(1, 0), Decode(2, 0, adapter=2)]
    segs = [(Segment(0, 0, kv.k, kv.v, 3, 0, 0, adapter=1), [5, 6, 7])]
    step = build(decode, [1, 1, 1], segs, kv, CPU)
    assert step.lora[0] == (1, slice(3, 6)) and step.lora[1][0] == 2 and step.lora[1][1].tolist() == [0, 2]
    assert build([Decode(0, 0)], [1], [], kv, CPU).lora == []
    static = StaticDecode(kv, CPU).build([Decode(1, 0, adapter=1), Decode(0, 0)], [1, 1])
    assert static.lora == [(1, slice(1, 2))]


@pytest.mark.parametrize("code", ["decoder", "hf"])
def test_an_adapter_index_it_was_not_given(setup, code):
    forward = setup.decoder if code == "decoder" else setup.hf
    forward.set_adapters(setup.infos[:1])
    with pytest.raises(AdapterError, match="a token runs adapter 2, but the model was given 1 adapters"):
        mixed_steps(forward, adapters=(0, 1, 2, 0, 0, 0, 0))


def test_files_changed_since_they_were_checked(setup, tmp_path):
    info = setup.infos[0]
    path = setup.paths[0] / "adapter_config.json"
    text = path.read_text()
    try:
        path.write_text(text.replace('"lora_alpha": 4', '"lora_alpha": 5'))
        with pytest.raises(AdapterError, match="its files changed since they were checked"):
            setup.decoder.set_adapters([info])
    finally:
        path.write_text(text)


def _parts(info):
    return [(p, "self_attn" if p[0] in "qkvo" else "mlp") for p in info.targets]


def _as_peft(y, want, dtype):
    """float32: to its rounding (peft scales B(A x), batchgen folds the scaling into B); bfloat16:
    equal but for the rare element where that rounding crosses a bfloat16 rounding point (an
    update rounded to bfloat16 before the addition, not peft's float32 sum, parts a fifth of them)."""
    if dtype == torch.float32:
        return torch.allclose(y, want, rtol=1e-5, atol=1e-5)
    return float((y != want).float().mean()) < 0.01 and torch.allclose(y.float(), want.float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", ["all", "slice", "index"])
@pytest.mark.parametrize("adapter", [2, 3])  # rslora (scaling 8 / sqrt 8) on k/o/gate/down; rank 64 on all
def test_one_projection_computes_as_peft_does(setup, dtype, rows, adapter):
    """In the model's dtype as peft computes it (`peft.tuners.lora.Linear.forward`, its loader
    keeping a bfloat16 model's adapter in float32): every adapted projection's output, for all
    rows, a run of rows and scattered rows (peft's own forward over just those rows: a GEMM's
    rounding may depend on its row count); the other rows keep the base output bit for bit."""
    import copy

    from peft import PeftModel

    from batchgen.pipeline.model import lora

    base = copy.deepcopy(setup.model).to(dtype)
    info = setup.infos[adapter - 1]
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(setup.paths[adapter - 1])).eval()
    adapters = lora.Adapters([info], base.config, lora.SINGLE_GROUPS, CPU, dtype)
    idx = {"all": slice(0, 64), "slice": slice(20, 50), "index": torch.arange(0, 64, 3)}[rows]
    chosen = torch.zeros(64, dtype=torch.bool)
    chosen[idx] = True
    for proj, part in _parts(info):
        module = peft_model.get_submodule(f"base_model.model.model.layers.1.{part}.{proj}")
        x = torch.randn(64, module.in_features, generator=torch.Generator().manual_seed(3)).to(dtype)
        with torch.inference_mode():
            want = module(x[chosen])  # (n, out): those rows through the adapter
            y = module.base_layer(x)
            adapters.apply(1, proj, x, y, adapters.plan([(1, idx)]))
            assert y.dtype == dtype and not torch.equal(want, module.base_layer(x[chosen]))
        assert _as_peft(y[chosen], want, dtype), proj
        assert torch.equal(y[~chosen], module.base_layer(x)[~chosen])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_several_adapters_in_one_projection_compute_as_peft_does(setup, dtype):
    """Rows of three adapters (of ranks 8, 64 and 8, on different projections, in unequal numbers)
    and the base model in one projection call: each row as peft computes it for its own adapter."""
    import copy

    from peft import PeftModel

    from batchgen.pipeline.model import lora

    base = copy.deepcopy(setup.model).to(dtype)
    peft_models = {a: PeftModel.from_pretrained(copy.deepcopy(base), str(setup.paths[a - 1])).eval() for a in (2, 3, 4)}
    adapters = lora.Adapters(setup.infos, base.config, lora.SINGLE_GROUPS, CPU, dtype)
    rows = {2: [0, 3, 5], 3: [1, 2, 4, 6, 8], 4: [9]}  # row 7: the base model
    plan = adapters.plan([(a, torch.tensor(r)) for a, r in rows.items()])
    assert plan.real is not None and plan.ids.tolist() == [2, 3, 4]  # padded, a subset of the adapters
    for proj, part in _parts(setup.infos[2]):
        name = f"model.layers.1.{part}.{proj}"
        plain = base.get_submodule(name)
        x = torch.randn(10, plain.in_features, generator=torch.Generator().manual_seed(4)).to(dtype)
        with torch.inference_mode():
            y = plain(x)
            adapters.apply(1, proj, x, y, plan)
            assert torch.equal(y[7], plain(x)[7])
            for a, r in rows.items():
                want = peft_models[a].get_submodule("base_model.model." + name)(x)
                assert _as_peft(y[r], want[r], dtype), (proj, a)


@pytest.mark.slow
@pytest.mark.parametrize("code", ["decoder", "hf"])
def test_the_default_model_with_random_adapters(code, tmp_path):
    """The real default model (SmolLM2-135M) with two random adapters mixed with its own rows: their
    reported log-probabilities within 2e-4 of peft's merged models run in float64 (its logits reach
    30 and more: against a float32 reference, that reference's own rounding over 30 layers is a
    share of the difference, and it moves with the GEMMs' summation order and thread count)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from batchgen.pipeline.model.default_model import default_model_path
    from batchgen.pipeline.model.load import load_model

    # transformers' own load (load_model packs the weights for oneDNN, which peft cannot copy)
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    forward = load_model(None, "cpu", "float32")[0] if code == "decoder" else HFModel(load_model(
        None, "cpu", "float32", own_decoder=False)[0])
    assert forward.model_code == ("batchgen" if code == "decoder" else "transformers")
    paths = [make_adapter(model, tmp_path / "a", rank=8, seed=1, size=0.2),
             make_adapter(model, tmp_path / "b", rank=16, targets=("q_proj", "v_proj", "up_proj"), rslora=True,
                          seed=2, size=0.2)]
    forward.set_adapters([inspect_adapter(p, forward.config) for p in paths])
    exact = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float64).eval()
    setup = SimpleNamespace(references=[exact] + [merged(exact, p) for p in paths])
    results = mixed_steps(forward, adapters=(0, 1, 2, 1, 0, 2, 1))
    # the reported log-probabilities (the 20 most likely tokens: OpenAI's top_logprobs at most) within
    # 2e-4 of float64's, the whole vocabulary's within 5e-4: float32 rounding over 30 layers, with
    # logits of 30 (transformers' own float32 forward of these rows is 1.5e-4 from float64's, the
    # decoder's less); an adapter applied wrongly moves them by more than 0.1 (below)
    _compare(setup, results, atol=2e-4, logprobs=True, top=20)
    _compare(setup, results, atol=5e-4, logprobs=True)
    ids = torch.tensor([_ids(20, 7)])
    with torch.inference_mode():  # what makes it able to fail: each adapter moves the logits far more
        assert all((m(ids).logits - exact(ids).logits).abs().max() > 0.1 for m in setup.references[1:])
