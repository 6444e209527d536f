"""batchgen's attention: packed tokens, shared prefixes read once, merged exactly.

Both model codes call `attend` per layer: batchgen's own decoder (`batchgen.pipeline.model.decoder`) directly,
transformers' model code through the attention function `batchgen.pipeline.model.hf` registers.

Per layer, for the forward's flat list of tokens:
1. the new keys/values are written into their buffers (row slots or a prefix being prefilled);
2. own part: each token against its own sequence's keys: decode tokens batched over the slots
   (in runs of 16 slots, each reading only as far as its longest row), fresh suffixes right-
   padded side by side in a few causal calls, later chunks of long suffixes one call each;
3. anchor part: for each cached prefix the forward reads, one call for all the tokens that
   continue it (queries folded per key head), the prefix's keys read once;
4. the two partial softmaxes merged exactly by their log-sum-exps, as in vLLM's cascade
   attention, FlashInfer and Hydragen.
On a CPU, where batchgen's compiled kernels serve the layout (`batchgen.pipeline.model.native`), 2-4 are two
calls instead: one for the decode tokens and one for every run of prefill tokens, each token
reading its anchor and its own keys in one pass, final. The PyTorch path stays the reference for
every other device and layout (the tests run both).
Each call goes to PyTorch's fused attention kernel, which also returns the log-sum-exp, where a
probe found it agrees with the matmul reference (`partial`) for this device, dtype and head
size; soft-capped models (Gemma2) and refused shapes use the reference.
"""
from __future__ import annotations

import torch

from batchgen.pipeline.model import native
from batchgen.pipeline.model.step import Step


