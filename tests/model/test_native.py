"""The compiled attention kernels (pipeline/cpu_attention.c) against the matmul reference, and the
engine on them against the engine on PyTorch's kernels and against plain generate."""
import os
import platform

import random
import re

import pytest
import torch

from tests.helpers.jobsets import edge_case_requests, tokenizer
from tests.helpers.native_builds import build_for, flags_for
from batchgen.pipeline.model import attention
from batchgen.pipeline.model import native
from batchgen.pipeline.model import native_build
from batchgen.pipeline.model.precision import cpu_flags
from batchgen.pipeline.engine.engine import Engine
from tests.helpers.reference import reference_generate
from tests.helpers.tiny_models import make_model

needs_kernel = pytest.mark.skipif(not native.supports(torch.float32, 4, 2, 64, 64),
                                  reason=f"no native kernel here: {native.why_not(torch.float32, 4, 2, 64, 64)}")


# The kernels' builds this CPU runs: its own (-march=native), and on an AVX-512 CPU also the AVX2
# one (vectors of 8 floats: other tiles, other code), which would otherwise run only on AVX2 machines
BUILDS = ["native"] + (["x86-64-v3"] if {"avx512f", "avx2", "fma"} <= cpu_flags() else [])


def _fresh_kernel_caches(monkeypatch):
    """For this test, nothing built or checked yet: every cache of built or checked kernels a fresh
    dict of the test's own (the process's are left as they were, and are back after it)."""
    libs, errors = {}, {}
    for module in (native, native_build):  # native imports both dicts by name
        monkeypatch.setattr(module, "_libs", libs)
        monkeypatch.setattr(module, "_errors", errors)
    monkeypatch.setattr(attention, "_NATIVE_OK", {})
    monkeypatch.setattr(native, "_prefill_kernels", {})


@pytest.fixture(params=BUILDS)
def build(request, monkeypatch):
    """The test runs on each of `BUILDS` in turn (the other build with caches of its own)."""
    if request.param != "native":
        _fresh_kernel_caches(monkeypatch)
        build_for(monkeypatch, request.param)
        assert native.supports(torch.float32, 4, 2, 64, 64), native.why_not(torch.float32, 4, 2, 64, 64)
    return request.param


def _case(hq, hkv, d, dtype, seed=0):
    """Rows over shared anchors and their own keys: lengths 1 to 300, slots out of order, rows
    without an anchor, queries a strided view as the model hands them over."""
    g = torch.Generator().manual_seed(seed)
    slots, cap = 7, 300
    own_k, own_v = (torch.randn(slots, hkv, cap, d, generator=g).to(dtype) for _ in range(2))
    anchors = [tuple(torch.randn(1, hkv, n, d, generator=g).to(dtype) for _ in range(2)) for n in (1, 90, 257)]
    rows = [(3, 1, 0), (0, 300, None), (6, 17, 2), (1, 2, 1), (5, 64, 2), (2, 1, None)]  # slot, own keys, anchor
    q = torch.randn(hq, len(rows) + 3, d, generator=g).to(dtype)[:, 2 : 2 + len(rows)].transpose(0, 1)  # (n, Hq, D)
    ptr = lambda i, a: anchors[a][i].data_ptr() if a is not None else 0  # noqa: E731
    args = (torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
            torch.tensor([ptr(0, r[2]) for r in rows]), torch.tensor([ptr(1, r[2]) for r in rows]),
            torch.tensor([anchors[r[2]][0].shape[2] if r[2] is not None else 0 for r in rows]))
    want = []
    for i, (slot, n, a) in enumerate(rows):
        keys, values = own_k[slot : slot + 1, :, :n], own_v[slot : slot + 1, :, :n]
        if a is not None:
            keys, values = torch.cat([anchors[a][0], keys], dim=2), torch.cat([anchors[a][1], values], dim=2)
        o, _ = attention.partial(q[i][None, :, None].float(), keys.float(), values.float(), None, d ** -0.5)
        want.append(o[0, :, 0])
    return q, own_k, own_v, args, anchors, torch.stack(want)


def _tolerance(dtype, hq, hkv, d, anchors):
    """float32 scores and sums over the inputs as they are (bfloat16 widened exactly); on AMX tiles
    the anchors' weights meet the values as two bfloat16 parts, 16 bits of their 24."""
    amx = anchors == "matmul" and native.amx(dtype, hq, hkv, d)
    return {"atol": 1e-5, "rtol": 1e-5} if amx else {"atol": 2e-6, "rtol": 1e-5}


