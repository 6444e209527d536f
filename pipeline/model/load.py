"""Model resolution and loading: a name or path to its files, device and dtype, and the loaded
model (batchgen's own decoder, or transformers' model code).

The default model's one-time conversion lives in ``batchgen.pipeline.model.default_model``.
torch and transformers' model classes are imported inside the functions that use them:
finding the default model's directory, or a model's config, must not cost a torch import
(`validate` and `plan` need the tokenizer and config only).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

from batchgen.pipeline.errors import OptionError, option
from batchgen.pipeline.model.default_model import DEFAULT_MODEL, default_model_path
from batchgen.pipeline.model.files import ModelLoadError
from batchgen.pipeline.model.precision import resolve_dtype, stored_dtype

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from batchgen.pipeline.model.decoder import Decoder
    from batchgen.pipeline.model.prepack import Prepack

_DAMAGED = "its weights cannot be read: a safetensors file is damaged or truncated; copy or download it again"


def resolve_device(device: str) -> torch.device:
    """``auto`` → cuda, else mps, else cpu; explicit names are checked for availability."""
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise OptionError("device", "unknown device: use auto, cpu, cuda or cuda:N", device) from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError("device", "CUDA is not available here: use cpu or auto", device)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise OptionError("device", f"only {torch.cuda.device_count()} CUDA device(s) exist", device)
    elif dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise OptionError("device", "MPS is not available here: use cpu or auto", device)
    elif dev.type != "cpu":
        raise OptionError("device", "unsupported device: use auto, cpu, cuda or cuda:N", device)
    return dev


def resolve_precision(device: str, dtype: str, model: str | None = None) -> dict[str, str]:
    """The device type and dtype a run with these options computes in (what `load_model` uses):
    `auto` differs between machines and checkpoints, so resumed work is checked against these, not
    the options."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, _stored(model_source(model)[1], dtype))
    return {"device_type": torch_device.type, "dtype": str(torch_dtype).removeprefix("torch.")}


def _stored(source: str, dtype: str) -> str | None:
    """The checkpoint's stored dtype where `auto` needs it (`precision.stored_dtype`)."""
    return stored_dtype(_directory(source)[0]) if dtype == "auto" else None


