"""The decoder's one-pass norm and gate (pipeline/model/cpu_layer_ops.c) bit for bit against
PyTorch's ops: transformers' RMSNorm after the residual sum, and silu(gate) * up, in float32 and
bfloat16, on widths whose squares' sums carry up ATen's cascade levels and on sizes whose last
elements PyTorch's loop takes one by one; then the decoder's logits with and without them."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from batchgen.pipeline.model import native
from batchgen.pipeline.model.decoder import _rotate_
from batchgen.pipeline.model.kv import PrefixKV
from batchgen.pipeline.model.step import Segment, build
from tests.helpers.tiny_models import make_decoder

DTYPES = [torch.float32, torch.bfloat16]
each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
OPS = native.layer_ops(torch.float32, 4, 2, 16, 64, 128)
pytestmark = pytest.mark.skipif(OPS is None, reason=f"no native kernels here: {native.why_not(torch.float32, 4, 2, 16, 16)}")


def _rand(*shape, dtype, seed, scale=3.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@each_dtype
@pytest.mark.parametrize("rows,width", [(1, 16), (37, 64), (611, 576), (3, 1040), (2, 8192)])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "plain"])
def test_add_rms_norm_is_pytorch_bitwise(dtype, rows, width, residual):
    """x += r, then LlamaRMSNorm(x): x after the sum and the norm both equal to the bit (width
    576 carries the squares' sum up one level, 8192 up two; 16 and 1040 end in a short row)."""
    x, r = _rand(rows, width, dtype=dtype, seed=1), _rand(rows, width, dtype=dtype, seed=2)
    ref = LlamaRMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(_rand(width, dtype=dtype, seed=3, scale=1.0))
    with torch.inference_mode():
        summed = x + r if residual else x.clone()
        want = ref(summed)
        got = OPS.add_rms_norm(x, r if residual else None, ref.weight.detach(), 1e-6)
    assert torch.equal(x, summed)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"


@each_dtype
@pytest.mark.parametrize("rows,width", [(1, 16), (3, 48), (5, 80), (64, 1536), (7, 1040)])
def test_silu_mul_is_pytorch_bitwise(dtype, rows, width):
    """silu(g) * u into g; sizes with a tail PyTorch computes one element at a time, and values
    past exp's limits (silu of -110 is -0, of 110 is 110)."""
    g, u = _rand(rows, width, dtype=dtype, seed=4, scale=6.0), _rand(rows, width, dtype=dtype, seed=5)
    g.view(-1)[:6] = torch.tensor([-110.0, 110.0, -104.5, 0.0, -0.0, 88.0]).to(dtype)
    want = F.silu(g) * u
    got = OPS.silu_mul(g.clone(), u)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"


@each_dtype
@pytest.mark.parametrize("threads", [2, 3])
def test_silu_mul_is_pytorch_bitwise_across_threads(dtype, threads):
    """Above ATen's grain size PyTorch splits the elements into its threads' chunks, each with its
    own one-by-one tail: 37 x 1,040 elements make chunks that are not a multiple of its vectors."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(4):
            g, u = _rand(37, 1040, dtype=dtype, seed=20 + seed, scale=6.0), _rand(37, 1040, dtype=dtype, seed=30 + seed)
            want = F.silu(g) * u
            got = OPS.silu_mul(g.clone(), u)
            assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"
    finally:
        torch.set_num_threads(before)


@each_dtype
@pytest.mark.parametrize("tokens,heads,d", [(1, 1, 16), (37, 6, 16), (300, 15, 64), (5, 3, 128), (9, 2, 40)])
def test_rotate_is_decoders_bitwise(dtype, tokens, heads, d):
    """Queries and keys as the decoder hands them over (a view of the fused QKV output, the
    values' heads after them), rotated in place; head sizes whose half is not a whole vector."""
    qkv = _rand(tokens, heads + 2, d, dtype=dtype, seed=6)
    cos, sin = _rand(tokens, 1, d, dtype=dtype, seed=7, scale=1.0), _rand(tokens, 1, d, dtype=dtype, seed=8, scale=1.0)
    want = qkv.clone()
    _rotate_(want[:, :heads], cos, sin)
    got = qkv.clone()
    OPS.rotate(got[:, :heads], cos, sin)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 17), (64, 49152), (300, 250)])