@pytest.mark.usefixtures("build")
@needs_kernel
@pytest.mark.parametrize("anchors", list(native.ANCHORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (9, 3, 64), (8, 8, 32), (8, 1, 128), (12, 2, 80)])
def test_kernel_equals_reference(hq, hkv, d, dtype, anchors):
    q, own_k, own_v, args, _, want = _case(hq, hkv, d, dtype)
    out = torch.full((q.shape[0], hq, d), float("nan"))
    assert native.supports(dtype, hq, hkv, d, d)
    assert native.decode_attention(q, own_k, own_v, *args, d ** -0.5, out, anchors=anchors)
    assert torch.allclose(out, want, **_tolerance(dtype, hq, hkv, d, anchors)), (out - want).abs().max()
    _same_bits_in_the_dtype(out, lambda o: native.decode_attention(q, own_k, own_v, *args, d ** -0.5, o, anchors=anchors),
                            dtype)


def _same_bits_in_the_dtype(out, call, dtype):
    """The kernel's output written in bfloat16 (the engine's path) is its float32 output cast, bit for bit."""
    if dtype == torch.float32:
        return
    narrow = torch.full(out.shape, float("nan"), dtype=dtype)
    assert call(narrow)
    assert torch.equal(narrow.view(torch.int16), out.to(dtype).view(torch.int16))


def _many_rows(hq, hkv, d, dtype, lengths, rows_each, uniform, seed=3):
    """Groups of rows over anchors of these lengths (every tile and chunk size, and their tails),
    each row with 1-9 own keys, slots shuffled. `uniform`: zero queries, so every weight is exactly
    1 and each output is the exact mean of the values it reads: a key read twice or missed shows."""
    g = torch.Generator().manual_seed(seed)
    rows = rows_each * len(lengths)
    own_k, own_v = (torch.randn(rows, hkv, 9, d, generator=g).to(dtype) for _ in range(2))
    anchors = [tuple(torch.randn(1, hkv, n, d, generator=g).to(dtype) for _ in range(2)) for n in lengths]
    if uniform:  # values of whole numbers: their sums are exact in float32
        own_v, anchors = own_v.round(), [(k, v.round()) for k, v in anchors]
    q = torch.randn(rows, hq, d, generator=g).to(dtype) * (0 if uniform else 1)
    slots = torch.randperm(rows, generator=g)
    own = torch.randint(1, 10, (rows,), generator=g)
    which = [i % len(lengths) for i in range(rows)]
    args = (slots, own, torch.tensor([anchors[a][0].data_ptr() for a in which]),
            torch.tensor([anchors[a][1].data_ptr() for a in which]), torch.tensor([lengths[a] for a in which]))
    want = torch.stack([_reference(q[i], own_k[s : s + 1], own_v[s : s + 1], anchors[a], int(n) - 1)
                        for i, (s, n, a) in enumerate(zip(slots.tolist(), own, which))])
    return q, own_k, own_v, args, anchors, want  # the anchors too: args holds only their addresses


