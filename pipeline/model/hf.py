"""transformers' model code behind the engine's forward (`batchgen.pipeline.model.forward.Forward`).

The one module that touches transformers' model and attention APIs, which churn between releases.
batchgen registers its attention (`interface`, which calls `batchgen.pipeline.model.attention.attend`) in transformers'
attention registry (imported only then: a process that runs batchgen's own decoder never imports
transformers' model code) and, for its own forwards only, selects it and passes the forward's
layout (`batchgen.pipeline.model.step.Step`) as a keyword argument, which transformers forwards to every
attention call. The model runs with `use_cache=False`: the keys and values live in batchgen's
buffers (`batchgen.pipeline.model.kv`), written by that attention function.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch

from batchgen.pipeline.model import attention, hf_support, kernels, lora, runnable
from batchgen.pipeline.model.adapter_files import AdapterError, AdapterInfo
from batchgen.pipeline.model.forward import EngineError, Forward, eos_list
from batchgen.pipeline.model.kv import LayerShape
from batchgen.pipeline.model.step import Step

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAME = "batchgen"
KWARG = "batchgen_step"


class HFModel:
    """A transformers causal LM, for inference, as a `Forward`: `forward(step, keep)` runs it on a
    step's flat tokens through batchgen's attention. On a CPU its plain linear layers call oneDNN
    for these forwards (`kernels.fast_linears`); the model's own forward is left as it was."""

    model_code = "transformers"

    def __init__(self, model: PreTrainedModel) -> None:
        # a model passed in memory: the allow-list `load_model` applies (less the keys of a config.json
        # file its class does not declare: a config built in memory has none); its class transformers' own
        why = runnable.problem(model.config, files=False) or hf_support.foreign(model)
        if why:
            raise EngineError(f"{type(model).__name__}: {why}")
        self.model = model.eval()  # inference: no dropout
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.config = model.config
        self.eos_token_ids = eos_list(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
        self.decoder_declined = getattr(model, "batchgen_decoder_declined", None)  # set by `load_model`
        self.packed_weights = None
        # float32 on CPU: oneDNN's GEMM, not MKL's (batchgen's decoder packs its own)
        self.linears = kernels.fast_linears(model)
        if self.device.type == "cpu":
            kernels.keep_freed_memory()  # activations reuse memory instead of faulting in fresh pages
        self.adapters: lora.Adapters | None = None  # `set_adapters`
        self._keep: tuple[list[int] | None, torch.Tensor | None] = (None, None)  # the last forward's, on the device
        self._targets: list[tuple[int, str, torch.nn.Module]] = []  # (layer, projection, its module)

    def layer_shapes(self) -> list[LayerShape]:
        shapes = getattr(self.model, "batchgen_layer_shapes", None)  # probed at load (`load._probe`)
        return shapes if shapes is not None else layer_shapes(self.model)

    def set_adapters(self, infos: list[AdapterInfo]) -> None:
        """Load these LoRA adapters as indices 1..len(infos) (`Decode.adapter`, `Segment.adapter`),
        replacing any set before; index 0 is the base model. The model's modules stay as they are:
        only forwards whose step has adapter tokens hook their projections (`_lora_hooks`)."""
        adapters = lora.Adapters(infos, self.config, lora.SINGLE_GROUPS, self.device, self.dtype)
        targets = []
        for layer, groups in enumerate(adapters.stacks):
            for proj, stack in groups.items():
                if stack is not None:
                    name = f"model.layers.{layer}.{'self_attn' if proj[0] in 'qkvo' else 'mlp'}.{proj}"
                    try:
                        targets.append((layer, proj, self.model.get_submodule(name)))
                    except AttributeError as e:
                        raise AdapterError(f"adapter {infos[stack.users[0] - 1].path}: the model "
                                           f"{type(self.model).__name__} has no module {name}") from e
        self.adapters, self._targets = adapters, targets

    def forward(self, step: Step, keep: list[int] | torch.Tensor) -> torch.Tensor:
        index = self._index(keep)
        with selected(self.model), kernels.linears_on_onednn(self.linears), self._lora_hooks(step.lora):
            out = self.model(input_ids=step.input_ids, position_ids=step.positions, use_cache=False,
                             logits_to_keep=index, **{KWARG: step})
        return out.logits[0].float()

    def _index(self, keep: list[int] | torch.Tensor) -> torch.Tensor:
        """`keep` on the device; decode steps keep the same rows' logits step after step (the rows
        change as they join or leave), so the last upload is reused while it is the same list."""
        if isinstance(keep, torch.Tensor):
            return keep.to(device=self.device, dtype=torch.long)
        last, index = self._keep
        if keep != last:
            index = torch.as_tensor(keep, dtype=torch.long, device=self.device)
            self._keep = (list(keep), index)
        return index

    @contextmanager
    def _lora_hooks(self, ad: lora.Lora) -> Iterator[None]:
        """For one forward with adapter tokens, each adapted projection adds the updates to its
        output (T flat tokens: transformers' batch of one); a forward without them hooks nothing."""
        if not ad:
            yield
            return
        plan = self.adapters.plan(lora.check(self.adapters, ad))

        def hook(layer: int, proj: str):
            def add(module, args, y):  # x (1, T, in), y (1, T, out)
                x = args[0]
                self.adapters.apply(layer, proj, x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1]), plan)
            return add

        with ExitStack() as hooks:
            for layer, proj, module in self._targets:
                hooks.callback(module.register_forward_hook(hook(layer, proj)).remove)
            yield


