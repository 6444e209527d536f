"""Everything checked before generation, in one code path, streaming.

`batchgen validate` calls `check_inputs`, and so do `batchgen plan` and `batchgen process` (before
it loads the model): whatever `process` would refuse (a bad row, a column Arrow cannot write, a
prompt that does not tokenize or does not fit the context window), `validate` reports first,
with its location. `check_output` refuses a bad output path before any work is done.

Rows are read in chunks (pipeline/run/inputrows.py); each chunk is tokenized by the fast tokenizer's
batch encoder, in a thread, while the next chunk is read. What stays of a job is its prompt in
the sorted prefix index (its tail only), a few numbers in arrays, and, for `process`, the job
itself in a spool on disk: memory does not hold a million jobs as Python objects. `validate`
and `plan` never make Jobs of plain rows (a prompt and an id, the commonest row of a big file):
those stay in columns, are counted and packed into index keys where they are tokenized, and are
checked in bulk by the same checks (`inputrows.PlainCheck`).
"""
from __future__ import annotations

import array
import hashlib
import json
import os
import tempfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from batchgen.jobs import InvalidRow, Job, JobError
from batchgen.jobs.errors import OptionError, option
from batchgen.jobs.chunks import PlainRows
from batchgen.pipeline.run.adapters import Adapters, parse_specs
from batchgen.pipeline.run.served_adapters import directory_refusal
from batchgen.pipeline.run.inputrows import CHUNK_ROWS, PlainCheck, Rows, tokenize_in_worker, tokenize_plain
from batchgen.pipeline.run.jobstore import JobSpool, Problems
from batchgen.pipeline.run.overlap import check_apart
from batchgen.pipeline.run.prefix_index import Entries, IndexBuilder, PrefixIndex, pack_keys
from batchgen.pipeline.run.workers import Workers
from batchgen.pipeline.text.tokenize import Tokenizer, TokenizerError, torch_hidden
from batchgen.pipeline.text.expand import JobTokens, index_entry, job_requests, token_problem, tokenize_jobs
from batchgen.pipeline.engine.types import Request

if TYPE_CHECKING:
    from batchgen.pipeline.run.options import RunOptions

_PARQUET_NAMES = (".parquet", ".pq")
_LINE_NAMES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
_UNSUPPORTED_COMPRESSION = (".zst", ".zstd", ".bz2", ".xz", ".lz4")
# `validate` and `plan` hand plain rows to worker processes once the input has shown this many:
# a worker costs a Python start and the tokenizer's load (about half a second)
MIN_WORKER_ROWS = 3 * CHUNK_ROWS


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
    # refused elements of OpenAI list prompts: their request's custom_id, their element (errors are per request)
    custom_ids: dict[int, tuple[str, int]]
    window: int | None = None  # the model's context window: a long prompt is scored in windows of it
    adapters: Adapters | None = None  # the run's adapters: each job's is resolved and checked
    conversations: ConversationCounts | None = None  # the conversations among the jobs (`plan` reports them)

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()


def check_output(output: str, fmt: str, overwrite: bool, inputs: Sequence[str] = ()) -> None:
    """Refuse an output path the run could not finish with, or whose files would replace one of
    `inputs` (pipeline/run/overlap.py), before any model work."""
    out = option("output", output)
    name = os.path.basename(output)
    if not name:
        raise JobError(f"{option('output', repr(output))}: give an output file name")
    if os.path.isdir(output):
        raise JobError(f"{out}: is a directory; give an output file name")
    parts = output + ".parts"
    check_apart(output, fmt, inputs, store=parts)
    _check_suffix(output, fmt)
    if os.path.lexists(parts) and (os.path.islink(parts) or not os.path.isdir(parts)):
        raise JobError(f"{parts} is in the way (batchgen keeps unfinished work in a directory of that name); "
                       f"remove it or choose another {option('output')}")
    if os.path.exists(output) and not overwrite and not os.path.isdir(parts):
        raise JobError(f"{output} already exists; pass {option('overwrite')} to replace it")
    _probe_writable(os.path.dirname(output) or ".", output)


def check_options(options: RunOptions) -> None:
    """Options that contradict each other, refused before any work (`validate` asks too)."""
    fmt = options.output_format
    if options.engine == "ray" and fmt != "parquet":
        raise OptionError("output_format", f"is not supported with {option('engine', 'ray')}, which writes a "
                                           "directory of Parquet parts; drop it, or run without "
                                           f"{option('engine', 'ray')}", fmt)
    if options.servers and options.engine != "local":
        raise OptionError("server", f"uses running servers, {option('engine', options.engine)} another engine; "
                                    "pick one")
    if options.verify and not options.served:
        raise OptionError("verify", f"compares a server's output with batchgen's own engine: it needs "
                                    f"{option('engine', 'vllm')} or {option('server')}")
    if options.shard is not None and fmt != "parquet":
        raise OptionError("output_format", f"is not supported with {option('shard')}, which writes Parquet shard "
                                           "outputs for `batchgen merge`; drop it", fmt)


