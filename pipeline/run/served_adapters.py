"""LoRA adapters on served runs (`--engine vllm`, `--server URL`): the name each adapter is served
under, the `vllm serve` flags that serve them, and the check that running servers serve them.

vLLM serves an adapter as a model name of its own (`--lora-modules NAME=PATH`), and a request
selects it by its `model`; a job on the base model sends the base model's served name. The
adapters are still resolved and inspected by batchgen (pipeline/run/adapters.py): their digests
key the resume, their index groups the prefix index, `--verify` applies them on batchgen's engine.

- `--engine vllm`: every adapter the run uses is a module of the server batchgen starts, under its
  first registered name (`--adapter NAME=PATH`), else `adapter-N`. The server starts before the
  jobs are read, with the adapters the options name (registered names and the default); a
  directory first met in a job's `adapter` field is served by starting the server again with all
  of them (`missing`, served.py). Why not vLLM's runtime loading (`/v1/load_lora_adapter`): it
  needs a server started with `--enable-lora` and a `--max-lora-rank` at least the new adapter's,
  neither known before the jobs are read, and it opens adapter loading to any local client
  (VLLM_ALLOW_RUNTIME_LORA_UPDATING). One restart, only for runs whose jobs name directories the
  options do not, keeps the server's set fixed and exact; the docs say to pass them as options.
- `--server URL`: the server must serve each adapter under its registered name already (its
  `/v1/models` lists it); a directory no `--adapter NAME=PATH` names cannot be mapped to a name
  there, so a job naming one is a row error (`directory_refusal`), the default an option error.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Sequence

from batchgen.jobs.errors import BatchgenError, OptionError, option
from batchgen.pipeline.run.adapters import parse_specs
from batchgen.pipeline.serve.batching import given

# the --max-lora-rank values vLLM 0.32 accepts (vllm/config/lora.py MaxLoRARanks): an adapter's rank rounds up
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class Module:
    """One adapter as a served LoRA module."""

    name: str  # the served name: a request's `model`
    path: str  # the adapter directory, absolute (what inspect_adapter's AdapterInfo.path holds)
    rank: int


def option_modules(specs: Sequence[str], base: Any, taken: Iterable[str] = ()) -> list[Module]:
    """The adapters `--adapter` values name (registered names, then the default), each directory
    once, for the server started before the jobs are read. One that cannot be used is left out:
    its jobs are row errors (or the default an option error) when the jobs are checked, and vLLM
    would refuse to start on it."""
    from batchgen.pipeline.model.adapter_files import AdapterError, inspect_adapter

    names, default = parse_specs(specs)
    for name in names:
        clash(name, taken)
    found: dict[str, Module] = {}
    unnamed = [default] if default is not None else []
    for label, path in [*names.items(), *((None, p) for p in unnamed)]:
        where = os.path.abspath(path)
        if where in found:
            continue
        try:
            info = inspect_adapter(where, base)
        except AdapterError:
            continue
        found[where] = Module(label or "", info.path, info.rank)
    return _named(list(found.values()), [*names, *taken])


def clash(name: str, models: Iterable[str]) -> None:
    """A registered name that is the served model's own name would select the base model."""
    if name in models:
        raise OptionError("adapter", "is the served model's own name; give the adapter another name", name)


def _named(modules: list[Module], taken: Iterable[str]) -> list[Module]:
    """Unnamed modules get `adapter-N`, N their position, unless some name already holds it."""
    used = set(taken) | {m.name for m in modules if m.name}
    out = []
    for i, m in enumerate(modules, 1):
        if not m.name:
            name, k = f"adapter-{i}", 1
            while name in used:
                k += 1
                name = f"adapter-{i}-{k}"
            used.add(name)
            m = Module(name, m.path, m.rank)
        out.append(m)
    return out


def missing(modules: Sequence[Module], infos: Sequence[Any], taken: Iterable[str] = ()) -> list[Module]:
    """`modules` and every adapter of the run (`Adapters.infos`) they lack (jobs' directories)."""
    have = {m.path for m in modules}
    new = [Module("", i.path, i.rank) for i in infos if i.path not in have]
    return _named([*modules, *new], [*taken, *(m.name for m in modules)]) if new else list(modules)


