"""Memory pressure in a pass: a step that does not fit the device's memory is retried smaller.
Suffix chunks shrink first; then the newest half of the samples in flight go back to the queue,
each to rerun alone from its start, exactly (its generator restarts with it). A mixin of
`loop.Pass`, which owns the slots and the queue.
"""
from __future__ import annotations

from collections import deque

import torch

from batchgen.pipeline.engine.rows import Fill, Live
from batchgen.pipeline.engine.sampling import row_state
from batchgen.pipeline.engine.schedule import Row
from batchgen.pipeline.model.kv import RowKV


class MemoryPressure:
    """`Pass`'s answer to an out-of-memory step."""

    def _shrink(self, queue: deque, kv: RowKV, filling: list[Fill], running: list[Live], limit: int, fed: int):
        """The step did not fit: smaller suffix chunks first; then the newest half of the samples in
        flight go back to the front of the queue, each to rerun alone from its start (its generator
        restarts with it), and fewer slots are used. A lone sample that still does not fit fails
        alone. Returns the new limit on slots in use."""
        release_memory(self.device)
        if fed > 16:  # prefill tokens beside the decoding rows
            self.step_tokens = max(16, min(self.step_tokens, len(running) + fed) // 2)
            return limit
        # oldest first: rows decoding, then fills in admission order; a fill stands for its samples
        flight = [(r.row, [r.sample], [r.slot]) for r in running] + [(f.row, list(f.row.samples), f.slots)
                                                                     for f in filling]
        in_use = kv.in_use()
        if in_use <= 1:
            row, samples, slots = flight[0]
            filling.clear()
            running.clear()
            request = self.requests[row.key]
            state = row_state(request.params, 0, samples[0], self.device)
            yield self._finish(Live(row, request, samples[0], slots[0], state), kv, "error", "out of memory")
            return 1
        kept, used = 0, 0
        while kept < len(flight) and used + len(flight[kept][2]) <= in_use // 2:
            used += len(flight[kept][2])
            kept += 1
        evicted = flight[kept:]
        for _, _, slots in evicted:
            for slot in slots:
                kv.free(slot)
        queue.extendleft(reversed([Row(row.key, range(s, s + 1), row.prefix, row.cached, row.anchor, row.anchored)
                                   for row, samples, _ in evicted for s in samples]))
        gone = {slot for _, _, slots in evicted for slot in slots}
        running[:] = [r for r in running if r.slot not in gone]
        filling[:] = [f for f in filling if f.slots[0] not in gone]
        return max(1, used)


def release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
