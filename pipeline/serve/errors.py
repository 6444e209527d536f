"""The served runs' errors, apart from the client so that the runner can catch them without
importing httpx (a run on batchgen's own engine never does)."""
from __future__ import annotations

from batchgen.jobs.errors import BatchgenError


class ServerUnreachable(BatchgenError):
    """A server stayed unreachable (or kept failing with 429/5xx): the run stops, resumable."""


class ServerAnswerError(BatchgenError):
    """A server answered in a shape batchgen cannot use (no token ids, say): not resumable."""
