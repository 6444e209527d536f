"""The decoder's float32 linear layers on batchgen's GEMM (pipeline/model/cpu_gemm.c): against a
float64 product (at least as close as `F.linear`), the same bits for a row whatever batch and
threads it runs with, every tail of rows, outputs and k blocks, the bias; then the decoder's
logits and greedy tokens against oneDNN's layers (`BATCHGEN_GEMM=0`)."""
import pytest
import torch
import torch.nn.functional as F

from batchgen.pipeline.model import native
from batchgen.pipeline.model.kv import PrefixKV
from batchgen.pipeline.model.precision import cpu_flags
from batchgen.pipeline.model.step import Segment, build
from tests.helpers.native_builds import build_for
from tests.helpers.tiny_models import make_decoder

GEMM = native.gemm(torch.float32, 4, 2, 16)
pytestmark = pytest.mark.skipif(GEMM is None, reason=f"no native GEMM here: {native.why_not(torch.float32, 4, 2, 16, 16)}")


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# rows: 1 and 7 (one short tile), 8, 9, 65 and 130 (a tile and some rows), 300 (blocks of rows);
# outputs: panels of 48 and tails of 1, 47, 2; k: 1, within one block of 128 steps, 129, several
@pytest.mark.parametrize("m,n,k", [(1, 5, 3), (7, 49, 17), (8, 48, 128), (9, 97, 129), (65, 200, 576),
                                   (130, 95, 1536), (300, 1000, 100), (3, 4096, 1), (0, 10, 5)])
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_linear_matches_float64(m, n, k, bias):
    w, x = _rand(n, k, seed=1), _rand(m, k, seed=2)
    b = _rand(n, seed=3) if bias else None
    got = GEMM.linear(w, b)(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    if m:
        err = (got.double() - ref).abs().max().item()
        theirs = (F.linear(x, w, b).double() - ref).abs().max().item()
        assert err <= 2 * theirs + 1e-6, (err, theirs)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_rows_bits_do_not_depend_on_its_batch_or_threads(threads):
    """Each output is the same sum in the same order however many rows run with it and however
    the work is shared out: a row alone, in a tile's tail, or in a block of 300 gives one result."""
    w, x, b = _rand(200, 700, seed=4), _rand(300, 700, seed=5), _rand(200, seed=6)
    layer = GEMM.linear(w, b)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = layer(x)
        torch.set_num_threads(threads)
        assert torch.equal(layer(x), want)
        for lo, hi in [(0, 1), (5, 12), (299, 300), (128, 300), (0, 64)]:
            assert torch.equal(layer(x[lo:hi]), want[lo:hi])
    finally:
        torch.set_num_threads(was)


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="only a CPU with AVX-512 runs both builds")
def test_the_avx2_build_gives_the_avx512_builds_bits(monkeypatch):
    """The AVX2 tile (6 rows x a third of a panel) sums each output in the AVX-512 tile's order, from
    the same packed panels: the same bits, so a packed file and a row's outputs do not depend on the CPU."""
    from batchgen.pipeline.model import native_build

    build_for(monkeypatch, "x86-64-v3")
    avx2 = native.Gemm(native_build._build(2, 16))
    for m, n, k in [(1, 5, 3), (7, 49, 17), (9, 97, 129), (130, 95, 1536), (300, 1000, 100)]:
        w, x, b = _rand(n, k, seed=7), _rand(m, k, seed=8), _rand(n, seed=9)
        assert torch.equal(avx2.linear(w, b)(x), GEMM.linear(w, b)(x)), (m, n, k)
        assert torch.equal(avx2.linear(w)(x), GEMM.linear(w)(x)), (m, n, k)
    # its gated pass (x packed in the scratch before the up projection's panel): the build's three passes' bits
    ops = native.LayerOps(native_build._build(2, 16))
    for m, n, k in [(7, 64, 17), (300, 96, 100), (130, 1536, 576)]:
        gate, up = avx2.linear(_rand(n, k, seed=10)), avx2.linear(_rand(n, k, seed=11), _rand(n, seed=12))
        x = _rand(m, k, seed=13)
        assert torch.equal(avx2.glu(gate, up, ops)(x), ops.silu_mul(gate(x), up(x))), (m, n, k)


OPS = native.layer_ops(torch.float32, 4, 2, 16, 64, 64)