def _check_suffix(output: str, fmt: str) -> None:
    lower, out = output.lower(), option("output", output)
    if lower.endswith(_UNSUPPORTED_COMPRESSION):
        raise JobError(f"{out}: batchgen compresses output only as .gz (JSON Lines); name it .jsonl.gz")
    if lower.endswith(_PARQUET_NAMES) and fmt != "parquet":
        raise JobError(f"{out}: the name says Parquet but the output format is {fmt}; "
                       f"name it .jsonl, or drop {option('output_format', fmt)}")
    if lower.endswith(_LINE_NAMES) and fmt == "parquet":
        raise JobError(f"{out}: the name says JSON Lines but the output format is parquet; "
                       f"pass {option('output_format', 'jsonl')} (or openai), or name it .parquet")
    if lower.endswith(".gz") and fmt == "parquet":
        raise JobError(f"{out}: Parquet is compressed inside the file; drop the .gz")


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
        raise JobError(f"{option('output', output)}: {where} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(output)}.tmp-", dir=where)
    except OSError as e:
        raise JobError(f"{option('output', output)}: cannot write in {where} ({e.strerror or e}); "
                       "choose a writable location") from None
    os.close(fd)
    os.unlink(probe)


def check_inputs(inputs: list[str], options: RunOptions, purpose: str = "process",
                 workers: Workers | None = None) -> Checked:
    """Read, validate and tokenize every row, with the model's tokenizer and config (no weights).
    `purpose`: "validate" keeps only the problems, "plan" also the prompt index, "process" also the
    jobs and the job set's digest. The first two never import torch (`tokenize.torch_hidden`), and
    tokenize a big input's plain rows in `workers` (else in `options.workers` of their own, if any)."""
    from batchgen.pipeline.model.load import load_config, model_source

    check_options(options)
    light = purpose != "process"
    _, source = model_source(options.model)
    with torch_hidden(light):
        config = load_config(options.model, options.trust_remote_code, runs_here=not options.served)
    window, vocab = context_window(config), vocab_size(config)
    tokenizer = Tokenizer.load(source, trust_remote_code=options.trust_remote_code, without_torch=light)
    check_default_constraint(tokenizer, options)
    # `process` keeps every job (on disk, for the engine): its rows all become Jobs here
    # a bad default or --adapter value fails here; a running server knows adapters by name only
    adapters = Adapters.of(options.adapters, config,
                           directory_refusal(parse_specs(options.adapters)[0]) if options.servers else None)
    rows = Rows(list(inputs), options, columnar=purpose != "process", adapters=adapters)
    refused = rows.refusal(rows.template) if rows.refusal is not None else None
    plain = PlainCheck(rows.template, window, generation_error(rows.template, tokenizer, vocab), refused)
    keep = _Keep(tokenizer, window, vocab, plain, adapters,
                 IndexBuilder(tokenizer.vocab_size) if purpose != "validate" else None,
                 JobSpool() if purpose == "process" else None, JobDigest() if purpose == "process" else None)
    own = workers is None and light and options.workers > 0
    if not light:
        workers = None  # `process` tokenizes in its thread (its jobs become Jobs; the model loads meanwhile)
    elif own:
        workers = Workers(options.workers)

    def remote(plain_rows: list[PlainRows]) -> Any:  # a chunk's plain rows in a worker
        return workers.submit(tokenize_in_worker, source, options.trust_remote_code,  # type: ignore[union-attr]
                              [r.prompts for r in plain_rows], keep.width, plain.template, window)

    ahead = workers.count + 1 if workers is not None else 1  # chunks in flight, each tokenizing while the next are read
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="batchgen-tokenize") as pool:
            pending: deque[tuple[Any, ...]] = deque()
            seen = 0
            for jobs, bad, plain_rows in rows.chunks():
                seen += sum(map(len, plain_rows))
                far = workers is not None and seen > MIN_WORKER_ROWS and plain_rows
                pending.append((jobs, bad, plain_rows, keep.submit(pool, remote if far else None, jobs, plain_rows)))
                while len(pending) > ahead:
                    keep(*pending.popleft())
            while pending:
                keep(*pending.popleft())
    except BaseException:
        if keep.spool is not None:
            keep.spool.close()
        if own:
            workers.close(now=True)  # type: ignore[union-attr]
        raise
    if own:
        workers.close()  # type: ignore[union-attr]
    index, digest = keep.index, keep.digest
    return Checked(rows.total, keep.invalid, np.frombuffer(keep.orders, dtype=np.int64),
                   index.build() if index is not None else None, keep.spool, rows.schema(), tokenizer,
                   digest.hexdigest() if digest is not None else None, keep.custom_ids, window, adapters,
                   keep.conversations)


