"""The whole job set in memory, for the Python API: jobs by input position, requests in a list.

The CLI's runner streams (`preflight.check_inputs`: chunks into a prefix index and a spool); an
API call holds its jobs already, so it checks them here with the same per-job checks
(`preflight.prompt_problem`, `generation_error`, `make_request`), in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import pyarrow as pa

from jobs import InvalidRow, Job, id_type_for, infer_extra_schema, result_schema
from pipeline.preflight import check_default_constraint, check_extras, context_window, make_request, vocab_size
from pipeline.tokenize import Tokenizer, TokenizerError
from pipeline.types import Request

if TYPE_CHECKING:
    from pipeline.runner import RunOptions


@dataclass
class Loaded:
    """Checked, tokenized jobs held whole."""

    jobs: dict[int, Job]  # every row that is a valid job, by input position (the job set)
    invalid: dict[int, InvalidRow]  # every row that cannot run, with where and why
    requests: list[Request]  # the jobs that run, tokenized
    schema: pa.Schema  # the result schema
    tokenizer: Tokenizer


def checked_rows(jobs: dict[int, Job], invalid: dict[int, InvalidRow], hint: pa.Schema | None,
                 options: RunOptions) -> tuple[dict[int, Job], dict[int, InvalidRow], pa.Schema]:
    """Rows read in memory and the types of typed inputs: the rows whose carried columns cannot
    be written move to `invalid`; and the result schema."""
    extra_schema = infer_extra_schema((j.extra for j in jobs.values()), hint)
    for order, bad in check_extras(jobs, extra_schema).items():
        invalid[order] = bad
        del jobs[order]
    created = options.output_format == "openai"  # each request's completion time, kept in the rows
    return jobs, invalid, result_schema(extra_schema, id_type_for(j.id for j in jobs.values()), created)


def tokenized(jobs: dict[int, Job], invalid: dict[int, InvalidRow], schema: pa.Schema, tokenizer: Tokenizer,
              config: Any, options: RunOptions) -> Loaded:
    """Checked rows made requests with the model's tokenizer and config; what cannot run joins
    `invalid`."""
    check_default_constraint(tokenizer, options)
    requests, bad = to_requests(jobs, tokenizer, context_window(config), options.defaults.seed, vocab_size(config))
    invalid.update(bad)
    return Loaded(jobs, dict(sorted(invalid.items())), requests, schema, tokenizer)


def to_requests(jobs: Mapping[int, Job], tokenizer: Tokenizer, window: int | None,
                run_seed: int | None, vocab: int | None = None) -> tuple[list[Request], dict[int, InvalidRow]]:
    """Tokenize the jobs in one batch (keyed by input position); a job that cannot run becomes an
    error row, never a crash."""
    requests, invalid = [], {}
    encoded = tokenizer.encode_many([j.prompt for j in jobs.values()], [j.messages for j in jobs.values()])
    for (order, job), ids in zip(jobs.items(), encoded):
        made = InvalidRow(job.location, job.id, str(ids)) if isinstance(ids, TokenizerError) \
            else make_request(order, job, ids, tokenizer, window, run_seed, vocab)
        if isinstance(made, InvalidRow):
            invalid[order] = made
        else:
            requests.append(made)
    return requests, invalid