def attend(step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           sliding_window: int | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's attention for the step's flat tokens: q (Hq, T, D), k/v (Hkv, T, D) (views are
    fine); the new keys/values are stored first. Returns (T, Hq, Dv) in float32, or from the
    compiled kernels in q's dtype (bfloat16 rounded there as `.to` rounds, saving the cast's pass).
    `sinks` (Hq,): attention sinks (gpt-oss), one more logit per head in every softmax, with no
    value: merged once, after the own and anchor parts, from their joint log-sum-exp."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    fold = hq // hkv
    step.store(layer, k, v)

    if step.native is not None and sliding_window is None and softcap is None and sinks is None \
            and native_ok(q.dtype, hq, hkv, d, v.shape[-1]):
        out = q.new_empty(t, hq, v.shape[-1])  # (T, Hq, Dv), q's dtype
        if _native(step, layer, q, hkv, scale, out):
            step.kernel_layers[0] += 1
            return out
    step.kernel_layers[1] += 1
    out = q.new_empty(t, hq, v.shape[-1], dtype=torch.float32)
    lse = q.new_empty(t, hq, dtype=torch.float32)
    if step.n_dec:  # one token per decoding slot, against the slots' own keys, in runs of slots
        n = step.n_dec
        qd = q[:, :n].transpose(0, 1)  # (n, Hq, D)
        if not step.contiguous:  # idle slots between decoding ones: give them a query, drop their output
            qd = q.new_zeros(step.hi, hq, d).index_copy_(0, step.dec_slots, qd)
        # the G query heads of a key head as G queries of it: each key is read once, not G times
        qd = qd.reshape(-1, hkv, fold, d)  # (hi, Hkv, G, D)
        mask = step.own_mask(sliding_window, q.dtype)  # (hi, 1, 1, L)
        od = q.new_empty(step.hi, hkv, fold, v.shape[-1], dtype=torch.float32)
        ld = q.new_empty(step.hi, hkv, fold, dtype=torch.float32)
        for a, b, span in step.dec_runs:  # each run reads only as far as its longest row
            keys, values = step.kv.k[layer][a:b, :, :span], step.kv.v[layer][a:b, :, :span]
            od[a:b], ld[a:b] = _attend(qd[a:b], keys, values, mask[a:b, ..., :span], scale, softcap, decode=True)
        od, ld = od.view(step.hi, hq, -1), ld.view(step.hi, hq)
        if not step.contiguous:
            od, ld = od[step.dec_slots], ld[step.dec_slots]
        out[:n], lse[:n] = od[:n], ld[:n]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (T, H, D)
    for i, b in enumerate(step.batches):  # fresh suffixes side by side, right-padded, causal
        rows, length = b.gather.shape
        flat = b.gather.flatten()
        qb, kb, vb = (x.index_select(0, flat).view(rows, length, x.shape[1], -1).transpose(1, 2) for x in (qt, kt, vt))
        mask = step.batch_mask(i, sliding_window, q.dtype)
        o, l = _attend(qb, kb, vb, mask, scale, softcap, causal=mask is None)  # (rows, Hq, L, Dv), (rows, Hq, L)
        out.index_copy_(0, b.tokens, o.transpose(1, 2).reshape(rows * length, hq, -1).index_select(0, b.real).float())
        lse.index_copy_(0, b.tokens, l.transpose(1, 2).reshape(rows * length, hq).index_select(0, b.real))
    for i, s in enumerate(step.continuing):  # a continuing run of one sequence, causal over its own keys
        end = s.offset + s.t1 - s.t0
        keys, values = s.k[layer][s.index, :, :end][None], s.v[layer][s.index, :, :end][None]
        mask = step.segment_mask(i, sliding_window, q.dtype)
        o, l = _attend(q[None, :, s.t0 : s.t1], keys, values, mask, scale, softcap, causal=mask is None)
        out[s.t0 : s.t1], lse[s.t0 : s.t1] = o[0].transpose(0, 1), l[0].transpose(0, 1)
    for i, g in enumerate(step.groups):  # every token continuing one cached prefix, in one call
        n = g.positions.shape[0]
        # (1, Hkv, G*n, D): the G query heads of a key head side by side, so the prefix is read once per key head
        qg = (q[:, g.index] if isinstance(g.index, slice) else q.index_select(1, g.index)).reshape(1, hkv, fold * n, d)
        mask, blind = step.group_mask(i, sliding_window, q.dtype, fold) or (None, None)
        o, l = _attend(qg, g.prefix.k[layer], g.prefix.v[layer], mask, scale, softcap)
        o = o.reshape(hq, n, -1).transpose(0, 1).float()  # (n, Hq, Dv)
        l = l.reshape(hq, n).transpose(0, 1)  # (n, Hq)
        if blind is not None:  # queries whose window left the whole prefix behind: no share, and 0/0 outputs
            l = l.masked_fill(blind[:, None], float("-inf"))
            o = o.nan_to_num(0.0)
        w = torch.sigmoid(l - lse[g.index])[..., None]  # = e^l / (e^l + e^lse): the prefix's share of the softmax
        if isinstance(g.index, slice):
            out[g.index].lerp_(o, w)
        else:
            out.index_copy_(0, g.index, out.index_select(0, g.index).lerp_(o, w))
        if sinks is not None:  # the joint log-sum-exp of the own and anchor parts, which the sink joins
            both = torch.logaddexp(lse[g.index], l)
            if isinstance(g.index, slice):
                lse[g.index] = both
            else:
                lse.index_copy_(0, g.index, both)
    if sinks is not None:  # a sink's share e^s / (e^s + e^lse) of each softmax goes to no value
        out.mul_(torch.sigmoid(lse - sinks.float()[None, :])[..., None])
    return out


def _native(step: Step, layer: int, q: torch.Tensor, hkv: int, scale: float, out: torch.Tensor) -> bool:
    """The whole layer through the compiled kernels: decode tokens, then every segment; each token
    against its anchor and its own keys in one pass, final. False if a kernel could not run."""
    nat, qt = step.native, q.transpose(0, 1)  # (T, Hq, D)
    if step.n_dec and not native.decode_attention(
            qt[: step.n_dec], step.kv.k[layer], step.kv.v[layer], nat.slot, nat.own_len, nat.anc_k[layer],
            nat.anc_v[layer], nat.anc_len, scale, out[: step.n_dec]):
        return False
    return not step.segments or native.prefill_attention(
        qt, hkv, nat.t0, nat.t1, nat.own_k[layer], nat.own_v[layer], nat.own_cap, nat.own_index, nat.offset,
        nat.seg_anc_k[layer], nat.seg_anc_v[layer], nat.seg_anc_len, scale, out)