class _Keep:
    """What the run keeps of each checked, tokenized chunk: its problems, its jobs' input positions
    (jobs are numbered in input order), and per purpose the prompt index, the spool, the digest."""

    def __init__(self, tokenizer: Tokenizer, window: int | None, vocab: int | None, plain: PlainCheck,
                 adapters: Adapters, index: IndexBuilder | None, spool: JobSpool | None,
                 digest: JobDigest | None) -> None:
        self.tokenizer, self.window, self.vocab, self.plain = tokenizer, window, vocab, plain
        self.adapters = adapters
        self.plain_adapter = adapters.index_of(plain.template)  # plain rows run the default
        self.index, self.spool, self.digest = index, spool, digest
        self.conversations = ConversationCounts()
        self.invalid = Problems()
        self.orders = array.array("q")
        self.custom_ids: dict[int, tuple[str, int]] = {}

    @property
    def width(self) -> int | None:
        return self.index.width if self.index is not None else None

    def submit(self, pool: ThreadPoolExecutor, remote: Callable[[list[PlainRows]], Any] | None,
               jobs: Mapping[int, Job], plain: list[PlainRows]) -> _Tokenized:
        """The jobs' tokens (in the tokenizer's thread) and the plain rows' counts and index entries
        (there too, or `remote`), to come."""
        general = pool.submit(tokenize_jobs, self.tokenizer, list(jobs.values()))
        counted = remote(plain) if remote is not None else pool.submit(
            tokenize_plain, self.tokenizer, plain, self.width, self.plain.template, self.window)
        return _Tokenized(general, counted)

    def __call__(self, jobs: dict[int, Job], bad: list[tuple[int, InvalidRow]], plain: list[PlainRows],
                 tokenized) -> None:
        general, counted = tokenized.result()
        kept: list[tuple[int, Job, JobTokens]] = []
        for (order, job), tokens in zip(jobs.items(), general):
            if self.digest is not None:  # the job set: every job that may run, tokenizable or not
                self.digest.add(order, job)
            problem = InvalidRow(job.location, job.id, str(tokens)) if isinstance(tokens, TokenizerError) \
                else token_problem(job, tokens, self.window) or generation_error(job, self.tokenizer, self.vocab,
                                                                             self.window)
            if problem is None:
                kept.append((order, job, tokens))
                continue
            bad.append((order, problem))
            if job.prompt_index is not None:
                self.custom_ids[order] = (job.custom_id, job.prompt_index)
        # kept jobs as columns: input positions and (for the index) their entries
        orders: list[np.ndarray] = [np.asarray([o for o, _, _ in kept], dtype=np.int64)]
        entries: list[Entries] = []
        if self.index is not None:  # the requests process will run (a scoring job's keyed by its context)
            found = [index_entry(j, t, self.window) for _, j, t in kept]
            entries.append(Entries.of(pack_keys([key for key, _ in found], self.index.width),
                                      [shapes for _, shapes in found], [self.adapters.index_of(j) for _, j, _ in kept]))
        for rows, (lengths, index) in zip(plain, counted):
            refused = self.plain.problems(rows, lengths)
            bad += [(rows.orders[k], problem) for k, problem in refused.items()]
            ok = np.asarray([k for k in range(len(rows)) if k not in refused], dtype=np.int64) if refused else None
            mine = np.asarray(rows.orders, dtype=np.int64)
            orders.append(mine[ok] if ok is not None else mine)
            if self.index is not None:
                index = index.take(ok) if ok is not None else index
                index.adapters = np.full(len(index), self.plain_adapter, np.int64) if self.plain_adapter else None
                entries.append(index)
        order = np.concatenate(orders)
        if kept and plain:  # both kinds in one chunk: back to input order
            by_order = np.argsort(order, kind="stable")
            order = order[by_order]
            entries = [Entries.concat(entries).take(by_order)] if entries else []
        self.invalid.add(bad)
        self.orders.frombytes(order.tobytes())
        if self.index is not None:
            for e in entries:
                self.index.add_entries(e)
        if self.spool is not None:
            self.spool.add([j for _, j, _ in kept])
        if self.index is not None:  # (`plan`, `process`)
            for _, job, tokens in kept:
                if job.then is not None:
                    self.conversations.add(job, len(tokens.ids), self.tokenizer)


