"""Loading the model while a run reads and tokenizes its jobs.

A run's start is the jobs' reading and tokenizing, then the model's loading. Reading holds the
GIL (Python, and `tokenizers` parsing `tokenizer.json`); loading into batchgen's own decoder is
mostly not Python: memory-mapped pages faulted in, weights concatenated and packed for oneDNN,
torch ops that release the GIL. So on a CPU with a core to spare the two overlap: `ModelAhead`
starts `load_model` on a worker thread and the run takes its result after the checks.

Only where the model loads into batchgen's own decoder on a CPU (the same decision
`load_model` takes, from the files alone): transformers' loading is Python through and through,
and imports model code the reading thread may import too. Everything else, and every case the
decision cannot be taken early (a bad device, a model that is not there), loads on the caller's
thread when asked, as before, so each error still shows where and when it did.
"""
from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from batchgen.pipeline.errors import BatchgenError
from batchgen.pipeline.model import load
from batchgen.pipeline.model.load import _own_decoder_config, model_source, resolve_device

if TYPE_CHECKING:
    from batchgen.pipeline.model.prepack import Prepack

# While the model loads, a thread holding the GIL hands it on this often (Python's default is
# 5 ms): each of the loader's torch ops needs the GIL back to return, and waiting the default at
# each of its few hundred ops would serialize the two threads again. Back to the default as soon
# as the model is loaded (reading a big input goes on for long after).
_SWITCH_INTERVAL = 0.0005


class ModelAhead:
    """`load_model(name_or_path, device, dtype, trust_remote_code)`, started now on a worker thread
    where that overlaps (see the module's docstring), else run by `result`."""

    def __init__(self, name_or_path: str | None, device: str = "auto", dtype: str = "auto",
                 trust_remote_code: bool = False, prepack: Prepack | None = None) -> None:
        """`prepack`: layers packed while torch was imported, for `load_model` (`batchgen.pipeline.model.prepack`)."""
        self._args = (name_or_path, device, dtype, trust_remote_code)
        self._prepack = prepack
        self._future: Future | None = None
        self._interval = sys.getswitchinterval()
        if _own_decoder_on_cpu(name_or_path, device):
            sys.setswitchinterval(min(self._interval, _SWITCH_INTERVAL))
            pool = ThreadPoolExecutor(1, thread_name_prefix="batchgen-load")
            self._future = pool.submit(self._load)
            pool.shutdown(wait=False)  # the thread ends with its one task

    @property
    def ahead(self) -> bool:
        """Whether the model is loading on a worker thread."""
        return self._future is not None

    def result(self) -> tuple[Any, str]:
        """`load_model`'s result (or its error)."""
        if self._future is None:
            return self._load()
        return self._future.result()

    def discard(self) -> None:
        """Waits until a loading thread is done and drops what it loaded (a run that stops
        before it needs the model leaves no thread behind); nothing where none runs."""
        if self._future is not None:
            wait([self._future])
            self._future = None
        if self._prepack is not None:
            self._prepack.discard()

    def _load(self) -> tuple[Any, str]:
        try:
            return load.load_model(*self._args, prepack=self._prepack)
        finally:
            sys.setswitchinterval(self._interval)


def _own_decoder_on_cpu(name_or_path: str | None, device: str) -> bool:
    """Whether `load_model` would load batchgen's own decoder on a CPU (its decision, taken from
    the files alone); False where the decision fails here, so that `load_model` reports why."""
    from batchgen.pipeline.model.decoder import enabled

    try:
        if resolve_device(device).type != "cpu" or not enabled():
            return False
        label, source = model_source(name_or_path)
        return _own_decoder_config(source, label)[0] is not None
    except (BatchgenError, OSError, ValueError):
        return False
