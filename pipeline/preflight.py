"""Everything checked before generation, in one code path, streaming.

`batchgen validate` calls `check_inputs`, and so do `batchgen plan` and `batchgen process` (before
it loads the model): whatever `process` would refuse (a bad row, a column Arrow cannot write, a
prompt that does not tokenize or does not fit the context window), `validate` reports first,
with its location. `check_output` refuses a bad output path before any work is done.

Rows are read in chunks; each chunk is tokenized in one call of the fast tokenizer's batch
encoder, in a thread, while the next chunk is read. What stays of a job is its prompt in the
sorted prefix index (its tail only), a few numbers in arrays, and, for `process`, the job
itself in a spool on disk: memory does not hold a million jobs as Python objects.
"""
from __future__ import annotations

import array
import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np
import pyarrow as pa

from jobs import InvalidRow, Job, JobError, input_schema, read_jobs, result_schema
from jobs.writers import ExtraSchema, conform_rows, outputs_of
from pipeline.jobstore import JobSpool, Problems
from pipeline.prefix_index import IndexBuilder, PrefixIndex
from pipeline.tokenize import Tokenizer, TokenizerError
from pipeline.expand import JobTokens, job_requests, token_problem, tokenize_jobs
from pipeline.types import Request

if TYPE_CHECKING:
    from pipeline.runner import RunOptions

_PARQUET_NAMES = (".parquet", ".pq")
_LINE_NAMES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
_UNSUPPORTED_COMPRESSION = (".zst", ".zstd", ".bz2", ".xz", ".lz4")
_EXTRAS_CHUNK = 4096  # rows per Arrow conversion when checking carried columns
CHUNK_ROWS = 8192  # rows read, checked and tokenized together


@dataclass
class Checked:
    """The input as a run sees it before generating. Jobs that run are numbered in input order;
    `orders[j]` is job j's input position."""

    total: int  # input rows: each is a job that runs or a row that cannot (in `invalid`)
    invalid: Problems
    orders: np.ndarray
    index: PrefixIndex | None  # the jobs' prompts, sorted (`plan`, `process`)
    spool: JobSpool | None  # the jobs themselves (`process`)
    schema: pa.Schema  # the result schema
    tokenizer: Tokenizer
    digest: str | None  # the job set: every valid row with its position (`process`; see parts.job_set_key)
    # refused elements of OpenAI list prompts: their request's custom_id (errors are per request)
    custom_ids: dict[int, str]
    window: int | None = None  # the model's context window: a long prompt is scored in windows of it

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()


def check_output(output: str, fmt: str, overwrite: bool) -> None:
    """Refuse an output path the run could not finish with, before any model work."""
    name = os.path.basename(output)
    if not name:
        raise JobError(f"-o {output!r}: give an output file name")
    if os.path.isdir(output):
        raise JobError(f"-o {output}: is a directory; give an output file name")
    _check_suffix(output, fmt)
    parts = output + ".parts"
    if os.path.lexists(parts) and (os.path.islink(parts) or not os.path.isdir(parts)):
        raise JobError(f"{parts} is in the way (batchgen keeps unfinished work in a directory of that name); "
                       "remove it or choose another -o")
    if os.path.exists(output) and not overwrite and not os.path.isdir(parts):
        raise JobError(f"{output} already exists; pass --overwrite to replace it")
    _probe_writable(os.path.dirname(output) or ".", output)


def _check_suffix(output: str, fmt: str) -> None:
    lower = output.lower()
    if lower.endswith(_UNSUPPORTED_COMPRESSION):
        raise JobError(f"-o {output}: batchgen compresses output only as .gz (JSON Lines); name it .jsonl.gz")
    if lower.endswith(_PARQUET_NAMES) and fmt != "parquet":
        raise JobError(f"-o {output}: the name says Parquet but --output-format is {fmt}; "
                       f"name it .jsonl, or drop --output-format {fmt}")
    if lower.endswith(_LINE_NAMES) and fmt == "parquet":
        raise JobError(f"-o {output}: the name says JSON Lines but the output format is parquet; "
                       "pass --output-format jsonl (or openai), or name it .parquet")
    if lower.endswith(".gz") and fmt == "parquet":
        raise JobError(f"-o {output}: Parquet is compressed inside the file; drop the .gz")


def _probe_writable(parent: str, output: str) -> None:
    """Create and remove a temp file where the output will go (or in the nearest existing parent
    directory, which the run would create the rest under): a read-only or full place fails now."""
    where = parent
    while not os.path.exists(where):
        up = os.path.dirname(os.path.abspath(where))
        if up == os.path.abspath(where):
            break
        where = up
    if not os.path.isdir(where):
        raise JobError(f"-o {output}: {where} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(output)}.tmp-", dir=where)
    except OSError as e:
        raise JobError(f"-o {output}: cannot write in {where} ({e.strerror or e}); "
                       "choose a writable location") from None
    os.close(fd)
    os.unlink(probe)


