"""Executes a schedule: prefill each shared prefix once, fan its cache out, decode in batches.

Correct by construction for prompts that are wholly shared: the tree holds each prompt minus
its last token, so every request feeds at least that token itself and samples its first new
token from that position's logits; positions continue exactly from the reused prefix.
"""
from __future__ import annotations

import collections
from typing import Callable, Iterable, Iterator, Sequence

import torch

from pipeline import cascade as cascade_mod
from pipeline import kvcache, masks
from pipeline.batch import BatchState, DecodeRow, extent, split, unfinished
from pipeline.prefix_tree import PrefixTree
from pipeline.sampling import make_generator, sample
from pipeline.schedule import JobShape, Prefill, Release, Row, plan
from pipeline.worklist import WorkList
from pipeline.types import Completion, Request, RunStats


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Iterable[int] = (),
        min_shared_tokens: int = 16,
        max_batch_tokens: int = 65536,
        default_seed: int = 0,
        prefill_chunk: int = 512,
        cascade: bool = True,
        join: bool = True,
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.eos = frozenset(eos_token_ids)
        self.min_shared_tokens = min_shared_tokens
        self.max_batch_tokens = max_batch_tokens
        self.default_seed = default_seed
        self.prefill_chunk = prefill_chunk  # tokens per prefill forward; halves on out-of-memory
        self.join = join  # rows planned next take the slots of finished rows (continuous batching)
        self.kinds = masks.layer_kinds(model.config)
        self.stats = RunStats()
        self._stopped = False  # a run returned early on should_stop()
        # unfinished samples per prefix in the batch in flight (joined rows and halves to rerun included):
        # a prefix is released once none is left, also while the batch runs on
        self._unfinished: collections.Counter = collections.Counter()
        # shared-prefix attention reads a group's prefix once; models it cannot serve copy it per row
        self.cascade_off = "disabled" if not cascade else cascade_mod.supports(model)
        self.attention_path = "cascade" if self.cascade_off is None else f"copy ({self.cascade_off})"

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return list(self.run(requests))

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], should_stop: Callable[[], bool] = lambda: False) -> Iterator[Completion]:
        """Yield every sample of every request, batch by batch (prefix order, not input order).

        Returns early, between steps, once `should_stop()` is true (preemption): the batch in
        flight is dropped, everything yielded so far is complete.
        """
        tree = PrefixTree()
        shapes: dict[int, JobShape] = {}
        for i, req in enumerate(requests):
            if not req.prompt_ids:
                raise ValueError(f"request {req.key!r} has an empty prompt")
            # hold back the last prompt token: its logits start generation
            tree.insert(i, req.prompt_ids[:-1])
            shapes[i] = JobShape(len(req.prompt_ids), req.params.max_new_tokens, req.params.n)
            self.stats.jobs += 1
            self.stats.rows += req.params.n
            self.stats.prompt_tokens += len(req.prompt_ids)
        prefixes: dict[int, kvcache.PrefixKV] = {}
        ops = plan(tree, shapes, min_shared_tokens=self.min_shared_tokens, max_batch_tokens=self.max_batch_tokens,
                   prefix_in_rows=self.cascade_off is not None)
        work = WorkList(ops)
        self._stopped = False
        while (op := work.pop()) is not None:
            if should_stop():
                return
            if isinstance(op, Prefill):
                self._prefill_op(op, requests, prefixes)
            elif isinstance(op, Release):
                del prefixes[op.node]
            else:
                self._unfinished.clear()
                self._track(op.rows)
                yield from self._run_split(op.rows, requests, prefixes, should_stop, work)
                if self._stopped:
                    return
                work.end_batch()

    def _track(self, rows: Sequence[Row]) -> None:
        for r in rows:
            self._unfinished[r.node] += len(r.samples)

    def _prefill_op(self, op: Prefill, requests, prefixes) -> None:
        parent = prefixes.get(op.parent) if op.parent is not None else None
        prefixes[op.node] = self.prefill(parent, requests[op.key].prompt_ids[op.start : op.end], op.start)
        self.stats.prefix_nodes += 1

    def _run_split(self, rows, requests, prefixes, should_stop, work: WorkList) -> Iterator[Completion]:
        """Run one batch, yielding every sample as it finishes (a batch that rows keep joining may run
        long: its finished rows must reach the output, and a resume, without waiting for it). Out of
        memory: run the halves of what had not finished, down to one sample of one job, which then
        fails alone. Stopped: sets `_stopped`."""
        joined: list[Row] = []
        finished: set[tuple] = set()
        try:
            for c in self._run_batch(rows, requests, prefixes, should_stop, work, joined):
                finished.add((c.key, c.sample_index))
                yield c
            return
        except torch.OutOfMemoryError:
            self.stats.oom_splits += 1
        _release_memory(self.device)  # here, not in the handler: its traceback still holds the batch
        rows = unfinished(tuple(rows) + tuple(joined), finished)  # rows that had joined split with the others
        halves = split(rows) if rows else ()
        if halves is None:
            row = rows[0]
            req = requests[row.key]
            for s in row.samples:
                self.stats.cached_tokens += row.cached if s == 0 else 0
                self._unfinished[row.node] -= 1
                yield Completion(req.key, s, [], "error", len(req.prompt_ids), row.cached, "out of memory")
            return
        for half in halves:
            yield from self._run_split(half, requests, prefixes, should_stop, work)
            if self._stopped:
                return

    # -- phases ---------------------------------------------------------------------------

    def prefill(self, parent: kvcache.PrefixKV | None, ids: list[int], start: int) -> kvcache.PrefixKV:
        """Extend a batch-1 prefix by `ids` at positions start.. (no padding: the model's own causal
        mask), in chunks that halve when memory runs out."""
        cache = kvcache.extend_from(parent, len(ids))
        done = 0
        while done < len(ids):
            chunk = ids[done : done + self.prefill_chunk]
            pos = start + done
            input_ids = torch.tensor([chunk], device=self.device)  # (1, C)
            positions = torch.arange(pos, pos + len(chunk), device=self.device)[None]  # (1, C)
            try:
                self.model(input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
            except torch.OutOfMemoryError:
                if self.prefill_chunk <= 16:
                    raise
                self.stats.oom_splits += 1
                kvcache.truncate(cache, pos)  # layers that ran before the failure appended this chunk
                _release_memory(self.device)
                self.prefill_chunk //= 2
                continue
            done += len(chunk)
        self.stats.prefill_tokens += len(ids)
        return kvcache.snapshot(cache)

    def forward(self, input_ids, q_pos, kv_pos, cache, shared=None) -> torch.Tensor:
        """One forward over padded rows; returns the last position's logits (B, V). `shared`: runs
        of rows and the prefix each continues (cascade attention); kv_pos then covers each row's
        own keys only."""
        mask = masks.build(q_pos, kv_pos, self.kinds, self.dtype)
        if shared is not None:
            with cascade_mod.active(self.model, shared):
                return self._logits(input_ids, q_pos, mask, cache)
        return self._logits(input_ids, q_pos, mask, cache)

    def _logits(self, input_ids, q_pos, mask, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            position_ids=q_pos.clamp(min=0),
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float()  # (B, V)

    def _run_batch(self, rows, requests: Sequence[Request], prefixes, should_stop, work: WorkList,
                   joined: list[Row]) -> Iterator[Completion]:
        """Prefill the rows' suffixes over their shared prefixes, then decode them to the end;
        the rows planned next join as finished rows free slots (appended to `joined`)."""
        self.stats.batches += 1
        b = BatchState(rows, [requests[r.key] for r in rows], [r.node for r in rows])
        logits = self._prefill_suffixes(b, prefixes, waiting=[(r, requests[r.key]) for r in work.peek_rows(4 * len(rows))])
        logits = self._fork(b, logits)
        while True:
            if should_stop():
                self._stopped = True
                return
            finite = torch.isfinite(logits).all(dim=-1).tolist()
            tokens = sample(logits, [row.request.params for row in b.live], [row.generator for row in b.live])
            keep = []
            for i, (row, tok) in enumerate(zip(b.live, tokens.tolist())):
                if not finite[i]:
                    yield self._finish(row, b.row_nodes[i], "error", "non-finite logits")
                    continue
                row.tokens.append(tok)
                reason = self._finish_reason(row, tok)
                if reason:
                    yield self._finish(row, b.row_nodes[i], reason)
                else:
                    keep.append(i)
            if not keep:
                return
            if len(keep) < len(b.live):
                tokens = b.keep(keep, tokens)
            logits = self.decode_step(tokens, b, prefixes)
            more = self._admit(b, requests, prefixes, work, joined)
            if more is not None:
                logits = torch.cat([logits, more])  # (B + new, V)

    def _prefill_suffixes(self, b: "BatchState", prefixes, into: "BatchState | None" = None,
                          waiting: Sequence[tuple[Row, Request]] = ()) -> torch.Tensor:
        """Lay the rows out as prefix | pad | pad | suffix (every row's last prompt token last),
        over a cache of their prefixes, and run the suffixes: the last position's logits (B, V).
        `into`: a batch in flight whose free slots the rows take (in its layout). `waiting`: rows
        that may join later; the buffers get room for them within the batch's token budget."""
        rows = b.rows
        width, s_max, new_max = extent(rows, b.reqs, cascade=False)
        capacity = width + s_max + new_max
        if into is None:
            b.cascade = self._cascade_ok(rows, capacity)
            self.stats.cascade_batches += b.cascade
        if b.cascade:  # each row's prefix stays in its one shared copy: rows hold only their own tokens
            groups, capacity, width = [(None, len(rows))], capacity - width, 0
        else:
            groups = []
            for r in rows:
                prefix = prefixes[r.node] if r.node is not None else None
                if groups and groups[-1][0] is prefix:
                    groups[-1] = (prefix, groups[-1][1] + 1)
                else:
                    groups.append((prefix, 1))
        slots = sum(len(r.samples) for r in rows)
        if waiting:
            reach = sum(extent(*zip(*waiting), b.cascade))
            capacity = max(capacity, min(reach, self.max_batch_tokens // slots))
        if into is None:
            b.cache = kvcache.fan_out(groups, width, capacity, rows=slots)
        else:
            b.cache = kvcache.fan_out(groups, width, capacity, rows=slots, into=into.cache, start=len(into.live))

        n = len(rows)
        suffixes = [q.prompt_ids[r.cached :] for q, r in zip(b.reqs, rows)]
        kv_pos = torch.full((n, width), masks.PAD, dtype=torch.long)  # (B, P); (B, 0) with cascade
        q_pos = torch.full((n, s_max), masks.PAD, dtype=torch.long)  # (B, S)
        input_ids = torch.zeros((n, s_max), dtype=torch.long)  # (B, S)
        for i, (r, s) in enumerate(zip(rows, suffixes)):
            kv_pos[i, : min(r.cached, width)] = torch.arange(min(r.cached, width))
            q_pos[i, s_max - len(s) :] = torch.arange(r.cached, r.cached + len(s))
            input_ids[i, s_max - len(s) :] = torch.tensor(s)
            self.stats.prefill_tokens += len(s)
        input_ids, q_pos, kv_pos = (t.to(self.device) for t in (input_ids, q_pos, kv_pos))
        b.kv_pos = torch.cat([kv_pos, q_pos], dim=1)  # (B, P + S)
        return self.forward(input_ids, q_pos, b.kv_pos, b.cache, self._shared(b, prefixes))

    def _admit(self, b: "BatchState", requests, prefixes, work: WorkList, joined) -> torch.Tensor | None:
        """Rows planned next take the slots finished rows freed, once a quarter of the batch is free
        (each joining costs a suffix prefill): their suffixes run into those slots. Their logits (N, V)."""
        slots, capacity = kvcache.capacity(b.cache)
        free = slots - len(b.live)
        if not self.join or free < max(1, slots // 4):
            return None

        def fits(rows: list[Row]) -> bool:
            width, s_max, new_max = extent(rows, [requests[r.key] for r in rows], cascade=False)
            if not b.cascade:
                return width + s_max + new_max <= capacity
            # rows hold only their own tokens, and the window must still see the whole prefix
            return s_max + new_max <= capacity and cascade_mod.window_allows(self.model.config,
                                                                             width + s_max + new_max)

        in_use = {node for node, left in self._unfinished.items() if left > 0}
        rows = work.take(free, fits, in_use, lambda op: self._prefill_op(op, requests, prefixes), prefixes.pop)
        if not rows:
            return None
        joined.extend(rows)
        self._track(rows)
        new = BatchState(tuple(rows), [requests[r.key] for r in rows], [r.node for r in rows], cascade=b.cascade)
        logits = self._fork(new, self._prefill_suffixes(new, prefixes, into=b))
        self.stats.admitted_rows += len(new.live)
        b.absorb(new)
        return logits

    def _fork(self, b: "BatchState", logits: torch.Tensor) -> torch.Tensor:
        """Each request becomes its samples: they share the prompt, its cache and its last logits."""
        fork = []
        for i, (q, r) in enumerate(zip(b.reqs, b.rows)):
            seed = q.params.seed if q.params.seed is not None else self.default_seed
            for s in r.samples:
                gen = None if q.params.greedy else make_generator(seed, s, self.device)
                b.live.append(DecodeRow(q, s, r.cached, gen))
                fork.append(i)
        if fork != list(range(len(b.rows))):
            kvcache.fork_rows(b.cache, [len(r.samples) for r in b.rows])
            index = torch.tensor(fork, device=self.device)
            b.kv_pos, logits = b.kv_pos[index], logits[index]
            b.row_nodes = [b.row_nodes[i] for i in fork]
        b.next_pos = torch.tensor([len(row.request.prompt_ids) for row in b.live], device=self.device)  # (B,)
        return logits

    def _shared(self, b: "BatchState", prefixes):
        return cascade_mod.segments(b.row_nodes, prefixes) if b.cascade else None

    def decode_step(self, tokens: torch.Tensor, b: "BatchState", prefixes) -> torch.Tensor:
        """Feed one token per row at its own next position; the next logits (B, V)."""
        q_pos = b.advance()  # (B, 1)
        logits = self.forward(tokens[:, None].to(self.device), q_pos, b.kv_pos, b.cache, self._shared(b, prefixes))
        self.stats.decode_steps += 1
        return logits

    def _cascade_ok(self, rows, capacity: int) -> bool:
        """Cascade attention for this batch: the model allows it, some row has a cached prefix,
        and no sliding window is shorter than the rows will grow."""
        return (self.cascade_off is None and any(r.node is not None for r in rows)
                and cascade_mod.window_allows(self.model.config, capacity))

    def _finish_reason(self, row: DecodeRow, token: int) -> str | None:
        if token in self.eos:
            return "stop"
        if row.request.stop is not None and row.request.stop(row.tokens):
            return "stop"
        if len(row.tokens) >= row.request.params.max_new_tokens:
            return "length"
        return None

    def _finish(self, row: DecodeRow, node: int | None, reason: str, error: str | None = None) -> Completion:
        n_prompt = len(row.request.prompt_ids)
        self._unfinished[node] -= 1  # its prefix may be released once no unfinished row reads it
        self.stats.completion_tokens += len(row.tokens)
        if row.sample_index == 0:  # once per job, and not again if an out-of-memory split reruns it
            self.stats.cached_tokens += row.cached
        return Completion(
            key=row.request.key,
            sample_index=row.sample_index,
            token_ids=row.tokens,
            finish_reason=reason,
            prompt_tokens=n_prompt,
            cached_tokens=row.cached,
            error=error,
        )


def _release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
