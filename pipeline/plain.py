"""What `validate` and `plan` keep of plain rows (jobs/chunks.py), checked in columns.

A plain row is a valid job whose every field but its id and prompt is the run's default, so of
the checks preflight makes after tokenizing (`expand.token_problem`, `preflight.generation_error`)
only the prompt's length differs from row to row. Here the lengths are compared to what those
checks refuse in one numpy expression; the rows it picks (a superset: none of a normal file) are
made into Jobs and asked the reference checks themselves, so a refused row gets exactly the
message, location and id that `process` reports. The generation check depends only on the
defaults: it is asked once, of a plain job of those defaults.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from jobs import InvalidRow, Job
from jobs.chunks import PlainRows
from pipeline.expand import length_problem
from pipeline.prefix_index import pack_keys
from pipeline.tokenize import Tokenizer


def tokenize_plain(tokenizer: Tokenizer, plain: list[PlainRows], width: int | None
                   ) -> list[tuple[np.ndarray, list[bytes] | None]]:
    """Per group of plain rows: each prompt's token count and, with `width`, its prefix index key
    (`prefix_index.pack_keys`), packed a batch at a time as it is tokenized."""
    out = []
    for rows in plain:
        keys: list[bytes] | None = [] if width is not None else None
        keep: Callable | None = None if keys is None else (lambda ids, keys=keys: keys.extend(pack_keys(ids, width)))
        lengths = tokenizer.encode_texts(rows.prompts, True, keep)  # a prompt gets the special tokens
        out.append((np.asarray(lengths, dtype=np.int64), keys))
    return out


class PlainCheck:
    """The checks after tokenizing, for plain rows of the run's defaults (`template`)."""

    def __init__(self, template: Job, window: int | None, general: InvalidRow | None) -> None:
        self.template, self.window = template, window
        # generation_error of a plain job: the same for every plain row (its reason, if any)
        self.general = general.reason if general is not None else None

    def problems(self, rows: PlainRows, lengths: np.ndarray) -> dict[int, InvalidRow]:
        """The rows (by index in `rows`) that cannot run, and why."""
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