def as_forward(model: Any) -> Forward:
    """A transformers model (any `torch.nn.Module`) as an `HFModel`; a `Forward` as it is."""
    return HFModel(model) if isinstance(model, torch.nn.Module) else model


# What transformers' attention calls pass that batchgen's attention needs no more of: position
# ids (the step holds the positions), the cache flag (batchgen's buffers are the cache), MoE
# bookkeeping. Anything else is an argument batchgen would drop, and an error (`check_call`).
_IGNORED = frozenset({KWARG, "position_ids", "use_cache", "output_router_logits"})


def check_call(module, attention_mask, dropout: float, kwargs: dict, is_causal: bool = True) -> str | None:
    """Why batchgen's attention cannot run this attention call as transformers would, or None:
    an argument it does not implement is never dropped."""
    name = type(module).__name__
    if not is_causal:
        return f"{name} asks for attention in both directions (is_causal false); batchgen's is causal"
    if KWARG not in kwargs:
        return (f"{name} is called without the forward's keyword arguments, so batchgen's attention does not "
                "receive the forward's layout")
    unknown = sorted(k for k in kwargs if k not in _IGNORED)
    if unknown:
        return f"{name} passes attention arguments batchgen does not implement: {', '.join(unknown)}"
    if attention_mask is not None:  # batchgen masks by position itself; a model's own mask may carry a bias (ALiBi)
        return f"{name} passes an attention mask of its own (a bias such as ALiBi), which batchgen does not apply"
    if dropout:
        return f"{name} asks for attention dropout {dropout}"
    return None


def interface(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
              scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
              softcap: float | None = None, s_aux: torch.Tensor | None = None, is_causal: bool = True, **kwargs):
    """transformers' attention interface: query (1, Hq, T, D), key/value (1, Hkv, T, D), the
    forward's new tokens; returns (1, T, Hq, Dv). `s_aux`: attention sinks, one logit per query
    head (gpt-oss, granite_swa). `is_causal`: a config that states it passes it (true only:
    `runnable` refuses a false one)."""
    if attention_mask is not None or dropout or not is_causal or KWARG not in kwargs \
            or not _IGNORED.issuperset(kwargs):
        raise EngineError(check_call(module, attention_mask, dropout, kwargs, is_causal) or "unexpected attention call")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attention.attend(kwargs[KWARG], module.layer_idx, query[0], key[0], value[0], scale, sliding_window,
                           softcap, sinks=s_aux)
    return out.to(query.dtype)[None], None


@contextmanager
def selected(model: torch.nn.Module) -> Iterator[None]:
    """Route the model's attention through batchgen's for one forward."""
    _register(NAME, interface)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


@contextmanager
def probing(model: torch.nn.Module, fn) -> Iterator[None]:
    """Route the model's attention to `fn` for one forward (`layer_shapes` reads the layers' shapes)."""
    _register(NAME + "_probe", fn, _mask_rule)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME + "_probe"
    try:
        yield
    finally:
        config._attn_implementation = previous