def _attend(q, k, v, mask, scale, softcap, causal=False, decode=False):
    """q (B, Hq, Q, D) over k/v (B, Hkv, L, D), Hq a multiple of Hkv: (output, log-sum-exp (B, Hq, Q) float32).
    `decode`: one token per row (its query heads folded as Q)."""
    if q.device.type == "cpu" and q.dtype != torch.float32 and decode:
        # one query per row (decode) in half precision: PyTorch's CPU flash kernel takes several
        # times longer than the float32 one on this shape; half-precision matmuls (AVX-512 BF16) read the keys at
        # half the bytes, as Hugging Face's eager attention computes it
        return partial(q, k, v, mask, scale, softcap, matmul_dtype=q.dtype)
    if softcap is None and fused_ok(q.device, q.dtype, q.shape[-1]):
        try:
            return _fused(q, k, v, mask, scale, causal)
        except torch.OutOfMemoryError:
            raise  # the engine splits the work
        except RuntimeError:  # a shape the kernel refuses: the reference from now on
            _FUSED_OK[(q.device.type, q.dtype, q.shape[-1])] = False
    if causal:
        mask = causal_mask(q.shape[-2], k.shape[-2], q.dtype, q.device)
    return partial(q, k, v, mask, scale, softcap)


def causal_mask(qn: int, kn: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, 1, Q, K) additive: query i sees keys up to kn - qn + i (the queries are the last keys)."""
    hidden = torch.ones(qn, kn, dtype=torch.bool, device=device).tril(kn - qn).logical_not()
    return torch.zeros(qn, kn, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))[None, None]


def partial(q, k, v, mask, scale, softcap=None, matmul_dtype=torch.float32):
    """Reference attention: (normalized output, log-sum-exp), softmax in float32 (matmuls in
    `matmul_dtype`). Query heads are grouped over their key head, so keys are never copied per
    query head."""
    b, hq, qn, d = q.shape
    hkv = k.shape[1]
    qg = q.to(matmul_dtype).reshape(b, hkv, hq // hkv * qn, d)
    scores = torch.matmul(qg, k.to(matmul_dtype).transpose(-1, -2)).float() * scale  # (B, Hkv, G*Q, L)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, hkv, hq // hkv, qn, -1)
    if mask is not None:
        scores = scores + mask.float()[:, :, None]  # (B|1, 1, 1, Q|1, L)
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    s = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p.view(b, hkv, -1, scores.shape[-1]).to(matmul_dtype), v.to(matmul_dtype)).float()
    o = o.view(b, hkv, hq // hkv, qn, -1) / s
    return o.reshape(b, hq, qn, -1), (m + s.log()).reshape(b, hq, qn)


def _fused(q, k, v, mask, scale, causal):
    """PyTorch's fused kernels, which return the log-sum-exp too. On CPU the flash kernel takes
    grouped query heads and a broadcast mask as they are; the CUDA kernels get the key heads repeated."""
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return o, lse.float()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if mask is not None:
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, 0.0, causal, scale=scale)[:2]
    return o, lse[..., : q.shape[2]].float()  # the CUDA kernel pads the query dim of its LSE


_FUSED_OK: dict[tuple[str, torch.dtype, int], bool] = {}


def fused_ok(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Check the fused kernel once per device type, dtype and head size against the reference,
    with grouped heads, a mask and causality; else use matmuls. The fused ops are private ATen ops
    whose signatures may move between torch releases, and GPU kernels have shape limits: a kernel
    that is missing or disagrees costs speed, never correctness."""
    key = (device.type, dtype, head_dim)
    if key not in _FUSED_OK:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, h, n, head_dim, generator=g).to(device, dtype) for h, n in ((6, 37), (2, 301), (2, 301)))
        mask = torch.zeros(2, 1, 1, 301, dtype=dtype)
        mask[1, ..., 150:] = float("-inf")
        mask = mask.to(device)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        try:
            ok = True
            for m, causal, kk, vv in ((None, False, k, v), (mask, False, k, v), (None, True, k[:, :, :37], v[:, :, :37])):
                o, lse = _fused(q, kk, vv, m, head_dim ** -0.5, causal)
                if causal:
                    m = causal_mask(37, 37, dtype, device)
                ro, rlse = partial(q, kk, vv, m, head_dim ** -0.5)
                ok &= bool(torch.allclose(o.float(), ro, atol=tol) and torch.allclose(lse, rlse, atol=tol))
            _FUSED_OK[key] = ok
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            _FUSED_OK[key] = False
    return _FUSED_OK[key]