@pytest.mark.usefixtures("build")
@needs_kernel
@pytest.mark.parametrize("anchors", list(native.ANCHORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 32), (4, 1, 128), (6, 2, 48)])
def test_anchor_kernels_over_many_rows(hq, hkv, d, dtype, anchors):
    """Up to 27 rows an anchor (one to four tiles of rows, partly filled), anchors of 1 to 1,000 keys
    (one to nine chunks, partly filled), on 1 to 5 threads (the anchors' keys split in slices when
    few items would leave threads idle, then merged)."""
    before = torch.get_num_threads()
    try:
        for rows_each, lengths in ((27, (1, 13, 140)), (5, (1000,)), (22, (333, 1000))):
            for uniform in (True, False):
                q, own_k, own_v, args, _, want = _many_rows(hq, hkv, d, dtype, lengths, rows_each, uniform)
                for threads in (1, 5):
                    torch.set_num_threads(threads)
                    out = torch.full((q.shape[0], hq, d), float("nan"))
                    assert native.decode_attention(q, own_k, own_v, *args, d ** -0.5, out, anchors=anchors)
                    tol = {"atol": 2e-6, "rtol": 1e-5} if uniform else _tolerance(dtype, hq, hkv, d, anchors)
                    assert torch.allclose(out, want, **tol), (lengths, uniform, threads, (out - want).abs().max())
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("build")
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 1, 128), (8, 8, 16)])
def test_own_keys_of_every_length(hq, hkv, d, dtype):
    """Rows with 1 to 40 own keys (every tail of the own part's blocks of 16 keys), each next to
    rows both longer and shorter (the kernel prefetches the next row's keys), idle slots between
    them, half with an anchor. Uniform queries first (each output the exact mean of the values it
    reads: a key read twice, missed or read past the row's end shows), then random ones."""
    g = torch.Generator().manual_seed(5)
    lengths = [1 + (7 * i) % 40 for i in range(40)]
    cap, slots = 48, 2 * len(lengths)
    own_k, own_v = (torch.randn(slots, hkv, cap, d, generator=g).to(dtype) for _ in range(2))
    own_v = own_v.round()
    anchor = tuple(torch.randn(1, hkv, 50, d, generator=g).to(dtype).round() for _ in range(2))
    slot = torch.arange(0, slots, 2)[torch.randperm(len(lengths), generator=g)]  # every other slot idle
    with_anchor = [i % 2 == 0 for i in range(len(lengths))]
    args = (slot, torch.tensor(lengths), torch.tensor([anchor[0].data_ptr() * a for a in with_anchor]),
            torch.tensor([anchor[1].data_ptr() * a for a in with_anchor]), torch.tensor([50 * a for a in with_anchor]))
    for uniform in (True, False):
        q = torch.randn(len(lengths), hq, d, generator=g).to(dtype) * (0 if uniform else 1)
        want = torch.stack([_reference(q[i], own_k[s : s + 1], own_v[s : s + 1], anchor if a else None, n - 1)
                            for i, (s, n, a) in enumerate(zip(slot.tolist(), lengths, with_anchor))])
        out = torch.full((len(lengths), hq, d), float("nan"))
        assert native.decode_attention(q, own_k, own_v, *args, d ** -0.5, out)
        tol = {"atol": 2e-6, "rtol": 1e-5} if uniform else _tolerance(dtype, hq, hkv, d, "matmul")
        assert torch.allclose(out, want, **tol), (uniform, (out - want).abs().max())


def test_amx_is_bfloat16_only():
    assert not native.amx(torch.float32, 9, 3, 64)
    assert not native.amx(torch.bfloat16, 6, 2, 48)  # tiles of 32 elements: head sizes of multiples of 32


def _reference(q, keys, values, anchor, last):
    """q (Hq, D) over the anchor's keys and own keys 0..last of a [1, Hkv, cap, D] row."""
    k, v = keys[:, :, : last + 1], values[:, :, : last + 1]
    if anchor is not None:
        k, v = torch.cat([anchor[0], k], dim=2), torch.cat([anchor[1], v], dim=2)
    o, _ = attention.partial(q[None, :, None].float(), k.float(), v.float(), None, q.shape[-1] ** -0.5)
    return o[0, :, 0]


@pytest.mark.usefixtures("build")
@needs_kernel
@pytest.mark.parametrize("dtype,kernel", [(torch.float32, "widen"), (torch.float32, "tile16"), (torch.bfloat16, "widen"),
                                          (torch.bfloat16, "dots"), (torch.bfloat16, "amx")])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (9, 3, 64), (8, 8, 32), (8, 1, 128), (12, 2, 80), (6, 2, 48)])