def test_greedy_is_argmax_and_finite(rows, vocab):
    """Each row's first maximum and its finiteness, against argmax and aminmax: ties (rounded
    logits), rows of -inf, and NaN and inf put anywhere in a row."""
    logits = _rand(rows, vocab, dtype=torch.float32, seed=9).round()  # many equal maxima
    flat = logits.view(-1)
    for i, value in enumerate([float("nan"), float("inf"), float("-inf")]):
        flat[(i * 7919) % flat.numel()] = value
    if rows > 2:
        logits[2] = float("-inf")
    got = native.greedy(logits)
    assert got is not None
    low, high = torch.aminmax(logits, dim=-1)
    finite = (torch.isfinite(low) & torch.isfinite(high)).tolist()
    assert got[1] == finite
    want = logits.argmax(dim=-1)
    assert all(g == w for g, w, ok in zip(got[0].tolist(), want.tolist(), finite) if ok)  # a non-finite row fails
    if rows > 2:
        assert got[0][2] == want[2] == 0
    assert native.greedy(logits.to(torch.bfloat16)) is None  # PyTorch's ops for these
    assert vocab == 1 or native.greedy(logits[:, ::2]) is None


@each_dtype
@pytest.mark.parametrize("every", [True, False], ids=["all-tokens", "some-tokens"])
def test_store_rows_is_indexed_assignment(dtype, every):
    """A step's keys and values (views of the fused QKV output, as the decoder hands them over)
    into slots out of order, at own indices, as `Step.store`'s indexed assignment writes them;
    an index out of range writes nothing and says so."""
    heads, t, d, slots, cap = 3, 9, 16, 6, 20
    qkv = _rand(t, 2 * heads + 4, d, dtype=dtype, seed=10)
    k, v = qkv[:, 4 : 4 + heads].transpose(0, 1), qkv[:, 4 + heads :].transpose(0, 1)  # (H, T, D) views
    tokens = slice(None) if every else torch.tensor([8, 0, 3, 5])
    n = t if every else 4
    slot, at = (torch.arange(n) * 5) % slots, (torch.arange(n) * 7) % cap  # out of order, each pair once
    want_k, want_v = _rand(slots, heads, cap, d, dtype=dtype, seed=12), _rand(slots, heads, cap, d, dtype=dtype, seed=13)
    got_k, got_v = want_k.clone(), want_v.clone()
    want_k[slot, :, at] = k[:, tokens].transpose(0, 1)
    want_v[slot, :, at] = v[:, tokens].transpose(0, 1)
    assert native.store_rows(k, v, got_k, got_v, tokens, slot, at)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    before = got_k.clone()
    bad = at.clone()
    bad[-1] = cap
    assert not native.store_rows(k, v, got_k, got_v, tokens, slot, bad)
    assert torch.equal(got_k, before)


def test_layer_ops_refuse():
    """PyTorch's ops where the widths are not the kernels' (multiples of 16), or when asked."""
    assert native.layer_ops(torch.float32, 4, 2, 16, 72, 128) is None
    assert native.layer_ops(torch.float32, 4, 2, 16, 64, 120) is None
    assert native.layer_ops(torch.float16, 4, 2, 16, 64, 128) is None


@pytest.mark.parametrize("capability", ["AVX512", "AVX2", "DEFAULT"])
def test_layer_ops_only_where_aten_runs_the_same_width(capability, monkeypatch):
    """The passes' bits are those of ATen's kernels for the library's vector width (the gate's
    one-by-one tails follow it): where ATen runs another width (ATEN_CPU_CAPABILITY, an AVX2 library
    on an AVX-512 CPU), PyTorch's ops run instead."""
    built = native.LAYER_OPS_CAPABILITY[native._lib(2, 16).batchgen_layer_ops()]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert (native.layer_ops(torch.float32, 4, 2, 16, 64, 128) is not None) == (capability == built)
    # bfloat16 only on AVX-512: AVX2 has no conversions for it (the passes' bits are tested above either way)
    assert (native.layer_ops(torch.bfloat16, 4, 2, 16, 64, 128) is not None) == (capability == built == "AVX512")


@each_dtype
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoder_logits_equal_with_and_without(arch, dtype, tmp_path, monkeypatch):
    """A 40-token prefill and every position's logits: the decoder on the one-pass ops and on
    PyTorch's (`BATCHGEN_LAYER_OPS=0`), equal to the bit."""
    if native.layer_ops(dtype, 4, 2, 16, 64, 128) is None:
        pytest.skip("the decoder keeps PyTorch's ops for this dtype here (bfloat16 on an AVX2 library)")
    _, dec = make_decoder(arch, tmp_path, dtype=dtype)
    monkeypatch.setenv("BATCHGEN_LAYER_OPS", "0")
    _, ref = make_decoder(arch, tmp_path / "ref", dtype=dtype)
    assert dec.ops is not None and ref.ops is None
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = []
    for model in (dec, ref):
        kv = PrefixKV(model.layer_shapes(), len(ids), dtype, torch.device("cpu"))
        step = build([], [], [(Segment(0, 0, kv.k, kv.v, 0, 0, 0), ids)], None, torch.device("cpu"))
        with torch.inference_mode():
            logits.append(model.forward(step, torch.arange(len(ids))))
    assert torch.equal(*logits)
