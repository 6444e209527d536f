"""batchgen's own forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3), on a CPU.

Why it exists (the measurements are in BENCHMARKS.md):
- a process that loads transformers' model classes spends seconds importing them (their import
  graph pulls in `torch.distributed.tensor`, sympy, `torch._dynamo` and scipy) and in
  `from_pretrained`; this one reads `config.json` and the safetensors files itself;
- transformers' model code runs op by op through module calls, masks and hooks: a large share of
  a decode step beside the weight matmuls and attention. Here a layer is one fused
  query/key/value GEMM, rotary embeddings for queries and keys in one pass over a per-position
  table, batchgen's attention (`attention.attend`), the SiLU MLP; the linear layers run on
  weights packed once, in float32 for batchgen's GEMM (`native.Gemm`, on AVX-512 CPUs: faster at
  decode's row counts), else for oneDNN (`kernels.linear`); each norm, with the residual sum before it,
  the MLP's gate and the rotary embeddings are one pass each (`native.LayerOps`: PyTorch's ops to the
  bit) where PyTorch runs several.
  After the last layer's attention, whose keys and values later tokens read, nothing but the
  logits is wanted: its output projection and MLP run on the kept tokens' rows alone (none while
  a shared prefix is prefilled).

Which models it takes is `batchgen.pipeline.model.decoder_config`'s decision (everything the forward depends on
stated in the model's files); every other model, every other device, and `BATCHGEN_DECODER=0`
run transformers' model code, which stays the reference: the tests compare the two.
The arithmetic follows transformers' modules operation by operation (RMSNorm in float32 then
cast, rotary tables in float32 then cast), so outputs agree to float rounding.
"""
from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from batchgen.pipeline.model import attention

from batchgen.pipeline.model import kernels, native

from batchgen.pipeline.model import lora, rope
from batchgen.pipeline.model.adapter_files import AdapterInfo
from batchgen.pipeline.model.decoder_config import FLOAT_DTYPES, DecoderConfig, header
from batchgen.pipeline.model.forward import eos_list
from batchgen.pipeline.model.kv import LayerShape
from batchgen.pipeline.model.step import Step

Linear = Callable[[torch.Tensor], torch.Tensor]


def enabled() -> bool:
    """`BATCHGEN_DECODER=0` runs transformers' model code for every model (the reference path)."""
    return os.environ.get("BATCHGEN_DECODER", "1") != "0"


@dataclass
class Layer:
    input_norm: torch.Tensor  # (H,)
    qkv: Linear  # (T, H) -> (T, (Hq + 2 Hkv) D)
    o: Linear  # (T, Hq D) -> (T, H)
    post_norm: torch.Tensor  # (H,)
    # gate and up stay two weights (on oneDNN fused they were no faster, and its scratch for the
    # fused one held more memory at long steps); batchgen's GEMM runs them as one pass, `glu`
    gate: Linear  # (T, H) -> (T, I)
    up: Linear  # (T, H) -> (T, I)
    down: Linear  # (T, I) -> (T, H)
    q_norm: torch.Tensor | None = None  # (D,) Qwen3
    k_norm: torch.Tensor | None = None
    glu: Linear | None = None  # (T, H) -> (T, I): silu(gate) * up in one pass (`native.Gemm.glu`), or None