@pytest.mark.parametrize("uniform", [False, True])
def test_prefill_kernel_equals_reference(hq, hkv, d, dtype, kernel, uniform):
    """Runs of tokens: fresh suffixes in row slots (one token; 37 tokens, no anchor), a later chunk
    continuing its row's stored keys under a long anchor, and a prefix prefilled in its own buffer
    after tokens copied from its parent, a second segment under the long anchor; causal by own index, the
    rows' keys already stored. `kernel`: bfloat16 on AVX-512 BF16 dot products (where this CPU has them,
    else widened), on AMX tiles (refused where `native.amx` says no), or widened to float32; float32
    on its wide tile ("widen") or the 16-lane one ("tile16").
    `uniform`: zero queries and values of whole numbers, so every weight is exactly 1 (in bfloat16
    too) and each output the exact mean of the values it reads: a key read twice or missed shows."""
    g = torch.Generator().manual_seed(2)
    slots_k, slots_v = (torch.randn(4, hkv, 300, d, generator=g).to(dtype) for _ in range(2))
    prefix_k, prefix_v = (torch.randn(1, hkv, 120, d, generator=g).to(dtype) for _ in range(2))
    anchors = [tuple(torch.randn(1, hkv, n, d, generator=g).to(dtype) for _ in range(2)) for n in (1, 257)]
    if uniform:
        slots_v, prefix_v = (slots_v * 4).round(), (prefix_v * 4).round()
        anchors = [(k, (v * 4).round()) for k, v in anchors]
    # (tokens, buffer, row, first own index, anchor)
    segments = [(1, "slots", 3, 0, 0), (37, "slots", 0, 0, None), (45, "slots", 2, 100, 1), (40, "prefix", 0, 10, None),
                (22, "slots", 1, 5, 1)]
    t = sum(n for n, *_ in segments)
    q = torch.randn(hq, t + 5, d, generator=g).to(dtype)[:, 5:].transpose(0, 1) * (0 if uniform else 1)  # (T, Hq, D), strided
    buffers = {"slots": (slots_k, slots_v), "prefix": (prefix_k, prefix_v)}
    lt = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    starts = [sum(n for n, *_ in segments[:i]) for i in range(len(segments))]
    anc = lambda i, a: anchors[a][i].data_ptr() if a is not None else 0  # noqa: E731
    out = torch.full((t, hq, d), float("nan"))
    ran = native.prefill_attention(
        q, hkv, lt(starts), lt([a + n for a, (n, *_) in zip(starts, segments)]),
        lt([buffers[b][0].data_ptr() for _, b, *_ in segments]), lt([buffers[b][1].data_ptr() for _, b, *_ in segments]),
        lt([buffers[b][0].shape[2] for _, b, *_ in segments]), lt([r for _, _, r, *_ in segments]),
        lt([o for *_, o, _ in segments]), lt([anc(0, a) for *_, a in segments]), lt([anc(1, a) for *_, a in segments]),
        lt([anchors[a][0].shape[2] if a is not None else 0 for *_, a in segments]), d ** -0.5, out, kernel=kernel)
    rounded = kernel == "amx" or kernel == "dots" and native.bf16_dots(hq, hkv, d, fast_only=False)
    if kernel == "amx" and not native.amx(dtype, hq, hkv, d):
        assert not ran and out.isnan().all()  # refused, nothing written
        return
    assert ran
    want = torch.stack([_reference(q[start + i], buffers[b][0][r : r + 1], buffers[b][1][r : r + 1],
                                   anchors[a] if a is not None else None, offset + i)
                        for start, (n, b, r, offset, a) in zip(starts, segments) for i in range(n)])
    atol = 2e-6
    if rounded and not uniform:
        # each weight rounded to bfloat16 (8 bits: within 2^-9 of itself), their sum not: an output
        # moves by at most 2^-9 of the largest value it reads
        atol += 2.0 ** -9 * max(x[1].abs().max().item() for x in (*buffers.values(), *anchors))
    assert torch.allclose(out, want, atol=atol, rtol=1e-5), (out - want).abs().max()
    _same_bits_in_the_dtype(out, lambda o: native.prefill_attention(
        q, hkv, lt(starts), lt([a + n for a, (n, *_) in zip(starts, segments)]),
        lt([buffers[b][0].data_ptr() for _, b, *_ in segments]), lt([buffers[b][1].data_ptr() for _, b, *_ in segments]),
        lt([buffers[b][0].shape[2] for _, b, *_ in segments]), lt([r for _, _, r, *_ in segments]),
        lt([o for *_, o, _ in segments]), lt([anc(0, a) for *_, a in segments]), lt([anc(1, a) for *_, a in segments]),
        lt([anchors[a][0].shape[2] if a is not None else 0 for *_, a in segments]), d ** -0.5, o, kernel=kernel),
        dtype)


