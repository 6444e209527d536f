"""Which models no model code of batchgen's runs as transformers' uncached `generate` would, from
transformers' config of a model (the decoder's own configs are checked in `decoder_config`), and
transformers' size-mismatch report worded in one line."""
from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from typing import Iterator

from batchgen.pipeline.model import hf_support
from batchgen.pipeline.model.rope import refusal


def problem(config, files: bool = True) -> str | None:
    """Why batchgen does not run this model, in one line that names its model type and the way to run
    it anyway, or None: a model type off the allow-list of transformers' model code
    (`hf_support`), then what no model code of batchgen's runs as transformers would
    (`rope.refusal`; with `files`, `_cache_problem`: keys a config.json sets that its config class
    does not declare), then knobs the allow-list's sweep does not cover."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", None)
    why = hf_support.unlisted(model_type) or hf_support.foreign(config) \
        or refusal(getattr(text, "is_causal", True), getattr(text, "rope_parameters", None)) \
        or (_cache_problem(text) if files else None) or hf_support.knob_problem(config)
    return None if why is None else hf_support.refused(model_type, why)


def _cache_problem(config) -> str | None:
    """transformers' `generate` builds its KV cache's layers from the config's `layer_types`, else
    from `sliding_window` or `attention_chunk_size`, and a windowed cache layer drops keys at decode
    steps even where the model's own masks attend to all of them. A config class that does not
    declare the key the cache reads leaves it to the cache alone (a Llama with `sliding_window`): its generate
    is windowed at decode steps only, which batchgen's forwards do not reproduce. Chunked attention
    batchgen does not implement."""
    declared = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else None
    read = ("layer_types",) if getattr(config, "layer_types", None) is not None else \
        ("sliding_window", "attention_chunk_size")  # what the cache reads: layer_types, where there are
    for key in read:
        value = getattr(config, key, None)
        if key == "layer_types" and value is not None and all(t == "full_attention" for t in value):
            continue  # full attention on every layer, as the model's own masks
        if declared is not None and key not in declared and value is not None:
            return (f"its config.json sets {key}, which {type(config).__name__}'s model code does not read but "
                    "transformers' generate applies to its cache; batchgen does not run this model")
    types = getattr(config, "layer_types", None) or ()
    if "chunked_attention" in types or (not types and getattr(config, "attention_chunk_size", None) is not None):
        return "chunked attention (attention_chunk_size): batchgen does not run it"
    return None


@contextmanager
def held_load_report() -> Iterator[list[str]]:
    """transformers logs a table of the checkpoint's tensors that did not load as they are, then
    raises if any had the wrong size. The table is held back here (the caller words a size
    mismatch in one line from it) and logged as usual after a load that succeeds."""
    from transformers.utils import logging as hf_logging

    logger, held = hf_logging.get_logger("transformers.modeling_utils"), []

    def hold(record) -> bool:
        if "LOAD REPORT" not in record.getMessage():
            return True
        held.append(record)
        return False

    lines: list[str] = []
    logger.addFilter(hold)
    try:
        yield lines
    except BaseException:
        lines += [line for r in held for line in r.getMessage().splitlines()]
        raise
    finally:
        logger.removeFilter(hold)
    for record in held:
        logger.handle(record)


def mismatch(report: list[str]) -> str:
    """The first size mismatch of transformers' load report, in words."""
    for line in report:
        m = re.search(r"^\s*(\S+)\s*\|.*MISMATCH.*ckpt: torch\.Size\((\[[^\]]*\])\) vs model: ?torch\.Size\((\[[^\]]*\])\)",
                      re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m:
            return f"its checkpoint's {m[1]} has shape {m[2]}, but config.json makes it {m[3]}"
    return "its checkpoint's tensors have other shapes than config.json makes them"
