"""The whole job set in memory, for the Python API: jobs by input position, requests in a list.

The CLI's runner streams (`preflight.check_inputs`: chunks into a prefix index and a spool); an
API call holds its jobs already, so it checks them here with the same per-job checks
(`preflight.make_requests`: pipeline/text/expand.py's requests of a job), in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pyarrow as pa

from batchgen.jobs import InvalidRow, Job, id_type_for, infer_extra_schema, result_schema
from batchgen.jobs.writers import outputs_of
from batchgen.pipeline.text.expand import completions_expected, order_of, tokenize_jobs
from batchgen.pipeline.run.inputrows import check_extras, refusal, refused
from batchgen.pipeline.run.prefix_index import PrefixIndex
from batchgen.pipeline.run.preflight import check_default_constraint, context_window, make_requests, vocab_size
from batchgen.pipeline.text.tokenize import Tokenizer, TokenizerError
from batchgen.pipeline.engine.types import Request

if TYPE_CHECKING:
    from batchgen.pipeline.run.adapters import Adapters
    from batchgen.pipeline.run.options import RunOptions


@dataclass
class Loaded:
    """Checked, tokenized jobs held whole."""

    jobs: dict[int, Job]  # every row that is a valid job, by input position (the job set)
    invalid: dict[int, InvalidRow]  # every row that cannot run, with where and why
    requests: list[Request]  # the jobs that run, tokenized (one or several requests each)
    expected: dict[int, int]  # completions that finish each job that runs (pipeline/text/expand.py)
    schema: pa.Schema  # the result schema
    tokenizer: Tokenizer


def checked_rows(jobs: dict[int, Job], invalid: dict[int, InvalidRow], hint: pa.Schema | None,
                 options: RunOptions, adapters: Adapters | None = None
                 ) -> tuple[dict[int, Job], dict[int, InvalidRow], pa.Schema]:
    """Rows read in memory and the types of typed inputs: the rows whose carried columns cannot
    be written, or whose adapter cannot run, move to `invalid`; and the result schema."""
    extra_schema = infer_extra_schema((j.extra for j in jobs.values()), hint)
    for order, bad in check_extras(jobs, extra_schema).items():
        invalid[order] = bad
        del jobs[order]
    created = options.output_format == "openai"  # each request's completion time, kept in the rows
    refuses = refusal(options)
    for check in (refuses, adapters.check if adapters is not None else None):
        if check is None:
            continue
        for order, bad in refused(jobs, check).items():
            invalid[order] = bad
            del jobs[order]
    outputs = set().union(*(outputs_of(j) for j in jobs.values()))
    return jobs, invalid, result_schema(extra_schema, id_type_for(j.id for j in jobs.values()), created, outputs)


def tokenized(jobs: dict[int, Job], invalid: dict[int, InvalidRow], schema: pa.Schema, tokenizer: Tokenizer,
              config: Any, options: RunOptions, adapters: Adapters | None = None) -> Loaded:
    """Checked rows (their adapters resolved by `adapters`) made requests with the model's
    tokenizer and config; what cannot run joins `invalid`."""
    check_default_constraint(tokenizer, options)
    requests, expected, bad = to_requests(jobs, tokenizer, context_window(config), options.defaults.seed,
                                          vocab_size(config), adapters)
    invalid.update(bad)
    return Loaded(jobs, dict(sorted(invalid.items())), requests, expected, schema, tokenizer)


def in_prefix_order(loaded: Loaded) -> tuple[list[Request], PrefixIndex, np.ndarray]:
    """The requests as the runner hands a server a window's (one window: the jobs are held whole):
    each job's requests together, jobs in the prefix index's sorted order, so a prefix group's
    requests reach the server together; with the index and each of its jobs' input position
    (`orders`), from which `executors.groups_to_servers` gives each job its server."""
    by_job: dict[int, list[Request]] = {}
    for r in loaded.requests:
        by_job.setdefault(order_of(r.key), []).append(r)
    orders = np.array(sorted(by_job), dtype=np.int64)
    firsts = [by_job[int(o)][0] for o in orders]  # a job's requests all share up to the same node (index_entry)
    index = PrefixIndex.of([r.prompt_ids[: r.shared_len + 1] for r in firsts], vocab_size=loaded.tokenizer.vocab_size,
                           requests=[[r.shape for r in by_job[int(o)]] for o in orders])
    return [r for number in index.order.tolist() for r in by_job[int(orders[number])]], index, orders


def to_requests(jobs: Mapping[int, Job], tokenizer: Tokenizer, window: int | None, run_seed: int | None,
                vocab: int | None = None, adapters: Adapters | None = None
                ) -> tuple[list[Request], dict[int, int], dict[int, InvalidRow]]:
    """Tokenize the jobs in one batch (keyed by input position): their requests, the completions
    that finish each, and the jobs that cannot run as error rows, never a crash."""
    requests: list[Request] = []
    expected: dict[int, int] = {}
    invalid: dict[int, InvalidRow] = {}
    for (order, job), tokens in zip(jobs.items(), tokenize_jobs(tokenizer, list(jobs.values()))):
        made = InvalidRow(job.location, job.id, str(tokens)) if isinstance(tokens, TokenizerError) \
            else make_requests(order, job, tokens, tokenizer, window, run_seed, vocab,
                               adapters.index_of(job) if adapters is not None else 0)
        if isinstance(made, InvalidRow):
            invalid[order] = made
        else:
            requests += made
            expected[order] = completions_expected(made)
    return requests, expected, invalid
