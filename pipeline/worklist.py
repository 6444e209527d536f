"""The planned work as the engine consumes it, letting waiting rows join a batch in flight.

The schedule is a fixed order of prefills, batches and releases. When rows of the batch in
flight finish, the rows planned next may take their slots (continuous batching): the engine
asks for rows that fit, and the list hands them out in plan order, running the prefills they
need on the way and holding back the release of any prefix that rows in flight still read.
Pure Python: the engine passes in how to prefill, release and check a fit.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Collection, Iterable

from pipeline.schedule import Batch, Op, Prefill, Release, Row


class WorkList:
    def __init__(self, ops: Iterable[Op]) -> None:
        self._ops: deque[Op] = deque(ops)
        self._held: list[Release] = []  # releases of prefixes the batch in flight still reads

    def pop(self) -> Op | None:
        return self._ops.popleft() if self._ops else None

    def peek_rows(self, limit: int) -> list[Row]:
        """Up to `limit` rows of the batches planned next (which may join the one in flight)."""
        out: list[Row] = []
        for op in self._ops:
            if isinstance(op, Batch):
                out += op.rows[: limit - len(out)]
                if len(out) >= limit:
                    break
        return out

    def take(
        self,
        free: int,
        fits: Callable[[list[Row]], bool],
        in_use: Collection[int | None],
        prefill: Callable[[Prefill], None],
        release: Callable[[int], None],
    ) -> list[Row]:
        """Rows for `free` slots of the batch in flight, in plan order, while `fits(chosen)` and
        their samples fit. Prefills met on the way run now; a release of a prefix in `in_use` (read
        by unfinished rows of the batch in flight, including rows a failed batch will rerun) or of a
        chosen row is held, and runs at a later call once its prefix is out of use, or at the
        batch's end."""
        for op in [op for op in self._held if op.node not in in_use]:  # its last reader finished
            self._held.remove(op)
            release(op.node)
        chosen: list[Row] = []
        while self._ops and free > 0:
            op = self._ops[0]
            if isinstance(op, Prefill):
                prefill(op)  # first: if it fails, the op is still there to run
                self._ops.popleft()
                continue
            if isinstance(op, Release):
                self._ops.popleft()
                if op.node in in_use or any(r.node == op.node for r in chosen):
                    self._held.append(op)
                else:
                    release(op.node)
                continue
            row = op.rows[0]
            # whole rows only: a request's samples share one suffix prefill
            if len(row.samples) > free or not fits(chosen + [row]):
                break
            chosen.append(row)
            free -= len(row.samples)
            if len(op.rows) > 1:
                self._ops[0] = Batch(op.rows[1:])
            else:
                self._ops.popleft()
        return chosen

    def end_batch(self) -> None:
        """The batch in flight is over: the releases it held run next."""
        self._ops.extendleft(reversed(self._held))
        self._held = []