_NATIVE_OK: dict[tuple, bool] = {}


def native_ok(dtype: torch.dtype, hq: int, hkv: int, d: int, dv: int) -> bool:
    """Whether the compiled kernels (`batchgen.pipeline.model.native`) serve this dtype and head layout: built, and
    agreeing once with the reference, token by token, on decode rows and on fresh and continuing
    runs, with and without an anchor."""
    if not native.supports(dtype, hq, hkv, d, dv):
        return False
    key = (dtype, hq, hkv, d, dv)
    if key not in _NATIVE_OK:
        g = torch.Generator().manual_seed(0)
        own_k, own_v = (torch.randn(3, hkv, 50, d, generator=g).to(dtype) for _ in range(2))
        anc_k, anc_v = (torch.randn(1, hkv, 70, d, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(31, hq, d, generator=g).to(dtype)
        out = torch.full((31, hq, d), float("nan"))
        lt = lambda *xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        # decode: tokens 0-2 (slot, own keys, anchored); prefill: tokens 3-19 fresh in slot 0, no
        # anchor; 20-30 continuing slot 1 after 4 own keys, anchored
        rows = [(2, 5, 1), (0, 50, 0), (1, 1, 1)]
        ak, av = lt(*(anc_k.data_ptr() * a for *_, a in rows)), lt(*(anc_v.data_ptr() * a for *_, a in rows))
        ok = native.decode_attention(q[:3], own_k, own_v, lt(*(r[0] for r in rows)), lt(*(r[1] for r in rows)),
                                     ak, av, lt(*(70 * a for *_, a in rows)), d ** -0.5, out[:3])
        ok = ok and native.prefill_attention(
            q, hkv, lt(3, 20), lt(20, 31), lt(own_k.data_ptr(), own_k.data_ptr()), lt(own_v.data_ptr(), own_v.data_ptr()),
            lt(50, 50), lt(0, 1), lt(0, 4), lt(0, anc_k.data_ptr()), lt(0, anc_v.data_ptr()), lt(0, 70), d ** -0.5, out)
        want = [(slot, n - 1, a) for slot, n, a in rows] + [(0, i, 0) for i in range(17)] + [(1, 4 + i, 1) for i in range(11)]
        for i, (slot, last, anchored) in enumerate(want):  # token i sees its own keys 0..last
            keys, values = own_k[slot : slot + 1, :, : last + 1], own_v[slot : slot + 1, :, : last + 1]
            if anchored:
                keys, values = torch.cat([anc_k, keys], dim=2), torch.cat([anc_v, values], dim=2)
            ref, _ = partial(q[i][None, :, None], keys, values, None, d ** -0.5)
            ok = ok and bool(torch.allclose(out[i], ref[0, :, 0], atol=1e-4 if dtype == torch.float32 else 2e-2))
        _NATIVE_OK[key] = ok
    return _NATIVE_OK[key]
