"""The rows of a run's inputs as preflight checks them (pipeline/run/preflight.py), in chunks.

`Rows` reads them (jobs/chunks.py): each chunk holds jobs and rows that cannot run, from the
per-record path, and plain rows (a prompt, at most an id, and columns carried through: the
commonest row of a big file) left in columns. Carried columns are checked against the column
types of typed inputs here (a run with such inputs makes Jobs of rows that carry columns).

`validate` and `plan` never make Jobs of plain rows. A plain row is a valid job whose every
field but its id, prompt and carried columns is the run's default, so of the checks made after tokenizing
(`expand.token_problem`, `preflight.generation_error`) only the prompt's length differs from row
to row: `PlainCheck` compares the lengths to what those checks refuse in one numpy expression,
and the rows it picks (a superset; none in a normal file) are made into Jobs and asked the
reference checks themselves, so a refused row gets exactly the message, location and id that
`process` (which makes a Job of every row) reports. The generation check depends only on the
defaults: it is asked once, of a plain job of those defaults.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np
import pyarrow as pa

from batchgen.jobs import InvalidRow, Job, input_schema, result_schema
from batchgen.jobs.errors import option
from batchgen.jobs.chunks import PlainRows, plain_template, read_chunks
from batchgen.jobs.writers import ExtraSchema, conform_rows, outputs_of
from batchgen.pipeline.text.expand import length_problem, plain_entries, plain_shapes, whole_key
from batchgen.pipeline.run.prefix_index import Entries, pack_keys
from batchgen.pipeline.text.pieces import unpack_ids
from batchgen.pipeline.text.tokenize import Tokenizer, torch_hidden

if TYPE_CHECKING:
    from batchgen.pipeline.run.adapters import Adapters
    from batchgen.pipeline.run.options import RunOptions

CHUNK_ROWS = 8192  # rows read, checked and tokenized together
_EXTRAS_CHUNK = 4096  # rows per Arrow conversion when checking carried columns
_NO_EXTRA: dict[str, Any] = {}  # a row that carries no column (never written to)


class Rows:
    """Rows in chunks, in input order: (position, Job) that may run, (position, InvalidRow) that
    cannot, and, with `columnar`, plain rows left in columns (jobs/chunks.py: each a valid job of
    the run's defaults; `validate` and `plan` never need them as Jobs). A carried value is checked
    against the column types of typed inputs here, per chunk: a column whose type is inferred
    from the values holds every one of them by construction."""

    def __init__(self, inputs: list[str], options: RunOptions, columnar: bool = False,
                 adapters: Adapters | None = None) -> None:
        read = functools.partial(read_chunks, inputs, options.defaults, dataset=options.dataset, split=options.split,
                                 prompt_template=options.prompt_template, system=options.system, size=CHUNK_ROWS)
        self.items = read()  # checks the inputs and the template first, as read_jobs does
        self.hint = input_schema(inputs, dataset=options.dataset, split=options.split)
        if self.hint is not None:  # carried values are checked against typed inputs' columns as Jobs
            self.items = read(carried=False)
        self.template = plain_template(options.defaults)
        # each job's adapter is resolved and checked as its row is (pipeline/run/adapters.py); a
        # plain row names none: it runs the default
        self.adapters = adapters
        if adapters is not None:
            adapters.check(self.template)
        self.columnar = columnar
        self.extras = ExtraSchema(self.hint)
        self.all_int_ids = True
        self.outputs: set[str] = set()  # the optional result columns some job fills
        self.total = 0
        self.created = options.output_format == "openai"  # each request's completion time, kept in the parts
        self.refusal = refusal(options)

    def chunks(self) -> Iterator[tuple[dict[int, Job], list[tuple[int, InvalidRow]], list[PlainRows]]]:
        for chunk in self.items:
            self.total = chunk.end
            items = chunk.items if self.columnar else chunk.in_order(self.template)
            jobs = {order: item for order, item in items if isinstance(item, Job)}
            bad = [(order, item) for order, item in items if not isinstance(item, Job)]
            yield self._checked(jobs, bad, chunk.plain if self.columnar else [])

    def _checked(self, jobs: dict[int, Job], bad: list[tuple[int, InvalidRow]], plain: list[PlainRows]):
        # every row's columns count, as before the check, in input order (the first to name a column places it)
        self.extras.update(_extras_in_order(jobs, plain))
        if self.hint is not None:
            typed = pa.schema([f for f in self.hint if any(f.name in j.extra for j in jobs.values())])
            for order, problem in check_extras(jobs, typed).items():
                bad.append((order, problem))
                del jobs[order]
        if self.refusal is not None:
            for order, problem in refused(jobs, self.refusal).items():
                bad.append((order, problem))
                del jobs[order]
        if self.adapters is not None:
            for order, problem in refused(jobs, self.adapters.check).items():
                bad.append((order, problem))
                del jobs[order]
        self.all_int_ids = self.all_int_ids and all(isinstance(j.id, int) for j in jobs.values()) \
            and all(isinstance(i, int) for rows in plain for i in rows.ids)
        for j in jobs.values():
            self.outputs |= outputs_of(j)
        if plain:
            self.outputs |= outputs_of(self.template)
        return jobs, bad, plain

    def schema(self) -> pa.Schema:
        return result_schema(self.extras.schema(), pa.int64() if self.all_int_ids else pa.string(), self.created,
                             self.outputs)


def _extras_in_order(jobs: dict[int, Job], plain: list[PlainRows]) -> list[Mapping[str, Any]]:
    """The carried columns of a chunk's rows (jobs and plain rows) in input order."""
    if not any(rows.extras for rows in plain):  # plain rows carry nothing: a null in each column
        return [j.extra for j in jobs.values()] + [_NO_EXTRA] * sum(map(len, plain))
    items = [(order, job.extra) for order, job in jobs.items()]
    for rows in plain:
        items += [(order, rows.extras.get(k, _NO_EXTRA)) for k, order in enumerate(rows.orders)]
    items.sort(key=lambda item: item[0])
    return [extra for _, extra in items]


def read_checked(inputs: list[str], options: RunOptions, adapters: Adapters | None = None
                 ) -> tuple[dict[int, Job], dict[int, InvalidRow], pa.Schema]:
    """Every row at once (the Ray driver's and the Python API's input): the jobs, the rows whose
    carried columns cannot be written or whose adapter cannot run, and the result schema."""
    rows = Rows(inputs, options, adapters=adapters)
    jobs: dict[int, Job] = {}
    invalid: dict[int, InvalidRow] = {}
    for chunk, bad, _ in rows.chunks():
        jobs.update(chunk)
        invalid.update(bad)
    return jobs, invalid, rows.schema()


def refusal(options: RunOptions) -> Callable[[Job], InvalidRow | None] | None:
    """What the output format or the engine cannot do with jobs that are otherwise valid (None:
    nothing): `process` refuses those rows, and so do `validate` and the Python API."""
    if options.engine == "ray":
        return _ray_refuses
    # a served run (--server, --engine vllm) runs every job batchgen's engine runs: adapters as the
    # server's LoRA modules (served_adapters.py), conversations a request per turn (executors.py)
    if options.output_format == "openai":
        return _openai_refuses
    return None


def refused(jobs: Mapping[int, Job], refuses: Callable[[Job], InvalidRow | None]) -> dict[int, InvalidRow]:
    found = ((o, refuses(j)) for o, j in jobs.items())
    return {o: problem for o, problem in found if problem is not None}


def _openai_refuses(job: Job) -> InvalidRow | None:
    """Scoring jobs under --output-format openai: the Batch API has no shape for their scores."""
    if not job.is_scoring:
        return None
    return InvalidRow(job.location, job.id, "field 'continuations': a scoring job's scores have no OpenAI output "
                                            f"shape; use {option('output_format', 'parquet')} or jsonl")


def _ray_refuses(job: Job) -> InvalidRow | None:
    """Jobs that are several requests (pipeline/text/expand.py) are not spread over Ray workers yet."""
    if job.is_scoring or job.max_new_tokens == 0:
        return InvalidRow(job.location, job.id, "a scoring job (continuations, or prompt_logprobs with "
                                                f"max_new_tokens 0) does not run with {option('engine', 'ray')} "
                                                f"yet; run it without {option('engine', 'ray')}")
    return None


def check_extras(jobs: Mapping[int, Job], extra_schema: pa.Schema) -> dict[int, InvalidRow]:
    """Rows whose carried columns do not fit the column types (a Parquet input's type, say, that
    a JSON Lines input of the same run contradicts): found now, not at the first commit."""
    if not extra_schema.names:
        return {}
    orders = list(jobs)
    bad: dict[int, InvalidRow] = {}
    for start in range(0, len(orders), _EXTRAS_CHUNK):
        chunk = orders[start:start + _EXTRAS_CHUNK]
        try:
            pa.Table.from_pylist(conform_rows([jobs[o].extra for o in chunk], extra_schema, required=False),
                                 schema=extra_schema)
            continue
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            pass
        for o in chunk:  # rare: find the rows and columns to blame
            for field in extra_schema:
                value = conform_rows([{field.name: jobs[o].extra.get(field.name)}], pa.schema([field]),
                                     required=False)[0][field.name]
                try:
                    pa.array([value], type=field.type)
                except (pa.ArrowException, OverflowError, TypeError, ValueError):
                    bad[o] = InvalidRow(jobs[o].location, jobs[o].id,
                                        f"field '{field.name}' holds {type(value).__name__} {str(value)[:40]!r}, "
                                        f"which does not fit the column's type {field.type} (from the input's "
                                        "schema); give the column one type in every input")
                    break
    return bad


def tokenize_plain(tokenizer: Tokenizer, plain: list[PlainRows], width: int | None, template: Job | None = None,
                   window: int | None = None) -> list[tuple[np.ndarray, Entries | None]]:
    """Per group of plain rows: each prompt's token count and, with `width`, the prefix index
    entries of their jobs (`template` with each prompt: `expand.index_entry`'s key and requests),
    a batch at a time as they are tokenized. A generating job's key is its prompt's ids, which
    the tokenizer hands over packed (`Tokenizer.encode_keys`); its one request's shape is its
    prompt's length's (`expand.plain_shapes`)."""
    out = []
    for rows in plain:
        if width is None:
            out.append((np.asarray(tokenizer.encode_texts(rows.prompts, True), dtype=np.int64), None))  # special tokens
            continue
        if width != tokenizer.key_width:
            raise ValueError(f"an index of {width}-byte keys for a tokenizer packing {tokenizer.key_width}")
        keys: list[bytes] = []
        lengths = np.asarray(tokenizer.encode_keys(rows.prompts, True, keys.extend), dtype=np.int64)
        if whole_key(template):
            entries = Entries(keys, np.ones(len(keys), np.int64), plain_shapes(template, lengths))
        else:  # the key is part of the prompt, and the requests are several: from the ids
            ids = [unpack_ids(k, width) for k in keys]
            found, requests = plain_entries(template, ids, window)
            entries = Entries.of(pack_keys(found, width), requests)
        out.append((lengths, entries))
    return out


_loaded: dict[tuple[str, bool], Tokenizer] = {}  # a worker process's tokenizer (pipeline/run/workers.py)


def tokenize_in_worker(source: str, trust_remote_code: bool, prompts: list[list[str]], width: int | None,
                       template: Job | None, window: int | None) -> list[tuple[np.ndarray, Entries | None]]:
    """`tokenize_plain` of groups of prompts in a worker process, which loads the tokenizer once
    (without torch, as `validate` and `plan` do)."""
    key = (source, trust_remote_code)
    if key not in _loaded:
        with torch_hidden(True):
            _loaded[key] = Tokenizer.load(source, trust_remote_code=trust_remote_code, without_torch=True)
    return tokenize_plain(_loaded[key], [PlainRows("", prompts=p) for p in prompts], width, template, window)


class PlainCheck:
    """The checks after tokenizing, for plain rows of the run's defaults (`template`)."""

    def __init__(self, template: Job, window: int | None, general: InvalidRow | None,
                 refused: InvalidRow | None = None) -> None:
        self.template, self.window = template, window
        # generation_error of a plain job: the same for every plain row (its reason, if any)
        self.general = general.reason if general is not None else None
        # what the output format or engine refuses of a plain job (`refusal`): found first, as
        # `Rows` finds it of every job before tokenizing
        self.refused = refused.reason if refused is not None else None

    def problems(self, rows: PlainRows, lengths: np.ndarray) -> dict[int, InvalidRow]:
        """The rows (by index in `rows`) that cannot run, and why."""
        if self.refused is not None:
            return {k: InvalidRow(rows.location(k), rows.ids[k], self.refused) for k in range(len(rows))}
        max_new = self.template.max_new_tokens
        suspect = lengths < (2 if max_new == 0 else 1)
        if max_new and self.window is not None:
            suspect |= lengths + max_new > self.window
        out: dict[int, InvalidRow] = {}
        for k in np.flatnonzero(suspect).tolist():  # the reference check decides, and words it
            problem = length_problem(rows.job(k, self.template), int(lengths[k]), self.window)
            if problem is not None:
                out[k] = problem
        if self.general is not None:
            for k in range(len(rows)):
                if k not in out:
                    out[k] = InvalidRow(rows.location(k), rows.ids[k], self.general)
        return out
