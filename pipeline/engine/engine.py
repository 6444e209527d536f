"""Executes a plan: prefill each shared prefix once, then run rows through batches of slots.

Correct by construction for prompts that are wholly shared: the tree holds each request's tokens
minus the last one it runs, so every row feeds at least that token itself and samples its first
new token (or scores its last prompt token) from that position's logits; positions continue
exactly from the prefix it reads. Prompt tokens that rows score and that lie in a cached prefix
are scored once, as the prefix is prefilled (its logits there are the same for every row below).

The loop, top to bottom (gpt-fast's generate.py, with vLLM v1's flat token layout):
    for each batch shape of the plan:
        while rows are waiting or in flight:
            admit    rows planned next take free slots (their prefixes are prefilled first)
            forward  one token per decoding row + chunks of admitted rows' suffixes, no padding
            sample   the next token of every row that has logits
            finish   finished rows leave their slots and drop their prefixes' reference counts
A cached prefix lives while its tree node's reference count (unfinished rows at or below it) is
above zero: one mechanism for every prefix's lifetime.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Sequence

import torch

from pipeline.model import attention

from pipeline.model import kernels
from pipeline.model.attention import EngineError, layer_shapes  # noqa: F401  (EngineError: part of the engine's API)
from pipeline.model.decoder import Decoder
from pipeline.model.kv import PrefixKV, RowKV
from pipeline.engine.prefix_tree import PrefixTree
from pipeline.engine.prefix_scores import PrefixScores
from pipeline.engine.rows import Fill, Live, Wanted, record_logprobs, token_scores
from pipeline.engine.sampling import row_state, sample
from pipeline.engine.schedule import Plan, Row, plan, tree_of
from pipeline.model.step import Decode, Segment, StaticDecode, Step, build
from pipeline.engine.types import Completion, Request, RunStats


SCORED_ROWS = 512  # scored prompt positions per forward: their logits (rows x vocabulary) are held together


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Iterable[int] = (),
        min_shared_tokens: int = 16,
        max_batch_tokens: int = 65536,
        default_seed: int = 0,
        step_tokens: int = 2048,
        cascade: bool = True,
        join: bool = True,
        static_decode: bool | None = None,
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.eos = frozenset(eos_token_ids)
        self.min_shared_tokens = min_shared_tokens
        self.max_batch_tokens = max_batch_tokens
        self.default_seed = default_seed
        self.step_tokens = step_tokens  # tokens per forward; halves on out-of-memory
        self.cascade = cascade  # rows read shared prefixes once per step; else each row copies its prefix
        self.join = join  # rows planned next take the slots of finished rows (continuous batching)
        # decode steps on static shapes (capturable as a CUDA graph); on a CPU the dynamic ones,
        # which read each run of slots only as far as its longest row, are faster
        self.static_decode = self.device.type == "cuda" if static_decode is None else static_decode
        self.attention_path = "cascade" if cascade else "copy"
        self.own_decoder = isinstance(model, Decoder)  # batchgen's forward, else transformers' model code
        self.layers = model.layer_shapes() if self.own_decoder else layer_shapes(model)
        # float32 on CPU: oneDNN's GEMM, not MKL's (the decoder packs its own)
        self.linears = [] if self.own_decoder else kernels.fast_linears(model)
        if self.device.type == "cpu":
            kernels.keep_freed_memory()  # activations reuse memory instead of faulting in fresh pages
        self.stats = RunStats()

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return list(self.run(requests))

    def plan(self, requests: Sequence[Request]) -> Plan:
        tree, shapes = tree_of((r.key, r.prompt_ids[: r.shared_len], r.fed_len, r.params.max_new_tokens,
                                r.params.n) for r in requests)
        return plan(tree, shapes, min_shared_tokens=self.min_shared_tokens, max_batch_tokens=self.max_batch_tokens,
                    cascade=self.cascade)

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], should_stop: Callable[[], bool] = lambda: False) -> Iterator[Completion]:
        """Yield every sample of every request as it finishes (prefix order, not input order).

        Returns early, between steps, once `should_stop()` is true (preemption): rows in flight are
        dropped, everything yielded so far is complete."""
        self._requests = {r.key: r for r in requests}
        self._plan = self.plan(requests)
        self._prefixes: dict[int, PrefixKV] = {}
        self._prefix_of = {id(node): pid for pid, node in self._plan.nodes.items()}
        self._scores = PrefixScores(self._plan, self._requests)  # prompt logprobs kept on prefixes
        for r in requests:
            self.stats.jobs += 1
            self.stats.rows += r.params.n
            self.stats.prompt_tokens += len(r.prompt_ids)
        for row in self._plan.rows:  # a row holds its prefix, and every one above it, until it finishes
            if row.prefix is not None:
                PrefixTree.lock(self._plan.nodes[row.prefix], len(row.samples))
        for shape in self._plan.batches:
            queue = deque(self._plan.rows[shape.start : shape.end])
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
                logits = self.forward(step, want.keep)  # (want.keep, V)
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
            yield from self._sample(logits[index], running, kv)
        return False

    def _admit(self, queue: deque, kv: RowKV, filling: list[Fill], limit: int) -> int:
        """Rows planned next take free slots, in plan order, whole requests only (a request's samples
        share one suffix prefill); prefixes they need are prefilled first. Returns samples admitted."""
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
        self._prefill_prefixes({r.prefix for r in rows if r.prefix is not None})
        for _ in rows:
            queue.popleft()
        # neighbouring slots get rows of similar length: each decode attention call reads only as
        # far as the longest row of its run of slots
        for row in sorted(rows, key=self._plan.extent):
            slots = kv.take(len(row.samples))
            if row.cached > row.anchored:  # a short nested prefix: its keys/values join the row's own
                kv.copy_in(slots[0], self._prefixes[row.prefix], row.anchored, row.cached)
            request = self._requests[row.key]
            scores, greedy = self._scores.read(row, request)  # of its prompt tokens its prefixes hold
            filling.append(Fill(row, request, slots, scores=scores, greedy=greedy))
        return sum(len(r.samples) for r in rows)

    def _layout(self, running: list[Live], filling: list[Fill], kv: RowKV,
                static: StaticDecode | None) -> tuple[Step, Wanted]:
        """This step: a token per decoding row, then suffix chunks, oldest fill first, up to
        step_tokens tokens and SCORED_ROWS scored positions in all; and the logits it wants."""
        decode = [Decode(r.slot, r.row.anchored, self._prefixes[r.row.anchor] if r.row.anchor is not None else None)
                  for r in running]
        if static is not None and not filling:  # a decode step: token i is slot i's
            step = static.build(decode, [r.tokens[-1] for r in running])
            return step, Wanted(len(running), keep=[r.slot for r in running])
        budget, room = max(1, self.step_tokens - len(running)), SCORED_ROWS
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
            anchor = self._prefixes[f.row.anchor] if f.row.anchor is not None else None
            seg = Segment(0, 0, kv.k, kv.v, f.slots[0], kv.lens[f.slots[0]], f.row.anchored, anchor)
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

    def forward(self, step: Step, keep: list[int]) -> torch.Tensor:
        """One forward over the step's flat tokens: the logits (N, V) at the token indices `keep`."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        if self.own_decoder:
            logits = self.model.forward(step, index)
        else:
            with attention.selected(self.model), kernels.linears_on_onednn(self.linears):
                out = self.model(input_ids=step.input_ids, position_ids=step.positions, use_cache=False,
                                 logits_to_keep=index, **{attention.KWARG: step})
            logits = out.logits[0].float()
        self.stats.compiled_attention_layers += step.kernel_layers[0]
        self.stats.pytorch_attention_layers += step.kernel_layers[1]
        self.stats.own_decoder_forwards += self.own_decoder
        self.stats.transformers_forwards += not self.own_decoder
        return logits

    def _commit(self, step: Step, kv: RowKV, filling: list[Fill], running: list[Live]) -> None:
        """The forward succeeded: what it wrote now counts; fills whose suffix is in leave `filling`."""
        for r in running:
            kv.lens[r.slot] += 1
        fed = {s.index: s.t1 - s.t0 for s in step.segments}
        for f in filling:
            n = fed.get(f.slots[0], 0)
            kv.lens[f.slots[0]] += n
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

    def _sample(self, logits: torch.Tensor, running: list[Live], kv: RowKV) -> Iterator[Completion]:
        """The next token of every running row (logits (len(running), V), in order); finished rows leave."""
        low, high = torch.aminmax(logits, dim=-1)  # one pass; a NaN or inf shows here (a float16 sum overflows)
        finite = (torch.isfinite(low) & torch.isfinite(high)).tolist()
        chosen = sample(logits, [r.state for r in running])  # (B,)
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
            if reason:
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
        self.stats.completion_tokens += len(r.tokens)
        if r.sample == 0:  # once per job, and not again if an out-of-memory retry reruns it
            self.stats.cached_tokens += r.row.cached
        return Completion(r.request.key, r.sample, r.tokens, reason, len(r.request.prompt_ids), r.row.cached, error,
                          logprobs=r.logprobs, prompt_logprobs=r.prompt.scores if r.prompt else None,
                          prompt_greedy=r.prompt.greedy if r.prompt else None)

    def _release(self, row: Row, count: int) -> None:
        if row.prefix is None:
            return
        for node in PrefixTree.unlock(self._plan.nodes[row.prefix], count):
            pid = self._prefix_of.get(id(node))
            self._prefixes.pop(pid, None)
            self._scores.drop(pid)

    # -- prefixes -------------------------------------------------------------------------

    def _prefill_prefixes(self, needed: set[int]) -> None:
        """Compute the cached prefixes these rows read, and any above them not yet computed: one
        tree level per round (a child copies its parent's keys), all of a level packed in one
        forward per step_tokens tokens."""
        todo = set()
        for pid in needed:
            while pid is not None and pid not in self._prefixes and pid not in todo:
                todo.add(pid)
                pid = self._plan.prefixes[pid].parent
        while todo:
            level = sorted(p for p in todo if self._plan.prefixes[p].parent not in todo)
            for pid in level:
                p = self._plan.prefixes[pid]
                parent = self._prefixes[p.parent] if p.parent is not None else None
                self._prefixes[pid] = PrefixKV(self.layers, p.end, self.dtype, self.device, parent, p.start)
                self._scores.open(pid)
            self._prefill_level(level)
            todo -= set(level)
            self.stats.prefix_nodes += len(level)

    def _prefill_level(self, level: list[int]) -> None:
        """Prefill these prefixes, chunks of several packed in each forward of up to step_tokens
        tokens; the logits of positions rows below score with, up to SCORED_ROWS per forward."""
        at = {pid: self._plan.prefixes[pid].start for pid in level}  # next position of each prefix
        while at:
            chunks, budget, room = [], self.step_tokens, SCORED_ROWS
            for pid in list(at)[: self.step_tokens]:
                if budget <= 0:
                    break
                p, kv = self._plan.prefixes[pid], self._prefixes[pid]
                n = min(p.end - at[pid], budget)
                scored = self._scores.positions(pid, at[pid], at[pid] + n)
                if len(scored) > room:  # their logits would not fit: this forward scores only what does
                    n = scored.start - at[pid] + room
                    scored = range(scored.start, scored.start + room)
                if n <= 0:
                    break
                ids = self._requests[p.key].prompt_ids[at[pid] : at[pid] + n]
                chunks.append((pid, Segment(0, 0, kv.k, kv.v, 0, at[pid], 0), ids, scored))
                budget, room = budget - n, room - len(scored)
            step = build([], [], [(seg, ids) for _, seg, ids, _ in chunks], None, self.device)
            keep = [seg.t0 + q - seg.offset for _, seg, _, scored in chunks for q in scored]
            try:
                logits = self.forward(step, keep)
            except torch.OutOfMemoryError:
                if step.tokens <= 16:
                    raise
                self.stats.oom_splits += 1
                _release_memory(self.device)
                self.step_tokens = max(16, min(self.step_tokens, step.tokens) // 2)
                continue
            self.stats.prefill_tokens += step.tokens
            self._scores.keep([(pid, q) for pid, _, _, scored in chunks for q in scored], logits)
            for pid, seg, ids, _ in chunks:
                at[pid] += len(ids)
                if at[pid] == self._plan.prefixes[pid].end:
                    del at[pid]

    # -- out of memory ----------------------------------------------------------------------

    def _shrink(self, queue: deque, kv: RowKV, filling: list[Fill], running: list[Live], limit: int, fed: int):
        """The step did not fit: smaller suffix chunks first; then the newest half of the samples in
        flight go back to the front of the queue, each to rerun alone from its start (its generator
        restarts with it), and fewer slots are used. A lone sample that still does not fit fails
        alone. Returns the new limit on slots in use."""
        _release_memory(self.device)
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
            request = self._requests[row.key]
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

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def for_model(cls, model: torch.nn.Module, fallback_eos_ids: Iterable[int], *, min_shared_tokens: int,
                  max_batch_tokens: int) -> "Engine":
        """An engine for `model` whose samples end at the model's EOS ids (`eos_ids`): how the
        runner, the Ray workers, the Python API and the lm-eval backend all build theirs."""
        return cls(model, eos_token_ids=eos_ids(model, fallback_eos_ids), min_shared_tokens=min_shared_tokens,
                   max_batch_tokens=max_batch_tokens)


def _release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def eos_ids(model: torch.nn.Module, fallback: Iterable[int]) -> list[int]:
    """The token ids that end a sample: the model's generation config's, as `model.generate`
    reads them, else `fallback` (the tokenizer's)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return list(fallback)
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]
