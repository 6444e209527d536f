"""What `batchgen serve` is told: where it listens, its data directory, its key, its limits, the
run options every batch runs with (`process`'s, as the server's defaults), and its clock."""
from __future__ import annotations

import ipaddress
import os
import time
from dataclasses import dataclass, field, replace

from batchgen.pipeline.errors import BatchgenError, OptionError
from batchgen.pipeline.run.options import RunOptions
from batchgen.pipeline.batchapi.batches import MAX_FILE_BYTES, MAX_REQUESTS

# seconds added to the server's clock: expiry is tested by starting a server a day later (tests only)
CLOCK_OFFSET_ENV = "BATCHGEN_SERVE_CLOCK_OFFSET"


@dataclass
class ServeConfig:
    data: str
    options: RunOptions = field(default_factory=RunOptions)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_file_bytes: int = MAX_FILE_BYTES
    max_requests: int = MAX_REQUESTS
    clock_offset: float = 0.0

    def now(self) -> int:
        """The service's time (OpenAI's timestamps are whole seconds)."""
        return int(time.time() + self.clock_offset)


def prepare(config: ServeConfig) -> ServeConfig:
    """The configuration checked and made absolute: a server without a key listens on loopback only;
    a batch runs in its own directory, so local model and adapter paths are made absolute."""
    if not config.api_key and not is_loopback(config.host):
        raise OptionError("host", "is not a loopback address, and the server has no API key: anyone who can "
                                  "reach it could run and read batches; pass --api-key KEY (or set "
                                  "BATCHGEN_API_KEY), or listen on 127.0.0.1", config.host)
    if config.api_key is not None and not config.api_key:
        raise OptionError("api_key", "is empty; give a key, or leave it out to listen on loopback only")
    options = config.options
    model = options.model
    if model is not None and (os.path.exists(model) or model.startswith((".", "/", "~"))):
        # a local model that every batch would fail on is refused now (a hub id loads in each batch's run);
        # an absolute path stays as given: it is the model's name in the output's system_fingerprint
        if not os.path.isabs(model):
            model = os.path.abspath(os.path.expanduser(model))
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise OptionError("model", "is not a model directory (no config.json there); point to a directory "
                                       "written by save_pretrained, or give a Hugging Face model id", options.model)
    adapters = tuple(_absolute_adapter(a) for a in options.adapters)
    options = replace(options, model=model, adapters=adapters, output_format="openai", overwrite=False,
                      on_error="skip", engine="local", shard=None)
    offset = os.environ.get(CLOCK_OFFSET_ENV)
    try:
        clock = float(offset) if offset else config.clock_offset
    except ValueError:
        raise BatchgenError(f"{CLOCK_OFFSET_ENV} must be a number of seconds, got {offset!r}") from None
    return replace(config, data=os.path.abspath(config.data), options=options, clock_offset=clock)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _absolute_adapter(value: str) -> str:
    """An --adapter value (NAME=PATH or PATH, as run/adapters.parse_specs reads it) with an
    existing path made absolute."""
    if os.path.exists(value):
        return os.path.abspath(value)
    name, sep, path = value.partition("=")
    if sep and name and os.path.exists(path):
        return f"{name}={os.path.abspath(path)}"
    return value
