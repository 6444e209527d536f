"""The decoder's elementwise parts (pipeline/model/decoder.py) bit for bit against transformers'
modules and the decoder's own earlier formulas: in-place buffers and split products must not change
a single rounding, in float32 and in bfloat16."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from batchgen.pipeline.model.decoder import _rotate_
from tests.helpers.tiny_models import make_decoder

DTYPES = [torch.float32, torch.bfloat16]
each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
# (rows, hidden, query heads, key heads, head size): the tiny llama's; SmolLM2-135M's (the default
# model) at a prefill's rows, where the kernels run their vector loops, not only their tails
SHAPES = {"tiny": (37, 64, 4, 2, 16), "smollm": (611, 576, 9, 3, 64)}


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    return {dt: make_decoder("llama", tmp_path_factory.mktemp(str(dt)), dtype=dt)[1] for dt in DTYPES}


def _rand(*shape, dtype, seed):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def _old_norm(x, weight, eps):  # the decoder's formula before its buffers were reused
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _old_rotate(x, cos, sin):  # with the sign-folded sin, as the decoder's table holds it
    out = x * cos
    out += x.roll(x.shape[-1] // 2, dims=-1) * sin
    return out


@each_dtype
@pytest.mark.parametrize("size", SHAPES)
@pytest.mark.parametrize("shape", ["hidden", "heads"])
def test_norm_is_transformers_rmsnorm_bitwise(dtype, size, shape, decoders):
    """The residual stream (T, H), and query heads as Qwen3's q_norm reads them: a strided view of
    the fused QKV output (T, Hq, D)."""
    t, hidden, hq, hkv, d = SHAPES[size]
    dec = decoders[dtype]
    eps = dec.config.rms_norm_eps
    if shape == "hidden":
        x, width = _rand(t, hidden, dtype=dtype, seed=1), hidden
    else:
        x, width = _rand(t, hq + 2 * hkv, d, dtype=dtype, seed=1)[:, :hq], d
    ref = LlamaRMSNorm(width, eps=eps).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(_rand(width, dtype=dtype, seed=2))
    before = x.clone()
    with torch.inference_mode():
        got = dec._norm(x, ref.weight.detach())
        want = ref(x)
    assert torch.equal(x, before)  # its input is never written (float32: x.float() is x)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(got, _old_norm(x, ref.weight.detach(), eps))


@each_dtype
@pytest.mark.parametrize("size", SHAPES)
def test_rotary_in_place_is_transformers_bitwise(dtype, size, decoders):
    """Queries and keys rotated in the fused QKV output, as the forward does; values untouched.
    The tiny model's table from the decoder; at SmolLM2's head size a random one."""
    t, _, hq, hkv, d = SHAPES[size]
    if size == "tiny":
        pos = torch.randint(0, 300, (t,), generator=torch.Generator().manual_seed(8))
        cos, sin = decoders[dtype]._rope(pos)  # (T, 1, D); sin's first half negated
    else:
        cos, sin = _rand(t, 1, d, dtype=dtype, seed=8), _rand(t, 1, d, dtype=dtype, seed=9)
    plain_sin = torch.cat((-sin[..., : d // 2], sin[..., d // 2 :]), dim=-1)  # the unfolded sin, exactly
    qkv = _rand(t, hq + 2 * hkv, d, dtype=dtype, seed=3)
    qk = qkv[:, : hq + hkv].clone()
    values = qkv[:, hq + hkv :].clone()
    _rotate_(qkv[:, : hq + hkv], cos, sin)
    assert torch.equal(qkv[:, : hq + hkv], qk * cos + rotate_half(qk) * plain_sin)  # transformers' formula
    assert torch.equal(qkv[:, : hq + hkv], _old_rotate(qk, cos, sin))
    assert torch.equal(qkv[:, hq + hkv :], values)


@each_dtype
def test_mlp_and_residual_in_place_are_the_same_sums(dtype):
    gate, up = _rand(611, 1536, dtype=dtype, seed=4), _rand(611, 1536, dtype=dtype, seed=5)
    x, o = _rand(611, 576, dtype=dtype, seed=6), _rand(611, 576, dtype=dtype, seed=7)
    want_mid, want_x = F.silu(gate) * up, x + o
    assert torch.equal(F.silu(gate.clone(), inplace=True).mul_(up), want_mid)
    assert torch.equal(x.add_(o), want_x)