@dataclass
class ConversationCounts:
    """The conversations among a run's jobs (pipeline/text/turns.py): how many, their samples'
    turns, and the prefill their later turns need at least: what each later prompt adds besides
    the replies, and each reply's last token (fed again: its logits start the next turn). The
    replies' other tokens were fed as they were generated, and are not prefilled again."""

    conversations: int = 0
    turns: int = 0  # generated turns, every sample's
    later_prefill_tokens: int = 0

    def add(self, job: Job, first: int, tokenizer: Tokenizer) -> None:
        from batchgen.pipeline.text.turns import full_length

        self.conversations += 1
        self.turns += job.turns * job.n
        self.later_prefill_tokens += job.n * (full_length(tokenizer, job) - first + job.turns - 1)

    def report(self) -> dict[str, int]:
        return {"conversations": self.conversations, "turns": self.turns,
                "later_turn_prefill_tokens": self.later_prefill_tokens}


@dataclass
class _Tokenized:
    general: Future
    counted: Any  # a Future, or a worker's `workers.Answer`

    def result(self) -> tuple[Any, Any]:
        return self.general.result(), self.counted.result()


class JobDigest:
    """A hash of the job set: every job that may run (tokenizable or not) with its input position,
    prompt, parameters and carried columns, in input order (`parts.job_set_key` adds the settings)."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)

    def add(self, order: int, job: Job) -> None:
        item = [order, job.id, job.prompt, job.messages, job.extra, job.generation(), job.custom_id, job.prompt_index]
        if job.adapter is not None:  # (the digests of job sets without adapters stay what they were)
            item.append(job.adapter)
        if job.then is not None:  # (likewise those without conversations)
            item.append(["then", job.then])
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
    # the elements of a list prompt share their request's id: each draws its own samples
    key = job.id if job.prompt_index is None else (job.id, job.prompt_index)
    digest = hashlib.blake2b(f"{run_seed or 0}:{key!r}".encode(), digest_size=8).digest()
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
                  run_seed: int | None, vocab: int | None = None, adapter: int = 0) -> list[Request] | InvalidRow:
    """A job's requests (pipeline/text/expand.py), with its adapter's index, or why it cannot run."""
    problem = token_problem(job, tokens, window) or generation_error(job, tokenizer, vocab, window)
    if problem is not None:
        return problem
    return job_requests(order, job, tokens, tokenizer, window, job_seed(run_seed, job), adapter)


def check_default_constraint(tokenizer: Tokenizer, options: RunOptions) -> None:
    """A bad default constraint (--json-schema and the like) fails once, before any row."""
    default = options.defaults.constraint
    if default is not None:
        from batchgen.pipeline.text.grammar import GrammarError

        try:
            tokenizer.grammars.check(default)
        except GrammarError as e:
            raise OptionError(default.source or default.kind, f"cannot be used: {e}") from None


def generation_error(job: Job, tokenizer: Tokenizer, vocab: int | None = None,
                     window: int | None = None) -> InvalidRow | None:
    """What the tokenizer refuses of a job's generation parameters: token ids (logit_bias,
    stop_token_ids) outside the model's vocabulary, a constraint that does not compile for it; a
    conversation whose later turns do not render, or may outgrow the context `window`."""
    vocab = min(tokenizer.vocab_size, vocab or tokenizer.vocab_size)
    for name, ids in (("logit_bias", [t for t, _ in job.logit_bias]), ("stop_token_ids", job.stop_token_ids)):
        outside = [t for t in ids if t >= vocab]
        if outside:
            return InvalidRow(job.location, job.id, f"field '{name}' names token id {outside[0]}, outside the "
                                                    f"model's vocabulary of {vocab} tokens")
    if job.then is not None:
        from batchgen.pipeline.text.turns import conversation_problem

        problem = conversation_problem(tokenizer, job, window)
        if problem is not None:
            return InvalidRow(job.location, job.id, problem)
    if job.constraint is not None:
        from batchgen.pipeline.text.grammar import GrammarError

        try:
            tokenizer.grammars.check(job.constraint)
        except GrammarError as e:
            return InvalidRow(job.location, job.id, f"field '{job.constraint.source or job.constraint.kind}' "
                                                    f"cannot be used: {e}")
    return None