class Decoder:
    """A loaded model, as a `batchgen.pipeline.model.forward.Forward`: `forward(step, keep)` gives the
    logits of the step's tokens at `keep`. Its `config` reads as a transformers model's does."""

    model_code = "batchgen"
    decoder_declined = None

    def __init__(self, config: DecoderConfig, device: torch.device, dtype: torch.dtype,
                 packed: dict[str, torch.Tensor] | None = None) -> None:
        """`packed`: linear layers' weights packed for batchgen's GEMM already, by key of
        `config.linears()` (`batchgen.pipeline.model.prepack`); used where that GEMM runs them."""
        self.config = config
        self.device, self.dtype = device, dtype
        self.eos_token_ids = eos_list(config.eos_token_id)
        c = config
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        weights = _read(c, device, dtype)
        self.embed = weights.pop("model.embed_tokens.weight")  # (V, H)
        self.norm = weights.pop("model.norm.weight")
        # float32 on an AVX-512 CPU: batchgen's GEMM (`native.Gemm`), else oneDNN's on packed weights
        self._gemm = native.gemm(dtype, self.hq, self.hkv, self.d) if device.type == "cpu" else None
        self.linear: Callable[..., Linear] = self._gemm.linear if self._gemm is not None else kernels.linear
        self._packed = dict(packed or {}) if self._gemm is not None else {}
        self.prepacked = len(self._packed)  # layers taken packed (the tests read it)
        # (`Forward.packed_weights`; `load_model` says "cache" or "ahead" for layers it hands over)
        self.packed_weights = None if self._gemm is None else "ahead" if self._packed else "load"
        self._linears = {key: (names, bias) for key, names, bias in c.linears()}
        weights["model.embed_tokens.weight"] = self.embed  # the tied head's weight
        # the norms, the MLP's gate and the rotary embeddings in one pass each (None: PyTorch's ops, the reference)
        self.ops = native.layer_ops(dtype, self.hq, self.hkv, self.d, c.hidden_size, c.intermediate_size) \
            if device.type == "cpu" else None
        self.lm_head = self._proj(weights, "lm_head")
        self.layers = [self._layer(weights, f"model.layers.{i}.") for i in range(c.num_hidden_layers)]
        self._cos = self._sin = torch.empty(0, self.d, dtype=dtype, device=device)
        self.adapters: lora.Adapters | None = None  # `set_adapters`
        if device.type == "cpu":
            kernels.keep_freed_memory()  # activations reuse memory instead of faulting in fresh pages

    def _layer(self, weights: dict[str, torch.Tensor], p: str) -> Layer:
        """Layer `p` out of the checkpoint's tensors (taken from `weights`, so each goes once used)."""
        gate, up = self._proj(weights, p + "gate"), self._proj(weights, p + "up")
        glu = self._gemm.glu(gate, up, self.ops) if self._gemm is not None and self.ops is not None else None
        return Layer(input_norm=weights.pop(p + "input_layernorm.weight"), qkv=self._proj(weights, p + "qkv"),
                     o=self._proj(weights, p + "o"), post_norm=weights.pop(p + "post_attention_layernorm.weight"),
                     gate=gate, up=up, down=self._proj(weights, p + "down"),
                     q_norm=weights.pop(p + "self_attn.q_norm.weight", None),
                     k_norm=weights.pop(p + "self_attn.k_norm.weight", None), glu=glu)

    def _proj(self, weights: dict[str, torch.Tensor], key: str) -> Linear:
        """The linear layer `key` of `config.linears()`: its weights (stacked by output) and biases
        taken from `weights`, packed here unless they came packed."""
        names, has_bias = self._linears[key]
        parts = [weights.pop(n) for n in names]
        biases = [weights.pop(n.removesuffix("weight") + "bias") for n in names] if has_bias else []
        bias = torch.cat(biases) if biases else None
        if key in self._packed:
            return self._gemm.packed(self._packed.pop(key), sum(w.shape[0] for w in parts), parts[0].shape[1], bias)
        if self._gemm is not None:  # packed from the parts where they are, no concatenated copy
            return self._gemm.linear(parts, bias)
        return _fused(parts, bias, self.linear)

    def layer_shapes(self) -> list[LayerShape]:
        return [LayerShape(self.hkv, self.d, self.d)] * self.config.num_hidden_layers

    def set_adapters(self, infos: list[AdapterInfo]) -> None:
        """Load these LoRA adapters as indices 1..len(infos) (`Decode.adapter`, `Segment.adapter`),
        replacing any set before; index 0 is the base model."""
        self.adapters = lora.Adapters(infos, self.config, lora.DECODER_GROUPS, self.device, self.dtype)

    def forward(self, step: Step, keep: list[int] | torch.Tensor) -> torch.Tensor:
        """The step's flat tokens through every layer; logits (N, V) at the token indices `keep`."""
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device)
        ids, pos = step.input_ids[0], step.positions[0]  # (T,), (T,)
        t, hq, hkv, d = ids.shape[0], self.hq, self.hkv, self.d
        cos, sin = self._rope(pos)  # (T, 1, D) each; sin with the first half negated
        windows = self.config.layer_windows
        x = F.embedding(ids, self.embed)  # (T, H)
        # per adapter present, its tokens: every projection adds their updates (None: no adapter work)
        ad = self.adapters.plan(lora.check(self.adapters, step.lora)) if step.lora else None
        last = len(self.layers) - 1
        added = None  # the last sublayer's output, still to be added to x (with the next norm)
        for i, layer in enumerate(self.layers):
            h = self._add_norm(x, added, layer.input_norm)
            qkv = layer.qkv(h)  # (T, (Hq + 2 Hkv) D)
            if ad is not None:
                self.adapters.apply(i, "qkv", h, qkv, ad)
            qkv = qkv.view(t, hq + 2 * hkv, d)
            q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]  # (T, H*, D) views
            if layer.q_norm is not None:
                q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
                self._rotate(q, cos, sin)
                self._rotate(k, cos, sin)
            else:  # queries and keys sit side by side: one pass rotates both, in qkv
                self._rotate(qkv[:, : hq + hkv], cos, sin)
            out = attention.attend(step, i, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                   self.scale, windows[i])  # (T, Hq, D) float32
            out = out.to(self.dtype).view(t, hq * d)
            if i == last and ad is None:  # past the last attention (its keys stored) only kept rows are read
                if not keep.numel():
                    break
                out, x = out.index_select(0, keep), x.index_select(0, keep)  # (N, Hq D), (N, H)
            o = layer.o(out)  # (T, H), or (N, H) in the last layer
            if ad is not None:
                self.adapters.apply(i, "o", out, o, ad)
            h = self._add_norm(x, o, layer.post_norm)  # x += o: x is this forward's own buffer
            if ad is None:
                mid = layer.glu(h) if layer.glu is not None else self._gate(layer.gate(h), layer.up(h))  # (T, I)
                added = layer.down(mid)
                continue
            gate, up = layer.gate(h), layer.up(h)  # (T, I) each
            self.adapters.apply(i, "gate", h, gate, ad)
            self.adapters.apply(i, "up", h, up, ad)
            mid = self._gate(gate, up)
            added = layer.down(mid)  # (T, H)
            self.adapters.apply(i, "down", mid, added, ad)
        if not keep.numel():  # a prefix being prefilled: no logits wanted
            return x.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        if ad is not None:  # with adapters every token ran the last layer (their plans index all T)
            x, added = x.index_select(0, keep), added.index_select(0, keep)
        x = self._add_norm(x, added, self.norm)  # (N, H): the norm is per token
        return self.lm_head(x).float()  # (N, V)

    def _add_norm(self, x: torch.Tensor, added: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """x += added (in place, where given), then the norm of x: one pass (`native.LayerOps`),
        else PyTorch's ops."""
        if self.ops is not None:
            return self.ops.add_rms_norm(x, added, weight, self.config.rms_norm_eps)
        if added is not None:
            x += added
        return self._norm(x, weight)

    def _gate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, into gate's buffer (the gate GEMM's own output)."""
        if self.ops is not None:
            return self.ops.silu_mul(gate, up)
        return F.silu(gate, inplace=True).mul_(up)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if self.ops is not None:
            self.ops.rotate(x, cos, sin)
        else:
            _rotate_(x, cos, sin)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm: in float32, cast back, then scaled; the same operations, in
        place where a buffer is this call's own (the weight's product commutes)."""
        xf = x.float()
        sq = xf.pow(2)
        rs = sq.mean(-1, keepdim=True).add_(self.config.rms_norm_eps).rsqrt_()
        if x.dtype == torch.float32:  # xf is x, never written: the squares' buffer takes the product
            return torch.mul(xf, rs, out=sq).mul_(weight)
        return xf.mul_(rs).to(x.dtype).mul_(weight)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (T, 1, D) at these positions, from a table grown on demand and
        computed as transformers computes it (its float32 frequencies, `rope.inv_freq`, and scale
        factor, then cast)."""
        need = int(pos.max()) + 1 if pos.numel() else 0
        if need > self._cos.shape[0]:
            n = max(need, 2 * self._cos.shape[0], 256)
            d, c = self.d, self.config
            inv_freq, scale = rope.inv_freq(c.rope_parameters, c.hidden_size, c.num_attention_heads, d,
                                            c.max_position_embeddings)
            freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * inv_freq.float()[None, :]  # (n, D/2)
            emb = torch.cat((freqs, freqs), dim=-1)
            # (on the calling thread: a worker thread's first cos in a process can come out inaccurate)
            sin = kernels.on_this_thread(torch.sin, emb) * scale
            sin[:, : d // 2].neg_()  # rotate_half(x) * sin == roll(x, D/2) * (sin, first half negated)
            cos = kernels.on_this_thread(torch.cos, emb) * scale
            self._cos, self._sin = cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)
        return self._cos[pos][:, None], self._sin[pos][:, None]


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x = transformers' `x * cos + rotate_half(x) * sin` in place, x (T, H, D): the same products
    and sum. `sin` has its first half negated, so rotate_half(x) * sin is x's halves swapped times
    it, written by two products into one buffer (no rolled copy of x)."""
    half = x.shape[-1] // 2
    turned = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x[..., half:], sin[..., :half], out=turned[..., :half])
    torch.mul(x[..., :half], sin[..., half:], out=turned[..., half:])
    x.mul_(cos).add_(turned)