@pytest.mark.usefixtures("build")
@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (9, 3, 64), (8, 8, 32), (8, 1, 128), (12, 2, 80), (3, 1, 48)])
def test_prefill_wide_tiles_are_the_16_lane_tiles_bits(hq, hkv, d):
    """float32 prefill on its wide tile (48 lanes with AVX-512, a segment's last rows on 32 or 16)
    gives the 16-lane tile's outputs bit for bit: segments of 1 to 70 tokens (row counts on both
    sides of every multiple of 16, 32 and 48, so every width and remainder runs), fresh or continuing
    after up to 40 stored keys, under anchors of 0 to 100 keys."""
    g = torch.Generator().manual_seed(9)
    rng = random.Random(9)
    for trial in range(8):
        n_seg = rng.randint(1, 6)
        sizes = [rng.choice([1, 2, 5, 6, 11, 16, 21, 33, 47, 48, 49, 70]) for _ in range(n_seg)]
        offsets = [rng.choice([0, 0, 3, 17, 40]) for _ in range(n_seg)]
        cap = max(o + n for o, n in zip(offsets, sizes))
        own_k, own_v = (torch.randn(n_seg, hkv, cap, d, generator=g) for _ in range(2))
        lens = [rng.choice([0, 1, 15, 16, 17, 100]) for _ in range(n_seg)]
        anchors = [tuple(torch.randn(1, hkv, max(n, 1), d, generator=g) for _ in range(2)) for n in lens]
        t = sum(sizes)
        q = torch.randn(t, hq, d, generator=g)
        starts = [sum(sizes[:i]) for i in range(n_seg)]
        lt = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        args = (q, hkv, lt(starts), lt([a + n for a, n in zip(starts, sizes)]), lt([own_k.data_ptr()] * n_seg),
                lt([own_v.data_ptr()] * n_seg), lt([cap] * n_seg), lt(list(range(n_seg))), lt(offsets),
                lt([a[0].data_ptr() if n else 0 for a, n in zip(anchors, lens)]),
                lt([a[1].data_ptr() if n else 0 for a, n in zip(anchors, lens)]), lt(lens), d ** -0.5)
        wide, narrow = torch.full((t, hq, d), float("nan")), torch.full((t, hq, d), float("nan"))
        assert native.prefill_attention(*args, wide, kernel="widen")
        assert native.prefill_attention(*args, narrow, kernel="tile16")
        assert torch.equal(wide, narrow), (trial, sizes, offsets, lens, (wide - narrow).abs().max())


def test_bf16_dots_where_the_cpu_runs_them_fast():
    """The AVX-512 BF16 prefill tile is built where the CPU has AVX-512 BF16, and runs by default on
    AMD's (the Intel Xeon measured widens faster)."""
    has = native.supports(torch.bfloat16, 9, 3, 64, 64) and "avx512_bf16" in native._cpu_key().split()
    assert native.bf16_dots(9, 3, 64, fast_only=False) == has
    assert native.bf16_dots(9, 3, 64) == (has and "AuthenticAMD" in open("/proc/cpuinfo").read())


def test_prefill_kernel_follows_the_cpu():
    """bfloat16 prefill goes to AMX tiles where decode's anchors do, else to the dot products where they
    run fast, else widens."""
    for hq, hkv, d in ((9, 3, 64), (6, 2, 48)):
        want = "amx" if native.amx(torch.bfloat16, hq, hkv, d) else "dots" if native.bf16_dots(hq, hkv, d) else "widen"
        assert native.prefill_kernel(hq, hkv, d) == want
    assert native.prefill_kernel(6, 2, 48) != "amx"  # tiles of 32 elements


