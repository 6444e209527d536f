"""One run of the engine over a plan: prefill each shared prefix once, then run rows through
batches of slots.

Correct by construction for prompts that are wholly shared: the tree holds each request's tokens
minus the last one it runs, so every row feeds at least that token itself and samples its first
new token (or scores its last prompt token) from that position's logits; positions continue
exactly from the prefix it reads. Prompt tokens that rows score and that lie in a cached prefix
are scored once, as the prefix is prefilled (its logits there are the same for every row below).

The loop, top to bottom (gpt-fast's generate.py, with vLLM v1's flat token layout):
    for each batch shape of the plan:
        while rows are waiting or in flight:
            admit    rows planned next take free slots (their prefixes are prefilled first, with
                     those of the rows next in line: one forward, not one per admission)
            forward  one token per decoding row + chunks of admitted rows' suffixes, no padding
            sample   the next token of every row that has logits
            finish   finished rows leave their slots and drop their prefixes' reference counts
A cached prefix lives while its reference count (unfinished rows that read it or a prefix below
it) is above zero, in the run's one `PrefixCache`: one mechanism for every prefix's lifetime.

Everything here lives for one run (`Pass`): the engine keeps its configuration and its counters.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from itertools import islice
from typing import Callable, Iterator, Protocol, Sequence

import torch

from batchgen.pipeline.model import native
from batchgen.pipeline.model.kv import LayerShape, RowKV
from batchgen.pipeline.engine import prefix_fill
from batchgen.pipeline.engine.prefix_cache import PrefixCache
from batchgen.pipeline.engine.prefix_fill import Cached, PrefixFill
from batchgen.pipeline.engine.prefix_scores import PrefixScores
from batchgen.pipeline.engine.pressure import MemoryPressure
from batchgen.pipeline.engine.rows import Fill, Live, Wanted, record_logprobs, token_scores
from batchgen.pipeline.engine.sampling import row_state, sample
from batchgen.pipeline.engine.schedule import Plan, Row
from batchgen.pipeline.model.step import Decode, Segment, StaticDecode, Step, build
from batchgen.pipeline.engine.turns import Conversations, Turn, carry_point, root_of
from batchgen.pipeline.engine.types import Completion, Request, RunStats, TurnError


class EngineView(Protocol):
    """What a pass reads of its engine (`engine.Engine`): the configuration, the counters, the forward."""

    device: torch.device
    dtype: torch.dtype
    layers: list[LayerShape]
    eos: frozenset[int]
    join: bool
    static_decode: bool
    default_seed: int
    step_tokens: int
    stats: RunStats

    def forward(self, step: Step, keep: list[int]) -> torch.Tensor: ...


class Pass(PrefixFill, MemoryPressure):
    """One `Engine.run`: its requests, its plan, its prefixes and its step size (halved on
    out-of-memory for the rest of this run only)."""

    def __init__(self, engine: EngineView, requests: Sequence[Request], plan: Plan,
                 conversations: Conversations | None = None, first: bool = True) -> None:
        self.engine, self.stats = engine, engine.stats
        self.device, self.dtype, self.layers = engine.device, engine.dtype, engine.layers
        self.eos, self.join, self.static_decode = engine.eos, engine.join, engine.static_decode
        self.default_seed = engine.default_seed
        self.step_tokens = engine.step_tokens  # tokens per forward; halves on out-of-memory
        self.requests = {r.key: r for r in requests}
        # a conversation's later turn rerun in this pass (`turns.py`) is its sample's, as seeded
        plan.rows = [replace(r, samples=range(r.key.sample, r.key.sample + 1)) if isinstance(r.key, Turn) else r
                     for r in plan.rows]
        self.plan = plan
        self.conversations = conversations or Conversations()
        self.later: list[Request] = []  # conversations' turns that did not fit their slots: the next pass's
        self.prefixes: PrefixCache[Cached] = PrefixCache(plan.prefixes, self._new_prefix)
        self.scores = PrefixScores(plan, self.requests, self.prefixes)  # prompt logprobs kept on prefixes
        for r in requests:
            self.stats.jobs += first
            self.stats.rows += r.params.n if first else 0
            self.stats.prompt_tokens += len(r.prompt_ids) if first else 0  # (a later turn: counted as it was made)

    def run(self, should_stop: Callable[[], bool]) -> Iterator[Completion]:
        """Yield every sample of every request as it finishes; return early once `should_stop()`."""
        for row in self.plan.rows:  # a row holds its prefix, and every one above it, until it finishes
            if row.prefix is not None:
                self.prefixes.lock(row.prefix, len(row.samples))
        for shape in self.plan.batches:
            queue = deque(self.plan.rows[shape.start : shape.end])
            stopped = yield from self._run_batch(queue, shape.slots, shape.capacity, should_stop)
            if stopped:
                return

    # -- one batch of slots ---------------------------------------------------------------

    def _run_batch(self, queue: deque, slots: int, capacity: int, should_stop):
        """Run rows through `slots` slots of `capacity` own tokens until the queue is empty. Yields
        completions; returns True if stopped."""
        kv = RowKV(self.layers, slots, capacity, self.dtype, self.device)
        static = StaticDecode(kv, self.device) if self.static_decode else None
        self.stats.batches += 1
        self.stats.cascade_batches += any(r.anchor is not None for r in queue)
        filling: list[Fill] = []
        running: list[Live] = []
        limit = slots  # slots in use at most: lowered on out-of-memory
        while queue or filling or running:
            if should_stop():
                return True
            busy = bool(filling or running)
            if self.join or not busy:
                admitted = self._admit(queue, kv, filling, limit)
                self.stats.admitted_rows += admitted if busy else 0  # joined rows in flight
            step, want = self._layout(running, filling, kv, static)
            try:
                logits = self.engine.forward(step, want.keep)  # (want.keep, V)
            except torch.OutOfMemoryError:
                self.stats.oom_splits += 1
                limit = yield from self._shrink(queue, kv, filling, running, limit, step.tokens - step.n_dec)
                continue
            self._commit(step, kv, filling, running)
            first = want.first
            self._score(logits[want.decode + len(first) :], want.scored)
            for f in want.done:
                if not f.generates:  # a scoring row is done once its prompt is in
                    yield self._scored(f, kv)
            # a fill's samples share its last logits
            index = list(range(want.decode)) + [want.decode + i for i, f in enumerate(first) for _ in f.slots]
            running += self._fork(first, kv)
            yield from self._sample(logits[index], running, kv, filling)
        return False

    def _admit(self, queue: deque, kv: RowKV, filling: list[Fill], limit: int) -> int:
        """Rows planned next take free slots, in plan order, whole requests only (a request's samples
        share one suffix prefill); prefixes they need are prefilled first, and along with them those
        the rows next in line for slots will read (`PrefixCache.with_upcoming`). Returns samples admitted."""
        rows, free = [], limit - kv.in_use()
        if queue and free == limit and len(queue[0].samples) > free:  # more samples than slots left: split
            head = queue.popleft()
            cut = head.samples.start + free
            queue.extendleft([replace(head, samples=range(cut, head.samples.stop)),
                              replace(head, samples=range(head.samples.start, cut))])
        for row in queue:
            if len(row.samples) > free:
                break
            rows.append(row)
            free -= len(row.samples)
        upcoming = (r.prefix for r in islice(queue, len(rows), len(rows) + limit))  # the rows that take slots next
        self._prefill_prefixes(self.prefixes.with_upcoming({r.prefix for r in rows if r.prefix is not None},
                                                           upcoming, self.step_tokens))
        for _ in rows:
            queue.popleft()
        # neighbouring slots get rows of similar length: each decode attention call reads only as
        # far as the longest row of its run of slots
        for row in sorted(rows, key=self._extent):
            slots = kv.take(len(row.samples))
            if row.cached > row.anchored:  # a short nested prefix: its keys/values join the row's own
                kv.copy_in(slots[0], self.prefixes[row.prefix].kv, row.anchored, row.cached)
            request = self.requests[row.key]
            scores, greedy = self.scores.read(row, request)  # of its prompt tokens its prefixes hold
            filling.append(Fill(row, request, slots, scores=scores, greedy=greedy))
        return sum(len(r.samples) for r in rows)

    def _extent(self, row: Row) -> int:
        """Own tokens a row holds at most (`Plan.extent`; a conversation's later turn: its own)."""
        if row.key in self.plan.shapes:
            return self.plan.extent(row)
        q = self.requests[row.key]
        return len(q.prompt_ids) - row.anchored + q.params.max_new_tokens + q.reserve

    def _layout(self, running: list[Live], filling: list[Fill], kv: RowKV,
                static: StaticDecode | None) -> tuple[Step, Wanted]:
        """This step: a token per decoding row, then suffix chunks, oldest fill first, up to
        step_tokens tokens and SCORED_ROWS scored positions in all; and the logits it wants."""
        decode = [Decode(r.slot, r.row.anchored, self.prefixes[r.row.anchor].kv if r.row.anchor is not None else None,
                         adapter=r.request.adapter) for r in running]
        if static is not None and not filling:  # a decode step: token i is slot i's
            step = static.build(decode, [r.tokens[-1] for r in running])
            return step, Wanted(len(running), keep=[r.slot for r in running])
        budget, room = max(1, self.step_tokens - len(running)), prefix_fill.SCORED_ROWS
        chunks, want, scoring = [], Wanted(len(running)), []
        for f in filling:
            start = f.row.cached + f.fed
            n = min(budget, len(f.suffix) - f.fed)
            scored = f.scored(start, start + n)
            if len(scored) > room:  # its logits would not fit: this step scores only what does
                n = scored.start - start + room
                scored = f.scored(start, start + n)
            if n <= 0:
                continue
            anchor = self.prefixes[f.row.anchor].kv if f.row.anchor is not None else None
            seg = Segment(0, 0, kv.k, kv.v, f.slots[0], kv.lens[f.slots[0]], f.row.anchored, anchor,
                          adapter=f.request.adapter)
            chunks.append((seg, f.suffix[f.fed : f.fed + n]))
            scoring.append((f, seg, start, scored))
            budget, room = budget - n, room - len(scored)
            if f.fed + n == len(f.suffix):
                want.done.append(f)
            if budget <= 0:
                break
        step = build(decode, [r.tokens[-1] for r in running], chunks, kv, self.device)
        last = {seg.index: seg.t1 - 1 for seg, _ in chunks}
        want.keep = list(range(len(running))) + [last[f.slots[0]] for f in want.first]
        for f, seg, start, scored in scoring:
            want.keep += [seg.t0 + p - start for p in scored]
            want.scored += [(f, f.request.prompt_ids[p + 1]) for p in scored]
        return step, want

    def _commit(self, step: Step, kv: RowKV, filling: list[Fill], running: list[Live]) -> None:
        """The forward succeeded: what it wrote now counts; fills whose suffix is in leave `filling`."""
        for r in running:
            kv.advance(r.slot)
        fed = {s.index: s.t1 - s.t0 for s in step.segments}
        for f in filling:
            n = fed.get(f.slots[0], 0)
            kv.advance(f.slots[0], n)
            f.fed += n
        filling[:] = [f for f in filling if f.fed < len(f.suffix)]
        self.stats.prefill_tokens += sum(s.t1 - s.t0 for s in step.segments)
        self.stats.decode_steps += bool(running)

    def _score(self, logits: torch.Tensor, scored: list[tuple[Fill, int]]) -> None:
        """Each scored prompt token's logprob given all before it, and whether it was the argmax."""
        if not scored:
            return
        _, chosen, greedy = token_scores(logits, [t for _, t in scored])
        for (f, _), lp, g in zip(scored, chosen, greedy):
            f.scores.append(lp)
            f.greedy.append(g)

    def _scored(self, f: Fill, kv: RowKV) -> Completion:
        """A scoring row is done: its slot frees and its prefixes drop a reference."""
        for slot in f.slots:
            kv.free(slot)
        self._release(f.row, len(f.row.samples))
        self.stats.cached_tokens += f.row.cached
        return Completion(f.request.key, f.row.samples.start, [], "scored", len(f.request.prompt_ids), f.row.cached,
                          prompt_logprobs=f.scores, prompt_greedy=f.greedy)

    def _fork(self, done: list[Fill], kv: RowKV) -> list[Live]:
        """Fills whose suffix is in: each sample gets a slot holding the same keys and values."""
        out = []
        for f in done:
            if len(f.slots) > 1:
                kv.fork(f.slots[0], f.slots[1:])
            q = f.request
            seed = q.params.seed if q.params.seed is not None else self.default_seed
            for s, slot in zip(f.row.samples, f.slots):
                out.append(Live(f.row, q, s, slot, row_state(q.params, seed, s, self.device, q, self.eos),
                                [] if q.params.logprobs is not None else None,
                                f if q.score_from is not None else None))
        return out

    def _sample(self, logits: torch.Tensor, running: list[Live], kv: RowKV, filling: list[Fill]) -> Iterator[Completion]:
        """The next token of every running row (logits (len(running), V), in order); finished rows
        leave (a conversation's sample goes on in its slot with its next turn: `filling`)."""
        # one pass: each row's argmax, and whether a NaN or inf shows (a float16 sum overflows)
        fast = native.greedy(logits)
        if fast is None:
            low, high = torch.aminmax(logits, dim=-1)
            finite, greedy = (torch.isfinite(low) & torch.isfinite(high)).tolist(), None
        else:
            greedy, finite = fast
        chosen = sample(logits, [r.state for r in running], greedy)  # (B,)
        record_logprobs(logits, chosen, running)
        tokens = chosen.tolist()
        keep = []
        for r, tok, ok in zip(running, tokens, finite):
            if not ok:
                yield self._finish(r, kv, "error", "non-finite logits")
                continue
            if r.state.error is not None:  # no token can continue it (a grammar's dead end): it fails alone
                yield self._finish(r, kv, "error", r.state.error)
                continue
            r.state.accept(tok)
            if r.state.error is not None:  # its grammar's text is complete before min_tokens
                yield self._finish(r, kv, "error", r.state.error)
                continue
            reason = self._finish_reason(r, tok)
            if reason and r.request.next_turn is not None:
                done = self._next_turn(r, kv, reason, filling)
                if done is not None:
                    yield done
            elif reason:
                yield self._finish(r, kv, reason)
            else:
                keep.append(r)
        running[:] = keep

    def _finish_reason(self, row: Live, token: int) -> str | None:
        if token in self.eos or token in row.request.params.stop_token_ids or row.state.finished:
            return "stop"  # EOS, a stop token, or a grammar that is complete and allows nothing more
        if row.request.stop is not None and row.request.stop(row.tokens):
            return "stop"
        if len(row.tokens) >= row.request.params.max_new_tokens:
            return "length"
        return None

    def _finish(self, r: Live, kv: RowKV | None, reason: str, error: str | None = None) -> Completion:
        """A sample is done: its slot frees, and its prefixes drop a reference (freed at zero)."""
        if kv is not None:
            kv.free(r.slot)
        self._release(r.row, 1)
        return self.conversations.last(r.request, self._completion(r, reason, error))

    def _completion(self, r: Live, reason: str, error: str | None = None) -> Completion:
        """A sample's turn as it ends (under its request's own key and sample index), counted."""
        self.stats.completion_tokens += len(r.tokens)
        if r.sample == 0 and not isinstance(r.request.key, Turn):  # once per job, and not again if an
            self.stats.cached_tokens += r.row.cached  # out-of-memory retry reruns it; a later turn is not a job
        key, sample = root_of(r.request.key, r.sample)
        return Completion(key, sample, r.tokens, reason, len(r.request.prompt_ids), r.row.cached, error,
                          logprobs=r.logprobs, prompt_logprobs=r.prompt.scores if r.prompt else None,
                          prompt_greedy=r.prompt.greedy if r.prompt else None)

    def _next_turn(self, r: Live, kv: RowKV, reason: str, filling: list[Fill]) -> Completion | None:
        """A conversation's sample ended a turn: its next turn keeps the slot's keys and values up to
        where its prompt parts from them and prefills the rest there (`turns.py`), or, where it does
        not fit the slot, reruns in the next pass. Returns the sample's completion, with all its
        turns, when this was its last (or the next could not be made)."""
        q = r.request
        done = self._completion(r, reason)
        root = (done.key, done.sample_index)
        try:
            nxt = q.next_turn(done.sample_index, list(r.tokens), reason)
        except TurnError as e:
            nxt, done.finish_reason, done.error = None, "error", str(e)
        if nxt is None:
            kv.free(r.slot)
            self._release(r.row, 1)
            return self.conversations.last(q, done)
        self.conversations.record(root, done)
        nxt = self.conversations.keyed(root, nxt)
        self.requests[nxt.key] = nxt
        self.stats.turns += 1
        self.stats.prompt_tokens += len(nxt.prompt_ids)
        row = Row(nxt.key, range(r.sample, r.sample + 1), r.row.prefix, r.row.cached, r.row.anchor, r.row.anchored)
        held = q.prompt_ids[: q.fed_len] + r.tokens[:-1]  # what the slot holds (the last token was never fed)
        if kv.lens[r.slot] != len(held) - row.anchored:
            raise AssertionError(f"slot {r.slot} holds {kv.lens[r.slot]} tokens, its row {len(held) - row.anchored}")
        keep = carry_point(held, nxt.prompt_ids)
        own = len(nxt.prompt_ids) - row.anchored + nxt.params.max_new_tokens  # its slot's tokens at most this turn
        if keep < row.cached or own > kv.capacity:  # it parts in its shared prefix, or outgrows the slot
            kv.free(r.slot)
            self._release(r.row, 1)
            self.stats.turn_reruns += 1
            self.later.append(nxt)
            return None
        kv.cut(r.slot, keep - row.anchored)
        self.stats.carried_tokens += keep
        filling.append(Fill(row, nxt, [r.slot], fed=keep - row.cached))
        return None

    def _release(self, row: Row, count: int) -> None:
        if row.prefix is not None:
            self.prefixes.unlock(row.prefix, count)  # frees the prefixes no unfinished row reads