def _fused(weights: list[torch.Tensor], bias: torch.Tensor | None, linear: Callable[..., Linear]) -> Linear:
    """Linear layers that read the same input as one GEMM (their weights stacked by output), made by
    `linear(weight, bias)`. The weights may be views of the checkpoint's memory map: what is kept
    is always a copy (both packers copy)."""
    w = torch.cat(weights) if len(weights) > 1 else weights[0]
    if w is weights[0] and linear is kernels.linear and not kernels.packs(w.device, w.dtype):
        w = w.clone()
    return linear(w, bias)


_DTYPES = dict(zip(FLOAT_DTYPES, (torch.float32, torch.bfloat16, torch.float16, torch.float64)))


def _read(config: DecoderConfig, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors the forward reads, in `dtype` on `device`. The files are memory-
    mapped: a linear layer's weight in the checkpoint's dtype is a view of the map, which its packed
    copy replaces, so loading never holds a second copy of every weight (transformers' loader maps
    the files too); so is the embedding, which nothing writes; every other tensor is copied out.
    The map goes once the views do."""
    want, out = config.tensor_names(), {}
    for path in config.files:
        data, tensors = header(path)
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        for name in want & tensors.keys():
            meta = tensors[name]
            kind = _DTYPES.get(meta["dtype"])
            if kind is None:
                raise OSError(f"{path}: tensor {name} is {meta['dtype']}, not a floating-point type")
            start, end = meta["data_offsets"]
            if not 0 <= start <= end <= len(mm) - data:
                raise OSError(f"{path}: tensor {name} lies at bytes {start}-{end} of the data, "
                              f"past the file's end ({len(mm) - data} bytes of data)")
            with warnings.catch_warnings():  # a read-only map: nothing here writes to it
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(mm, dtype=kind, count=(end - start) // kind.itemsize, offset=data + start)
            t = t.view(meta["shape"])
            # read only: the linear layers' weights (their packed copies replace them) and the
            # embedding (its rows are only read; a copy of it was most of the loading's page faults)
            view_ok = name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")
            out[name] = t.to(device=device, dtype=dtype, copy=not view_ok)
    return out