def _looks_local(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else shaped like a path is meant to be local,
    # so a typo gives a "not found" error instead of a slow, doomed hub lookup.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def model_source(name_or_path: str | None) -> tuple[str, str]:
    """``(label, source)``: the name to report, and the local directory or hub id that the
    config, tokenizer and weights load from (for the default model, its converted directory)."""
    if name_or_path is None:
        return DEFAULT_MODEL, str(default_model_path())
    local = Path(name_or_path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelLoadError(
                f"model {name_or_path!r}: {local} has no config.json; "
                "point to a directory written by save_pretrained"
            )
        return name_or_path, str(local)
    if _looks_local(name_or_path):
        raise ModelLoadError(
            f"model {name_or_path!r} not found: the path does not exist; "
            f"check the path, or omit {option('model')} to use the default model"
        )
    return name_or_path, name_or_path


def load_config(name_or_path: str | None, trust_remote_code: bool = False, runs_here: bool = True):
    """The model's config alone (no weights): what the checks before a run need of the model. A
    process that never loads a model calls it inside `batchgen.pipeline.text.tokenize.torch_hidden`.
    `runs_here`: batchgen's engine will run it, so a model neither of its model codes reproduces
    is refused; False where a server computes (--engine vllm, --server), which only needs the
    config's context window and vocabulary."""
    label, source = model_source(name_or_path)
    own, _ = _own_decoder_config(source, label)
    if own is not None:  # what batchgen's decoder runs: read from the files, no config class imported
        return own
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:  # KeyError: rope parameters that lack a required key
        hint = (f"it needs custom code: pass {option('trust_remote_code')} only if you trust that code"
                if "trust_remote_code" in str(e) and not trust_remote_code
                else "pass a local directory written by save_pretrained, or a hub id that is in the local HF cache")
        raise ModelLoadError(f"model {label!r}: cannot read its config: {_flat(e, 300)}; {hint}") from e
    except Exception as e:  # noqa: BLE001 - a config class failing on this config.json: no traceback (issue 48)
        raise ModelLoadError(f"model {label!r}: transformers cannot read its config ({_named(e)})") from e
    if runs_here:
        _check_runnable(config, label)
    return config


def _own_decoder_config(source: str, label: str):
    """`(config, None)`: the model's `DecoderConfig`, where batchgen's own decoder runs it (a local
    directory, or a hub id's snapshot in the local Hugging Face cache, whose files state all it
    needs: `batchgen.pipeline.model.decoder_config`); else `(None, why not)`. A model no model code runs as
    transformers does, or whose tensors disagree with its config, is a ModelLoadError."""
    from batchgen.pipeline.model.decoder_config import Refused, read

    directory, why = _directory(source)
    if directory is None:
        return None, why
    try:
        return read(directory)
    except Refused as e:
        raise ModelLoadError(f"model {label!r}: {e}") from None


def _directory(source: str) -> tuple[Path | None, str | None]:
    """`(directory, None)`: where the model's files are, a local directory or a hub id's snapshot in
    the local Hugging Face cache; else `(None, why not)`."""
    if Path(source).is_dir():
        return Path(source), None
    if _looks_local(source):
        return None, "not a model directory"
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "config.json")
    except (ValueError, OSError):  # not a valid repo id
        return None, "not a valid hub id"
    if not isinstance(cached, str):
        return None, "not in the local Hugging Face cache"
    return Path(cached).parent, None


def located(name_or_path: str | None) -> tuple[Path, bool] | None:
    """`(directory, from the hub cache)`: where the model's files are on this machine (a local
    directory, the default model's converted one, or a hub id's snapshot in the local Hugging Face
    cache); None for a hub id not in that cache."""
    source = model_source(name_or_path)[1]
    directory, _ = _directory(source)
    return None if directory is None else (directory, not Path(source).is_dir())


def _check_runnable(config, label: str) -> None:
    """transformers' config of a model: refused where no model code of batchgen's runs it as
    transformers' uncached `generate` would (`batchgen.pipeline.model.runnable.problem`)."""
    from batchgen.pipeline.model.runnable import problem

    why = problem(config)
    if why:
        raise ModelLoadError(f"model {label!r}: {why}")


def load_model(
    name_or_path: str | None,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    pack_weights: bool = True,
    own_decoder: bool | None = None,
    prepack: Prepack | None = None,
) -> tuple[PreTrainedModel | Decoder, str]:
    """Load a causal LM for inference on ``device``.

    On a CPU, a Llama-family model whose files state everything its forward needs loads into
    batchgen's own decoder (`batchgen.pipeline.model.decoder`: no transformers model code imported, fused and
    packed linear layers); `own_decoder=False`, or `BATCHGEN_DECODER=0`, loads transformers' model
    instead, as every other model and device does. A transformers model is in eval mode, and on a
    CPU its linear layers' weights are packed for oneDNN in place (`kernels.pack_in_place`):
    the model is batchgen's, for inference; `pack_weights=False` keeps plain Hugging Face layers.
    A model neither model code runs as transformers' uncached `generate` would (`batchgen.pipeline.model.runnable`), or whose tensors disagree with its config, is a one-line ModelLoadError.
    `prepack`: the layers packed while torch was imported (`batchgen.pipeline.model.prepack`), taken where
    they are this model's as the decoder runs it.
    Returns ``(model, tokenizer_source)``: the local directory or hub id the
    tokenizer should be loaded from (for the default model, the converted dir).
    """
    label, source = model_source(name_or_path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, _stored(source, dtype))
    if own_decoder is None:
        from batchgen.pipeline.model.decoder import enabled

        own_decoder = torch_device.type == "cpu" and enabled()
        declined = "BATCHGEN_DECODER=0" if torch_device.type == "cpu" else f"a {torch_device.type} device"
    else:
        declined = "own_decoder=False"
    config, why = _own_decoder_config(source, label) if own_decoder else (None, declined)
    if config is not None:
        from batchgen.pipeline.model.decoder import Decoder

        import torch

        packed = prepack.take(config, torch_device.type, torch_dtype == torch.float32) if prepack else None
        tensors = {k: torch.frombuffer(packed.buffer, dtype=torch.float32, count=n, offset=at)
                   for k, (at, n) in packed.layers.items()} if packed is not None else None
        try:
            decoder = Decoder(config, torch_device, torch_dtype, packed=tensors)
            if decoder.prepacked and packed.cached:
                decoder.packed_weights = "cache"
            return decoder, source
        except OSError as e:
            raise ModelLoadError(f"model {label!r}: {_DAMAGED} ({e})") from e

    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from batchgen.pipeline.model.runnable import held_load_report, mismatch

    _check_before_weights(source, label, trust_remote_code)

    def _load(attn: str) -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, attn_implementation=attn, trust_remote_code=trust_remote_code
        )

    try:
        with held_load_report() as report:
            try:
                model = _load("sdpa")
            except ValueError as e:
                # Architectures without an SDPA path raise ValueError; anything else is a real error.
                if "scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e):
                    raise
                model = _load("eager")
    except ModelLoadError:
        raise
    except ValueError as e:
        msg = str(e)
        if "Unrecognized configuration class" in msg:
            # transformers appends every supported config class (~200 names); keep the head only.
            msg = msg.split(" for this kind of AutoModel")[0]
            hint = "use a causal language model (one AutoModelForCausalLM supports, e.g. Llama, Qwen2, GPT2)"
        elif "trust_remote_code" in msg and not trust_remote_code:
            hint = f"it needs custom code: pass {option('trust_remote_code')} only if you trust that code"
        else:
            hint = "transformers cannot build it from its config.json"
        raise ModelLoadError(f"model {label!r} could not be loaded: {_flat(msg, 500)}; {hint}") from e
    except pickle.UnpicklingError as e:
        # torch.load (weights_only) refuses a pickled checkpoint holding more than tensors
        detail = next((line.strip() for line in str(e).splitlines() if "WeightsUnpickler error" in line),
                      str(e).splitlines()[0] if str(e) else "")
        raise ModelLoadError(
            f"model {label!r}: torch refused to load its pickled checkpoint safely ({detail[:200]}); "
            "use a safetensors copy of the model, or another model"
        ) from e
    except SafetensorError as e:  # a damaged or truncated checkpoint file
        raise ModelLoadError(f"model {label!r}: {_DAMAGED} ({e})") from e
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
            raise ModelLoadError(f"model {label!r}: transformers cannot load it ({_named(e)})") from e
        raise ModelLoadError(f"model {label!r}: {mismatch(report)}: the config does not match the weights") from None
    except (KeyError, TypeError) as e:  # e.g. rope parameters that lack a key, a head_dim of null
        raise ModelLoadError(f"model {label!r}: transformers cannot build it from its config.json "
                             f"({type(e).__name__}: {str(e)[:300]})") from None
    except OSError as e:
        raise ModelLoadError(
            f"model {label!r} could not be loaded: {_flat(e, 500)}; "
            "pass a local directory written by save_pretrained, or a hub id that is in the local HF cache"
        ) from e
    except Exception as e:  # noqa: BLE001 - transformers' model code failing on this model: no traceback (issue 48)
        raise ModelLoadError(f"model {label!r}: transformers cannot load it ({_named(e)})") from e

    _check_runnable(model.config, label)
    model.batchgen_decoder_declined = why  # the summary's `decoder_declined`
    model.to(torch_device)
    model.eval()
    _probe(model, label)
    if pack_weights:
        from batchgen.pipeline.model.kernels import pack_in_place

        pack_in_place(model)
    return model, source