@needs_kernel
def test_kernel_uses_every_thread_count():
    q, own_k, own_v, args, _, want = _case(9, 3, 64, torch.float32, seed=1)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            out = torch.empty(q.shape[0], 9, 64)
            assert native.decode_attention(q, own_k, own_v, *args, 0.125, out)
            assert torch.allclose(out, want, atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_layouts_it_does_not_serve():
    assert not native.supports(torch.float16, 4, 2, 64, 64)
    assert not native.supports(torch.float32, 9, 1, 64, 64)  # 9 query heads per key head
    assert not native.supports(torch.float32, 4, 2, 72, 72)  # not a multiple of 16
    assert not native.supports(torch.float32, 4, 2, 256, 256)
    assert not native.supports(torch.float32, 4, 2, 64, 32)  # values of another size
    assert "float32 and bfloat16 only" in native.why_not(torch.float16, 4, 2, 64, 64)
    assert "9 query heads over 1 key heads" in native.why_not(torch.float32, 9, 1, 64, 64)


def _unbuildable(monkeypatch, tmp_path):
    """From now on (for this test) the kernels cannot be built: no C compiler, an empty cache, and
    nothing built or checked yet."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    _fresh_kernel_caches(monkeypatch)


def test_switched_off_and_unbuildable(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_NATIVE", "0")
    assert native.why_not(torch.float32, 4, 2, 64, 64) == "BATCHGEN_NATIVE=0"
    monkeypatch.delenv("BATCHGEN_NATIVE")
    _unbuildable(monkeypatch, tmp_path)
    assert not native.supports(torch.float32, 4, 2, 48, 48)
    assert "could not be built" in native.why_not(torch.float32, 4, 2, 48, 48)


@pytest.mark.usefixtures("build")
@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_engine_on_the_kernel(arch, monkeypatch):
    """Attention goes through the kernels, and the engine's greedy output equals plain
    generate and the engine on PyTorch's kernels. (bfloat16 through the kernel: test_engine's
    bfloat16 equivalence, whose Llama and Qwen2 layouts the kernel serves.)"""
    tok = tokenizer()
    model = make_model(arch)
    reqs = edge_case_requests(tok, max_new_tokens=6)
    calls, prefill_calls = [], []
    real, real_prefill = native.decode_attention, native.prefill_attention
    monkeypatch.setattr(native, "decode_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(native, "prefill_attention", lambda *a: prefill_calls.append(a[2].numel()) or real_prefill(*a))
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("BATCHGEN_NATIVE", flag)
        engine = Engine(model, eos_token_ids=[2], min_shared_tokens=4, max_batch_tokens=250)
        outs[flag] = {(c.key, c.sample_index): c.token_ids for c in engine.run(reqs)}
        if flag == "1":
            assert calls and max(calls) > 1  # many decoding rows in one call
            assert prefill_calls and max(prefill_calls) > 1  # many segments in one call
            assert engine.stats.cascade_batches > 0
    assert outs["1"] == outs["0"]
    for r in reqs:
        want = reference_generate(model, r, [2])
        assert all(outs["1"][(r.key, s)] == want for s in range(r.params.n)), f"{arch}: job {r.key}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_on_the_anchor_kernels(dtype, monkeypatch):
    """Heads of 32, whose bfloat16 anchors go through AMX tiles where this CPU has them: greedy
    output equals plain generate (in bfloat16, or parts from it exactly where the reference's
    own logits are tied), and equals the engine on the tile kernel the matrix products replaced."""
    from tests.helpers.reference import bf16_tie

    tok = tokenizer()
    model = make_model("llama_head32", dtype=dtype)
    reqs = edge_case_requests(tok, max_new_tokens=6)
    real = native.decode_attention
    outs = {}
    for anchors in ("matmul", "tiles"):
        rows = []
        monkeypatch.setattr(native, "decode_attention",
                            lambda *a, **kw: rows.append(a[0].shape[0]) or real(*a, anchors=anchors))
        engine = Engine(model, eos_token_ids=[2], min_shared_tokens=4, max_batch_tokens=250)
        outs[anchors] = {(c.key, c.sample_index): c.token_ids for c in engine.run(reqs)}
        assert rows and max(rows) > 1 and engine.stats.cascade_batches > 0
    equal = 0
    for r in reqs:
        want = reference_generate(model, r, [2])
        for s in range(r.params.n):
            got = outs["matmul"][(r.key, s)]
            equal += got == want
            assert got == want or (dtype == torch.bfloat16 and bf16_tie(model, r.prompt_ids, want, got)), r.key
    assert equal >= len(outs["matmul"]) * 2 // 3
    if dtype == torch.float32 or not native.amx(dtype, 4, 2, 32):  # the same float32 sums, in another order
        assert outs["matmul"] == outs["tiles"]


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "llama_head32"])
@pytest.mark.parametrize("kernel", list(native.PREFILL))
def test_engine_bfloat16_prefill_on_each_path(arch, kernel, monkeypatch):
    """bfloat16 prefill on AMX tiles and on AVX-512 BF16 dot products (where this CPU has them) and
    widened to float32, each forced: greedy output equals plain generate in bfloat16, or parts from it
    exactly where the reference's own logits are tied."""
    from tests.helpers.reference import bf16_tie

    tok = tokenizer()
    model = make_model(arch, dtype=torch.bfloat16)
    c = model.config
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if kernel == "amx" and not native.amx(torch.bfloat16, c.num_attention_heads, c.num_key_value_heads, head):
        pytest.skip("no AMX tiles for this layout here")
    reqs = edge_case_requests(tok, max_new_tokens=6)
    real, segments = native.prefill_attention, []
    monkeypatch.setattr(native, "prefill_attention",
                        lambda *a, **kw: segments.append(a[2].numel()) or real(*a, kernel=kernel))
    engine = Engine(model, eos_token_ids=[2], min_shared_tokens=4, max_batch_tokens=250)
    got = {(c.key, c.sample_index): c.token_ids for c in engine.run(reqs)}
    assert len(segments) > 2 and max(segments) > 1 and engine.stats.cascade_batches > 0  # the engine's calls
    equal = 0
    for r in reqs:
        want = reference_generate(model, r, [2])
        for s in range(r.params.n):
            equal += got[(r.key, s)] == want
            assert got[(r.key, s)] == want or bf16_tie(model, r.prompt_ids, want, got[(r.key, s)]), r.key
    assert equal >= len(got) * 2 // 3