class _Rows:
    """Rows in chunks, in input order: (position, Job) that may run and (position, InvalidRow) that
    cannot. A carried value is checked against the column types of typed inputs here, per chunk:
    a column whose type is inferred from the values holds every one of them by construction."""

    def __init__(self, inputs: list[str], options: RunOptions) -> None:
        self.items = read_jobs(inputs, options.defaults, dataset=options.dataset, split=options.split,
                               prompt_template=options.prompt_template, system=options.system)
        self.hint = input_schema(inputs, dataset=options.dataset, split=options.split)
        self.extras = ExtraSchema(self.hint)
        self.all_int_ids = True
        self.outputs: set[str] = set()  # the optional result columns some job fills
        self.total = 0
        self.created = options.output_format == "openai"  # each request's completion time, kept in the parts

    def chunks(self) -> Iterator[tuple[dict[int, Job], list[tuple[int, InvalidRow]]]]:
        jobs: dict[int, Job] = {}
        bad: list[tuple[int, InvalidRow]] = []
        for order, item in enumerate(self.items):
            self.total = order + 1
            if isinstance(item, Job):
                jobs[order] = item
            else:
                bad.append((order, item))
            if len(jobs) + len(bad) >= CHUNK_ROWS:
                yield self._checked(jobs, bad)
                jobs, bad = {}, []
        yield self._checked(jobs, bad)

    def _checked(self, jobs: dict[int, Job], bad: list[tuple[int, InvalidRow]]):
        self.extras.update([j.extra for j in jobs.values()])  # every row's columns count, as before the check
        if self.hint is not None:
            typed = pa.schema([f for f in self.hint if any(f.name in j.extra for j in jobs.values())])
            for order, problem in check_extras(jobs, typed).items():
                bad.append((order, problem))
                del jobs[order]
        if self.created:
            for order, problem in openai_refuses(jobs).items():
                bad.append((order, problem))
                del jobs[order]
        self.all_int_ids = self.all_int_ids and all(isinstance(j.id, int) for j in jobs.values())
        for j in jobs.values():
            self.outputs |= outputs_of(j)
        return jobs, bad

    def schema(self) -> pa.Schema:
        return result_schema(self.extras.schema(), pa.int64() if self.all_int_ids else pa.string(), self.created,
                             self.outputs)


def read_checked(inputs: list[str], options: RunOptions) -> tuple[dict[int, Job], dict[int, InvalidRow], pa.Schema]:
    """Every row at once (the Ray driver's and the Python API's input): the jobs, the rows whose
    carried columns cannot be written, and the result schema."""
    rows = _Rows(inputs, options)
    jobs: dict[int, Job] = {}
    invalid: dict[int, InvalidRow] = {}
    for chunk, bad in rows.chunks():
        jobs.update(chunk)
        invalid.update(bad)
    return jobs, invalid, rows.schema()


def openai_refuses(jobs: Mapping[int, Job]) -> dict[int, InvalidRow]:
    """Scoring jobs under --output-format openai: the Batch API has no shape for their scores."""
    return {o: InvalidRow(j.location, j.id, "field 'continuations': a scoring job's scores have no OpenAI "
                                            "output shape; use --output-format parquet or jsonl")
            for o, j in jobs.items() if j.is_scoring}


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


def check_inputs(inputs: list[str], options: RunOptions, purpose: str = "process") -> Checked:
    """Read, validate and tokenize every row, with the model's tokenizer and config (no weights).
    `purpose`: "validate" keeps only the problems, "plan" also the prompt index, "process" also the
    jobs and the job set's digest. The first two never import torch (`tokenize.torch_hidden`)."""
    from pipeline.model import load_config, model_source

    light = purpose != "process"
    _, source = model_source(options.model)
    config = load_config(options.model, options.trust_remote_code, without_torch=light)
    window, vocab = context_window(config), vocab_size(config)
    tokenizer = Tokenizer.load(source, trust_remote_code=options.trust_remote_code, without_torch=light)
    check_default_constraint(tokenizer, options)
    rows = _Rows(list(inputs), options)
    invalid = Problems()
    index = IndexBuilder(tokenizer.vocab_size) if purpose != "validate" else None
    spool = JobSpool() if purpose == "process" else None
    digest = JobDigest() if purpose == "process" else None
    orders = array.array("q")
    custom_ids: dict[int, str] = {}
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="batchgen-tokenize") as pool:
            pending = None
            for jobs, bad in rows.chunks():
                ahead = pool.submit(_tokenize, tokenizer, jobs)  # runs while the next chunk is read
                if pending is not None:
                    _keep(*pending, tokenizer, window, vocab, invalid, index, spool, digest, orders, custom_ids)
                pending = (jobs, bad, ahead)
            if pending is not None:
                _keep(*pending, tokenizer, window, vocab, invalid, index, spool, digest, orders, custom_ids)
    except BaseException:
        if spool is not None:
            spool.close()
        raise
    return Checked(rows.total, invalid, np.frombuffer(orders, dtype=np.int64), index.build() if index is not None else None,
                   spool, rows.schema(), tokenizer, digest.hexdigest() if digest is not None else None, custom_ids,
                   window)