def _probe(model, label: str) -> None:
    """One probe forward through batchgen's attention (`hf.layer_shapes`), at load: a model whose
    attention calls batchgen cannot run exactly is refused here, in one line, before any job runs."""
    from batchgen.pipeline.model.forward import EngineError
    from batchgen.pipeline.model.hf import layer_shapes
    from batchgen.pipeline.model.hf_support import foreign, refused

    why = foreign(model)  # custom model code under a listed model type's config
    if why:
        raise ModelLoadError(f"model {label!r}: {refused(getattr(model.config, 'model_type', None), why)}")
    try:
        model.batchgen_layer_shapes = layer_shapes(model)  # `HFModel.layer_shapes` reads them back
    except EngineError as e:
        raise ModelLoadError(f"model {label!r}: {e}") from None



def _check_before_weights(source: str, label: str, trust_remote_code: bool) -> None:
    """A model transformers' model code in batchgen does not run is refused from its config, before
    its weights load (the Python API loads without `validate`'s check first)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - the load itself words what is wrong with it
        return
    _check_runnable(config, label)


def _flat(e: BaseException | str, limit: int) -> str:
    """A message on one line, cut: transformers' errors span lines (an error of batchgen's is one)."""
    return " ".join(str(e).split())[:limit]


def _named(e: BaseException) -> str:
    return f"{type(e).__name__}: {_flat(e, 300)}"