def layer_shapes(model: torch.nn.Module) -> list[LayerShape]:
    """Per layer, the key/value heads and sizes, read off one probe forward of one token. It also
    checks that every layer's attention reaches batchgen's attention function with the forward's
    keyword arguments, and with no argument batchgen does not implement (`check_call`): a model
    that would fail or run otherwise at its first real forward is refused here, at load."""
    seen: dict[int, LayerShape] = {}
    problems: list[str] = []

    def probe(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, sliding_window=None,
              softcap=None, s_aux=None, is_causal=True, **kwargs):
        rule = attention_mask if isinstance(attention_mask, _MaskRule) else None
        why = check_call(module, None if rule else attention_mask, dropout, kwargs, is_causal)
        if why is None and rule is not None:
            why = rule.problem(sliding_window, type(module).__name__)
        if why is None and kwargs[KWARG] is not _PROBE:
            why = f"{type(module).__name__} is called with another value of batchgen's per-forward argument"
        if why is None and s_aux is not None and tuple(s_aux.shape) != (query.shape[1],):
            why = (f"{type(module).__name__}'s attention sinks have shape {tuple(s_aux.shape)}, "
                   f"not one per query head ({query.shape[1]})")
        if why is not None:
            problems.append(why)
        seen[module.layer_idx] = LayerShape(key.shape[1], key.shape[-1], value.shape[-1])
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    layers = getattr(model.config, "num_hidden_layers", None)
    device = next(model.parameters()).device
    try:
        with probing(model, probe), torch.inference_mode():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                  position_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False, logits_to_keep=1,
                  **{KWARG: _PROBE})
    except Exception as e:  # noqa: BLE001 - any failure means the same: this model is not supported
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise EngineError(f"{type(model).__name__}: its attention cannot run through batchgen's "
                          f"({type(e).__name__}: {first})") from e
    if problems:
        raise EngineError(f"{type(model).__name__}: {problems[0]}")
    if not seen or (layers is not None and sorted(seen) != list(range(layers))):
        raise EngineError(f"{type(model).__name__}: its attention layers do not all go through transformers' "
                          "attention interface with a layer index, which batchgen needs")
    return [seen[i] for i in sorted(seen)]


_PROBE = object()  # the probe forward's per-forward argument: it must reach every attention call as it is


class _MaskRule:
    """What transformers' mask functions give a layer in the probe forward instead of a mask: the
    rule its mask would follow (`mask_function(batch, head, q_idx, kv_idx)`). batchgen masks by
    position itself, causally and by the `sliding_window` the attention call passes, so a layer whose
    mask follows another rule (a window only its mask holds, as Phi-MoE's; chunks; both
    directions) would run otherwise than in transformers."""

    FAR = 1 << 21  # query indices read: past any window batchgen's sliding layers are verified on

    def __init__(self, fn) -> None:
        self.fn = fn
        self.windows: set[int | None] | None = None  # read once: every layer of a type gets this one rule

    def window(self, q: int) -> int | None:
        """The keys query `q` sees: the last w up to itself (w; None: all of them). ValueError else."""
        kv = torch.arange(q + 2)
        seen = torch.as_tensor(self.fn(torch.tensor(0), torch.tensor(0), torch.tensor(q), kv)).expand(q + 2)
        w = int(seen.sum())
        if not seen[q] or seen[q + 1] or not seen[q + 1 - w : q + 1].all():
            raise ValueError("not a causal window")
        return None if w == q + 1 else w

    def problem(self, sliding_window: int | None, name: str) -> str | None:
        try:
            if self.windows is None:  # two queries: a chunk's start would move, a sliding window does not
                self.windows = {self.window(self.FAR), self.window(self.FAR + 1)}
        except Exception:  # noqa: BLE001 - a rule that is not a causal window, or that cannot be read
            return f"{name}'s attention mask is not causal, or not by a sliding window, which batchgen does not apply"
        if len(self.windows) > 1:
            return (f"{name}'s attention mask is chunked (its window moves with the query), which batchgen "
                    "does not apply")
        (window,) = self.windows
        if window != sliding_window:
            return (f"{name}'s attention mask has a window of {window} keys but its attention call passes "
                    f"sliding_window={sliding_window}; batchgen would attend by the latter")
        return None


def _mask_rule(*args, mask_function=None, **kwargs) -> _MaskRule:
    """The probe's mask interface: the rule, not a mask (`_MaskRule`)."""
    return _MaskRule(mask_function)


def _register(name: str, fn, mask=None) -> None:
    """transformers' registry is imported only for a transformers model. `mask`: the mask
    interface of that name too (batchgen's own forwards register none: transformers then builds no
    masks for them)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    if mask is not None:
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(name, mask)