@needs_kernel
def test_the_summary_says_which_kernels_ran(tmp_path, model_dir, monkeypatch):
    """`attention_kernels` in OUTPUT.summary.json: the compiled kernels where they serve the model
    (the tiny Llama: head size 16, 2 query heads per key head), PyTorch's when switched off."""
    import json

    from tests.helpers.cli_helpers import run, write_jsonl

    src = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": f"One shared system prompt here. Question {i}"}
                                                for i in range(4)])
    for flag, want in (("1", "compiled"), ("0", "pytorch")):
        monkeypatch.setenv("BATCHGEN_NATIVE", flag)
        out = tmp_path / f"out{flag}.parquet"
        run(["process", str(src), "-o", str(out), "--max-new-tokens", "3"], model_dir)
        summary = json.loads((tmp_path / f"out{flag}.parquet.summary.json").read_text())
        assert summary["attention_kernels"] == want and summary["kernels_build_error"] is None


def test_a_run_says_when_the_kernels_could_not_be_built(tmp_path, model_dir, monkeypatch):
    """Without a C compiler (a slim container) a run still completes, on PyTorch's kernels, and says
    why it ran slower: in its summary (`kernels_build_error`) and in a note on stderr."""
    import json

    from tests.helpers.cli_helpers import run, write_jsonl

    _unbuildable(monkeypatch, tmp_path)
    src = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": f"One shared system prompt. Question {i}"}
                                                for i in range(3)])
    result = run(["process", str(src), "-o", str(tmp_path / "out.parquet"), "--max-new-tokens", "3"], model_dir)
    summary = json.loads((tmp_path / "out.parquet.summary.json").read_text())
    assert summary["completed"] == 3 and summary["attention_kernels"] == "pytorch"
    assert "no-such-compiler" in summary["kernels_build_error"]
    assert "the compiled CPU kernels could not be built" in result.output and "no-such-compiler" in result.output


@pytest.mark.parametrize("march", ["skylake-avx512", "cascadelake", "sapphirerapids", "x86-64-v3", "x86-64-v2"])
def test_builds_for_other_cpus(march, tmp_path):
    """The library compiles for the x86 CPUs batchgen meets, whatever this one is: AVX-512 without
    BF16 or AMX (Skylake-X, Cascade Lake: their build once failed, and attention fell back to
    PyTorch's kernels there), with AMX, AVX2 (its own tiles of 8 lanes), and without AVX2 (entry
    points that refuse)."""
    import shutil
    import subprocess

    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or platform.machine() != "x86_64":
        pytest.skip("no C compiler for x86-64 here")
    if subprocess.run([compiler, f"-march={march}", "-x", "c", "-c", "-o", os.devnull, "-"], input=b"",
                      capture_output=True).returncode:
        pytest.skip(f"this compiler does not know -march={march}")
    flags = flags_for(march)
    done = subprocess.run([compiler, *flags, "-fopenmp", "-DBATCHGEN_G=3", "-DBATCHGEN_D=64", "-o",
                           str(tmp_path / "lib.so"), str(native.SOURCE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_source_the_build_reads_is_in_the_package():
    """The build compiles SOURCE, which #includes the rest: every file it includes is in INCLUDED
    (the cache key: a change to any of them builds anew) and in the wheel's package data. A wheel
    once held only two of the six sources, and an installed batchgen fell back to PyTorch's kernels."""
    import fnmatch
    import tomllib

    def includes(path):
        found = []
        for name in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M):
            found += [name, *includes(path.with_name(name))]
        return found

    assert sorted(includes(native_build.SOURCE)) == sorted(p.name for p in native_build.INCLUDED)
    root = native_build.SOURCE.parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["batchgen.pipeline.model"]
    for path in [native_build.SOURCE, *native_build.INCLUDED]:
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in data), path.name
