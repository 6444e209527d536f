"""The LoRA adapters a run may use, and which one each job runs with (torch-free: `validate` and
`plan` resolve and check adapters without importing torch).

- `--adapter NAME=PATH` (repeatable) registers a name; `--adapter PATH` alone is the default of
  every job that names none. The Python API's `adapters={"name": path}` registers names too.
- A job's `adapter` field holds a registered name or a path (relative to the working directory).
- An OpenAI Batch request's `body.model` that is a registered name selects that adapter, as
  vLLM's `--lora-modules` does; any other `body.model` is the base model's name as the request
  gives it (it was informational before adapters, and Batch files always carry one): the job
  runs the default adapter if there is one, else the base model. The output's `adapter` column
  says what each job ran with.

A job's label (what the output's `adapter` column holds: the name or path it used, or the
default's) is resolved once, as its row is checked (`label`), and the adapter behind it is
inspected once per directory (`batchgen.pipeline.model.adapter_files.inspect_adapter`: its config and
its safetensors header, never its weights). A job whose adapter cannot be used is a row error
with its location; a bad default, or a bad `--adapter` option, is an option error before any row.
Each directory has an index (1, 2, ... in first use; 0 is the base model): the engine's
`Request.adapter`, the prefix index's grouping and the model's `set_adapters` list all use it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from batchgen.jobs import InvalidRow, Job
from batchgen.jobs.errors import OptionError, option


# what a registered name may not hold: a value whose part before its first '=' holds a path's
# separator is a path (`./runs/lr=1e-4/adapter`); any other text is a name ("my adapter" too)
NAME_RULE = "a name is any text but empty, without '=', '/' or '\\'"


def parse_specs(specs: Iterable[str]) -> tuple[dict[str, str], str | None]:
    """`--adapter` values as (registered names -> paths, the default path or None). `NAME=PATH`
    registers NAME (`NAME_RULE`); any other value, or one that is an existing path, is the default's path."""
    names: dict[str, str] = {}
    default = None
    for spec in specs:
        name, eq, path = spec.partition("=")
        if eq and not any(c in name for c in "/\\") and not os.path.exists(spec):
            if not name.strip():
                raise OptionError("adapter", f"names no adapter before '=' ({NAME_RULE}); give NAME=PATH", spec)
            if not path:
                raise OptionError("adapter", "names no path; give NAME=PATH", spec)
            if name in names:
                raise OptionError("adapter", f"registers the name {name!r} twice; give each adapter its own name",
                                  spec)
            names[name] = path
        elif default is not None:
            raise OptionError("adapter", f"is a second default adapter (the first: {default}); a bare PATH is the "
                                         "default of every job, give the others as NAME=PATH", spec)
        elif not spec.strip():
            raise OptionError("adapter", "is empty; give NAME=PATH or PATH", spec)
        else:
            default = spec
    return names, default


@dataclass
class Adapters:
    """The run's adapters: registered names, the default, and each directory inspected once."""

    base: Any  # the base model's config, as `inspect_adapter` reads it (torch-free)
    names: dict[str, str] = field(default_factory=dict)  # registered name -> its path as given
    default: str | None = None  # the default's label (its path as given), or None: the base model
    infos: list[Any] = field(default_factory=list)  # AdapterInfo of index i + 1
    _found: dict[str, int | str] = field(default_factory=dict)  # absolute path -> index, or why it cannot run
    _of_label: dict[str, int | str] = field(default_factory=dict)  # label -> index, or why it cannot run
    # why a directory label (no registered name) cannot run here, or None: a running server
    # (--server) knows adapters by name only (pipeline/run/served_adapters.py)
    refuse_directory: Callable[[str], str | None] | None = None

    @classmethod
    def of(cls, specs: Sequence[str], base: Any,
           refuse_directory: Callable[[str], str | None] | None = None) -> "Adapters":
        """From `--adapter` values (the API's {name: path} as NAME=PATH); a bad default fails here,
        as a bad option."""
        names, default = parse_specs(specs)
        out = cls(base, names, default, refuse_directory=refuse_directory)
        if default is not None:
            found = out.index(default)
            if isinstance(found, str):
                if "=" in default:  # meant as NAME=PATH, maybe, with a path's separator in its NAME
                    found += f"; in NAME=PATH {NAME_RULE}"
                raise OptionError("adapter", found, default)
        return out

    def __bool__(self) -> bool:
        return bool(self.names) or self.default is not None

    def label(self, job: Job) -> str | None:
        """What a job runs with: its own adapter, a registered name in an OpenAI body.model, else
        the default (None: the base model)."""
        if job.adapter is not None:
            return job.adapter
        if job.request_model is not None and job.request_model in self.names:
            return job.request_model
        return self.default

    def index(self, label: str | None) -> int | str:
        """The index of a label's adapter (0: the base model), or why it cannot run (a sentence)."""
        if label is None:
            return 0
        found = self._of_label.get(label)
        if found is None:
            found = self._of_label[label] = self._resolve(label)
        return found

    def index_of(self, job: Job) -> int:
        """A checked job's adapter index (its label was resolved when its row was checked)."""
        found = self.index(job.adapter)
        if isinstance(found, str):
            raise AssertionError(f"job {job.id!r} runs an adapter that was refused: {found}")
        return found

    def check(self, job: Job) -> InvalidRow | None:
        """Resolve a job's label into `job.adapter` and say why it cannot run, if it cannot."""
        job.adapter = self.label(job)
        found = self.index(job.adapter)
        return InvalidRow(job.location, job.id, f"field 'adapter': {found}") if isinstance(found, str) else None

    def _resolve(self, label: str) -> int | str:
        from batchgen.pipeline.model.adapter_files import AdapterError, inspect_adapter

        path = self.names.get(label)
        if path is None and not os.path.exists(label):
            known = ", ".join(sorted(self.names)) or "none"
            return (f"{label!r} is neither a registered adapter name (registered: {known}; register one with "
                    f"{option('adapter', 'NAME=PATH')}) nor an adapter directory")
        if path is None and self.refuse_directory is not None:
            why = self.refuse_directory(label)
            if why is not None:
                return why
        where = os.path.abspath(path or label)
        if where not in self._found:
            try:
                info = inspect_adapter(where, self.base)
            except AdapterError as e:
                self._found[where] = str(e)
            else:
                self.infos.append(info)
                self._found[where] = len(self.infos)
        return self._found[where]

    def digests(self) -> dict[str, str]:
        """Each label jobs ran with, with its adapter's content digest: what resumed work must match
        (the jobs' digest holds each job's label; a label that now names other weights, or a
        checkpoint retrained in place, is other work)."""
        return {label: self.infos[i - 1].digest for label, i in self._of_label.items() if isinstance(i, int) and i}

    def labels(self) -> dict[int, str | None]:
        """Each index with the first label that named it (what `batchgen plan` reports; 0: None)."""
        out: dict[int, str | None] = {0: None}
        for label, i in self._of_label.items():
            if isinstance(i, int):
                out.setdefault(i, label)
        return out