def served_names(modules: Sequence[Module], infos: Sequence[Any]) -> list[str]:
    """The served name of adapter index i + 1 (`ServedExecutor.adapter_names`)."""
    of_path = {m.path: m.name for m in modules}
    return [of_path[i.path] for i in infos]


def registered_names(adapters: Any) -> list[str]:
    """For `--server`: the served name of adapter index i + 1, the first name registered for its
    directory (every adapter has one there: `directory_refusal`)."""
    first: dict[str, str] = {}
    for name, path in adapters.names.items():
        first.setdefault(os.path.abspath(path), name)
    return [first[i.path] for i in adapters.infos]


def max_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise BatchgenError(f"a LoRA adapter of rank {rank}: vLLM serves ranks up to {VLLM_RANKS[-1]}")


def lora_arguments(modules: Sequence[Module], user_args: Sequence[str]) -> list[str]:
    """The `vllm serve` flags that serve `modules` (none without modules): `--enable-lora`,
    `--lora-modules NAME=PATH ...`, `--max-lora-rank` (the largest rank, rounded up to a value
    vLLM takes) and `--max-loras`, each unless the user's own `--vllm-arg` gives it.

    `--max-loras` is one slot per adapter and one more, kept empty. Every adapter stays in a slot
    (none is swapped in and out as windows move between adapters). The empty last slot is for
    vLLM's CPU build: its LoRA ops (vllm/lora/ops/torch_ops) pick a token's slot by indexing
    with the token's LoRA index, which is -1 for a base-model token, so a base-model job batched
    with adapter jobs gets the last slot's adapter applied (seen in 0.32: base jobs differed from
    LLM.generate without LoRA); an empty last slot adds nothing. A slot costs memory at the max
    rank in every layer (taken from the KV cache): a user with many big adapters passes their own
    `--vllm-arg='--max-loras K'` (on the CPU build K above the adapters' count)."""
    if not modules:
        return []
    if given(user_args, "--lora-modules"):
        raise OptionError("vllm_arg", f"names adapters batchgen serves itself; give each as "
                                      f"{option('adapter', 'NAME=PATH')} instead", "--lora-modules")
    out = [] if given(user_args, "--enable-lora") else ["--enable-lora"]
    out += ["--lora-modules", *(f"{m.name}={m.path}" for m in modules)]
    if not given(user_args, "--max-lora-rank"):
        out += ["--max-lora-rank", str(max_rank(max(m.rank for m in modules)))]
    if not given(user_args, "--max-loras"):
        out += ["--max-loras", str(len(modules) + 1)]
    return out


def check_served(url: str, served: Collection[str], names: Iterable[str], model: str | None = None) -> None:
    """Every registered adapter name a run on a running server uses must be one it serves (and
    not the model it serves under that name)."""
    for name in names:
        clash(name, [model])
        if name not in served:
            raise OptionError("adapter", f"is not served by {url} (it serves {', '.join(served) or 'nothing'}); "
                                         f"start that server with --enable-lora --lora-modules {name}=PATH", name)


def check_servers(urls: Sequence[str], adapters: Any) -> None:
    """`validate --server`: each server lists the registered adapters the jobs use (its
    `/v1/models`, asked once; only when jobs use adapters)."""
    from batchgen.pipeline.serve.client import served_models

    names = registered_names(adapters)
    for url in urls if names else ():
        check_served(url, served_models(url), names)


def directory_refusal(registered: dict[str, str]):
    """For `--server`: a job's adapter directory that no `--adapter NAME=PATH` names is a row
    error (a running server knows adapters by name only); returns the check `Adapters` applies
    to each label that is no registered name (None: fine; else the reason)."""
    named = {os.path.abspath(p) for p in registered.values()}

    def refuses(label: str) -> str | None:
        if os.path.abspath(label) in named:
            return None
        return (f"{label!r} is an adapter directory, which a running server ({option('server')}) cannot be "
                f"asked for: it serves adapters by name; register it with {option('adapter', 'NAME=PATH')}, NAME "
                "as the server's --lora-modules names it")

    return refuses