def _tokenize(tokenizer: Tokenizer, jobs: Mapping[int, Job]) -> list[JobTokens | TokenizerError]:
    return tokenize_jobs(tokenizer, list(jobs.values()))


def _keep(jobs: dict[int, Job], bad: list[tuple[int, InvalidRow]], tokenized, tokenizer: Tokenizer,
          window: int | None, vocab: int | None, invalid: Problems, index: IndexBuilder | None,
          spool: JobSpool | None, digest: JobDigest | None, orders: array.array, custom_ids: dict[int, str]) -> None:
    """One checked, tokenized chunk into what the run keeps."""
    kept: list[tuple[int, Job, JobTokens]] = []
    for (order, job), tokens in zip(jobs.items(), tokenized.result()):
        if digest is not None:  # the job set: every job that may run, tokenizable or not
            digest.add(order, job)
        problem = InvalidRow(job.location, job.id, str(tokens)) if isinstance(tokens, TokenizerError) \
            else token_problem(job, tokens, window) or generation_error(job, tokenizer, vocab)
        if problem is None:
            kept.append((order, job, tokens))
            continue
        bad.append((order, problem))
        if job.prompt_index is not None:
            custom_ids[order] = job.custom_id
    invalid.add(bad)
    orders.extend(o for o, _, _ in kept)
    if index is not None:  # a scoring job by its context: its continuations stay in its group
        index.add([t.ids for _, _, t in kept], [_weight(j, t) for _, j, t in kept],
                  [_max_new(j, t) for _, j, t in kept])
    if spool is not None:
        spool.add([j for _, j, _ in kept])


def _weight(job: Job, tokens: JobTokens) -> int:
    """Rows the job puts in the engine: its samples, or its continuations."""
    return job.n if tokens.pairs is None else len(tokens.pairs)


def _max_new(job: Job, tokens: JobTokens) -> int:
    """Tokens a row adds after the indexed ones: new tokens, or the longest continuation."""
    return job.max_new_tokens if tokens.pairs is None else max(len(c) for _, c in tokens.pairs)


class JobDigest:
    """A hash of the job set: every job that may run (tokenizable or not) with its input position,
    prompt, parameters and carried columns, in input order (`parts.job_set_key` adds the settings)."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)

    def add(self, order: int, job: Job) -> None:
        item = [order, job.id, job.prompt, job.messages, job.extra, job.generation(), job.custom_id, job.prompt_index]
        self._hash.update(json.dumps(item, sort_keys=True, default=str).encode() + b"\n")

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def job_digest(jobs: Mapping[int, Job]) -> str:
    digest = JobDigest()
    for order, job in sorted(jobs.items()):
        digest.add(order, job)
    return digest.hexdigest()


def job_seed(run_seed: int | None, job: Job) -> int:
    """The job's seed: its own, else one from the run's seed and its id: stable across reruns and
    batches, and different for two jobs with the same prompt."""
    if job.seed is not None:
        return job.seed
    digest = hashlib.blake2b(f"{run_seed or 0}:{job.id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def context_window(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size(config: Any) -> int | None:
    """The model's output vocabulary (its logits' width), where the config says it."""
    value = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    return value if isinstance(value, int) and value > 0 else None


def make_requests(order: int, job: Job, tokens: JobTokens, tokenizer: Tokenizer, window: int | None,
                  run_seed: int | None, vocab: int | None = None) -> list[Request] | InvalidRow:
    """A job's requests (pipeline/expand.py), or why it cannot run."""
    problem = token_problem(job, tokens, window) or generation_error(job, tokenizer, vocab)
    if problem is not None:
        return problem
    return job_requests(order, job, tokens, tokenizer, window, job_seed(run_seed, job))


def check_default_constraint(tokenizer: Tokenizer, options: RunOptions) -> None:
    """A bad default constraint (--json-schema and the like) fails once, before any row."""
    default = options.defaults.constraint
    if default is not None:
        from pipeline.grammar import GrammarError

        try:
            tokenizer.grammars.check(default)
        except GrammarError as e:
            raise JobError(f"--{(default.source or default.kind).replace('_', '-')}: cannot be used: {e}") from None


def generation_error(job: Job, tokenizer: Tokenizer, vocab: int | None = None) -> InvalidRow | None:
    """What the tokenizer refuses of a job's generation parameters: token ids (logit_bias,
    stop_token_ids) outside the model's vocabulary, a constraint that does not compile for it."""
    vocab = min(tokenizer.vocab_size, vocab or tokenizer.vocab_size)
    for name, ids in (("logit_bias", [t for t, _ in job.logit_bias]), ("stop_token_ids", job.stop_token_ids)):
        outside = [t for t in ids if t >= vocab]
        if outside:
            return InvalidRow(job.location, job.id, f"field '{name}' names token id {outside[0]}, outside the "
                                                    f"model's vocabulary of {vocab} tokens")
    if job.constraint is not None:
        from pipeline.grammar import GrammarError

        try:
            tokenizer.grammars.check(job.constraint)
        except GrammarError as e:
            return InvalidRow(job.location, job.id, f"field '{job.constraint.source or job.constraint.kind}' "
                                                    f"cannot be used: {e}")
    return None