# rows: one, a short tile, blocks of rows (300 at k 100: blocks of 128); outputs: one panel, a
# panel and a tail of 16, many panels; chunks: one (under ATen's grain) and two threads' halves
@pytest.mark.skipif(OPS is None, reason="no native layer ops here")
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (7, 64, 17), (300, 96, 100), (130, 1536, 576), (64, 1024, 129)])
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_gated_pass_gives_the_three_passes_bits(m, n, k, bias, threads):
    """`Gemm.glu`: silu(x gate + b) * (x up + c) in one pass, to the bit the GEMM twice and then
    `LayerOps.silu_mul` (three passes, whose bits are PyTorch's), on a whole batch and on a part of it."""
    g, u, x = _rand(n, k, seed=10), _rand(n, k, seed=11), _rand(m, k, seed=12)
    bg, bu = (_rand(n, seed=13), _rand(n, seed=14)) if bias else (None, None)
    gate, up = GEMM.linear(g, bg), GEMM.linear(u, bu)
    glu = GEMM.glu(gate, up, OPS)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        want = OPS.silu_mul(gate(x), up(x))
        assert torch.equal(want, F.silu(gate(x)) * up(x))  # the reference: PyTorch's ops
        got = glu(x)
        assert got.shape == (m, n) and torch.equal(got, want)
        assert torch.equal(glu(x[m // 2 :]), OPS.silu_mul(gate(x[m // 2 :]), up(x[m // 2 :])))
    finally:
        torch.set_num_threads(was)


@pytest.mark.skipif(OPS is None, reason="no native layer ops here")
def test_the_gated_pass_leaves_to_the_two_passes_what_pytorch_takes_one_by_one(monkeypatch):
    """48 outputs x 683 rows over two threads: each thread's chunk (16,392 elements) ends in 8 that
    PyTorch's silu takes one by one. The one pass declines (-1), and `glu` runs the three passes."""
    g, u, x = _rand(48, 32, seed=15), _rand(48, 32, seed=16), _rand(683, 32, seed=17)
    gate, up = GEMM.linear(g), GEMM.linear(u)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        chunk = native.silu_chunk(683 * 48)
        assert chunk % 32
        y = torch.empty(683, 48)
        lib = GEMM._lib
        assert lib.batchgen_gemm_glu(683, 48, 32, x.data_ptr(), 32, gate.packed.data_ptr(), None,
                                     up.packed.data_ptr(), None, y.data_ptr(), chunk, 2) == -1
        assert torch.equal(GEMM.glu(gate, up, OPS)(x), F.silu(gate(x)) * up(x))
    finally:
        torch.set_num_threads(was)


def test_inputs_of_any_layout():
    w = _rand(96, 64, seed=7)
    layer = GEMM.linear(w.t().contiguous().t())  # a weight with its rows strided
    x = _rand(2, 5, 128, seed=8)[..., ::2]  # (2, 5, 64), strided rows
    got = layer(x)
    assert got.shape == (2, 5, 96)
    assert torch.equal(got, GEMM.linear(w)(x.contiguous()))
    assert torch.allclose(got, F.linear(x, w), atol=1e-5)


def test_refused_where_it_does_not_serve(monkeypatch):
    assert native.gemm(torch.bfloat16, 4, 2, 16) is None  # bfloat16 stays on oneDNN's AMX kernels
    monkeypatch.setenv("BATCHGEN_GEMM", "0")
    assert native.gemm(torch.float32, 4, 2, 16) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q, k and v
def test_decoder_on_it_agrees_with_onednn(arch, tmp_path, monkeypatch):
    """A 40-token prefill: every position's logits close to the decoder's on oneDNN's layers, the
    same greedy tokens."""
    _, dec = make_decoder(arch, tmp_path)
    monkeypatch.setenv("BATCHGEN_GEMM", "0")
    _, ref = make_decoder(arch, tmp_path / "ref")
    # every linear layer of the decoder on it, none of the reference's
    layers = [dec.lm_head] + [f for layer in dec.layers for f in (layer.qkv, layer.o, layer.gate, layer.up, layer.down)]
    assert all(hasattr(f, "packed") for f in layers)
    assert all(layer.glu is not None for layer in dec.layers) == (dec.ops is not None)  # the MLP's gate in one pass
    assert not any(hasattr(f, "packed") for f in [ref.lm_head, ref.layers[0].qkv, ref.layers[0].down])
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = []
    for model in (dec, ref):
        kv = PrefixKV(model.layer_shapes(), len(ids), torch.float32, torch.device("cpu"))
        step = build([], [], [(Segment(0, 0, kv.k, kv.v, 0, 0, 0), ids)], None, torch.device("cpu"))
        with torch.inference_mode():
            logits.append(model.forward(step, torch.arange(len(ids))))
    ours, theirs = logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
