"""The whole job set in memory, for the Python API: jobs by input position, requests in a list.

The CLI's runner streams (`preflight.check_inputs`: chunks into a prefix index and a spool); an
API call holds its jobs already, so it checks them here with the same per-job checks
(`preflight.make_requests`: pipeline/text/expand.py's requests of a job), in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import pyarrow as pa

from batchgen.jobs import InvalidRow, Job, id_type_for, infer_extra_schema, result_schema
from batchgen.jobs.writers import outputs_of
from batchgen.pipeline.text.expand import completions_expected, tokenize_jobs
from batchgen.pipeline.run.inputrows import check_extras, refusal, refused
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
