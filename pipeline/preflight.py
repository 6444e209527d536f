"""Everything checked before generation, in one code path.

`batchgen validate` calls `check_inputs`, and so does `batchgen process` before it loads the
model: whatever `process` would refuse (a bad row, a column Arrow cannot write, a prompt that
does not tokenize or does not fit the context window), `validate` reports first, with its
location. `check_output` refuses a bad output path before any work is done.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import pyarrow as pa

from jobs import (InvalidRow, Job, JobError, id_type_for, infer_extra_schema, input_schema, read_jobs,
                  result_schema)
from jobs.writers import conform_rows
from pipeline.tokenize import Tokenizer, TokenizerError
from pipeline.types import Request, SamplingParams

if TYPE_CHECKING:
    from pipeline.runner import RunOptions

_PARQUET_NAMES = (".parquet", ".pq")
_LINE_NAMES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
_UNSUPPORTED_COMPRESSION = (".zst", ".zstd", ".bz2", ".xz", ".lz4")
_EXTRAS_CHUNK = 4096  # rows per Arrow conversion when checking carried columns


@dataclass
class Checked:
    """The input as a run sees it before generating."""

    jobs: dict[int, Job]  # every row that is a valid job, by input position (the job set)
    invalid: dict[int, InvalidRow]  # every row that cannot run, with where and why
    requests: list[Request]  # the jobs that run, tokenized
    schema: pa.Schema  # the result schema
    tokenizer: Tokenizer

    @property
    def total(self) -> int:
        """Input rows: each is a job that runs or an invalid row (or both, if it fails to tokenize)."""
        return len(self.jobs.keys() | self.invalid.keys())


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


def read_all(inputs: list[str], options: RunOptions) -> tuple[dict[int, Job], dict[int, InvalidRow]]:
    """Every input row by its position: a valid job or the reason it is not one."""
    jobs: dict[int, Job] = {}
    invalid: dict[int, InvalidRow] = {}
    for order, item in enumerate(read_jobs(inputs, options.defaults, dataset=options.dataset, split=options.split,
                                           prompt_template=options.prompt_template, system=options.system)):
        (jobs if isinstance(item, Job) else invalid)[order] = item
    return jobs, invalid


def read_checked(inputs: list[str], options: RunOptions) -> tuple[dict[int, Job], dict[int, InvalidRow], pa.Schema]:
    """The rows, the rows whose carried columns cannot be written, and the result schema."""
    jobs, invalid = read_all(inputs, options)
    return checked_rows(jobs, invalid, input_schema(inputs, dataset=options.dataset, split=options.split), options)


def checked_rows(jobs: dict[int, Job], invalid: dict[int, InvalidRow], hint: pa.Schema | None,
                 options: RunOptions) -> tuple[dict[int, Job], dict[int, InvalidRow], pa.Schema]:
    """Rows read (from files, or in memory by the Python API) and the types of typed inputs: the
    rows whose carried columns cannot be written move to `invalid`; and the result schema."""
    extra_schema = infer_extra_schema((j.extra for j in jobs.values()), hint)
    for order, bad in check_extras(jobs, extra_schema).items():
        invalid[order] = bad
        del jobs[order]
    created = options.output_format == "openai"  # each request's completion time, kept in the parts
    return jobs, invalid, result_schema(extra_schema, id_type_for(j.id for j in jobs.values()), created)


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


def check_inputs(inputs: list[str], options: RunOptions) -> Checked:
    """Read, validate and tokenize every row, with the model's tokenizer and config (no weights)."""
    from pipeline.model import load_config, model_source

    jobs, invalid, schema = read_checked(inputs, options)
    _, source = model_source(options.model)
    config = load_config(options.model, options.trust_remote_code)
    tokenizer = Tokenizer.load(source, trust_remote_code=options.trust_remote_code)
    return tokenized(jobs, invalid, schema, tokenizer, config, options)


def tokenized(jobs: dict[int, Job], invalid: dict[int, InvalidRow], schema: pa.Schema, tokenizer: Tokenizer,
              config: Any, options: RunOptions) -> Checked:
    """Checked rows made requests with the model's tokenizer and config; what cannot run joins
    `invalid` (the Python API calls this with the model it holds)."""
    default = options.defaults.constraint
    if default is not None:  # a bad default fails once, before any row
        from pipeline.grammar import GrammarError

        try:
            tokenizer.grammars.check(default)
        except GrammarError as e:
            raise JobError(f"--{(default.source or default.kind).replace('_', '-')}: cannot be used: {e}") from None
    requests, bad = to_requests(jobs, tokenizer, context_window(config), options.defaults.seed,
                                vocab_size(config))
    invalid.update(bad)
    return Checked(jobs, dict(sorted(invalid.items())), requests, schema, tokenizer)


def job_seed(run_seed: int | None, job_id: str | int) -> int:
    """A job without a seed gets one from the run's seed and its id: stable across reruns and
    batches, and different for two jobs with the same prompt."""
    digest = hashlib.blake2b(f"{run_seed or 0}:{job_id!r}".encode(), digest_size=8).digest()
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


def to_requests(jobs: Mapping[int, Job], tokenizer: Tokenizer, window: int | None,
                run_seed: int | None, vocab: int | None = None) -> tuple[list[Request], dict[int, InvalidRow]]:
    """Tokenize each job whole (keyed by its input position); a job that cannot run becomes an
    error row, never a crash."""
    requests, invalid = [], {}
    for order, job in jobs.items():
        try:
            ids = tokenizer.encode_messages(job.messages) if job.is_chat else tokenizer.encode_prompt(job.prompt)
        except TokenizerError as e:
            invalid[order] = InvalidRow(job.location, job.id, str(e))
            continue
        made = make_request(order, job, ids, tokenizer, window, run_seed, vocab)
        if isinstance(made, InvalidRow):
            invalid[order] = made
        else:
            requests.append(made)
    return requests, invalid


def make_request(order: int, job: Job, ids: list[int], tokenizer: Tokenizer, window: int | None,
                 run_seed: int | None, vocab: int | None = None) -> Request | InvalidRow:
    if not ids:
        return InvalidRow(job.location, job.id, "the prompt tokenizes to no tokens")
    too_long = length_error(job, len(ids), window)
    if too_long is not None:
        return too_long
    bad = generation_error(job, tokenizer, vocab)
    if bad is not None:
        return bad
    # compiled once per distinct constraint (generation_error just did)
    grammar = tokenizer.grammars.factory(job.constraint) if job.constraint is not None else None
    params = SamplingParams(
        max_new_tokens=job.max_new_tokens, temperature=job.temperature, top_p=job.top_p,
        top_k=job.top_k, seed=job.seed if job.seed is not None else job_seed(run_seed, job.id), n=job.n,
        logit_bias=job.logit_bias, repetition_penalty=job.repetition_penalty, presence_penalty=job.presence_penalty,
        frequency_penalty=job.frequency_penalty, min_tokens=job.min_tokens, stop_token_ids=job.stop_token_ids,
    )
    return Request(order, ids, params, tokenizer.stop_check(job.stop), grammar)


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


def length_error(job: Job, n_prompt: int, window: int | None) -> InvalidRow | None:
    if window is not None and n_prompt + job.max_new_tokens > window:
        return InvalidRow(job.location, job.id,
                          f"prompt of {n_prompt} tokens + max_new_tokens {job.max_new_tokens} exceeds the model's "
                          f"context window of {window}; shorten the prompt or lower max_new_tokens")
    return None
