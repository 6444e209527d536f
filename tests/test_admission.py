"""Rows that finish early free their slots, and waiting rows of the next planned batch take them."""
import pytest

from jobsets import DOCS, SHOTS, SYSTEM, edge_case_requests, tokenizer
from pipeline import kvcache
from pipeline.engine import Engine
from pipeline.reference import reference_generate
from pipeline.schedule import Batch, Prefill, Release, Row
from pipeline.worklist import WorkList
from pipeline.types import Request, SamplingParams
from tiny_models import make_model

EOS = [2]


def uneven_requests(tok):
    """Groups whose jobs want 1 to 13 new tokens, so rows of one batch finish at different steps,
    plus n samples, nested prefixes, a lone prompt and the edge cases."""
    reqs = []
    for g, head in enumerate([SYSTEM, SYSTEM + SHOTS[0], SYSTEM + SHOTS[1] + DOCS[0]]):
        for i in range(9):
            n = 3 if i == 4 else 1
            reqs.append(Request(len(reqs), tok.encode_prompt(head + f"Q{i}: " + "tell me " * (i % 4)),
                                SamplingParams(max_new_tokens=1 + (5 * i + 3 * g) % 13, n=n)))
    reqs.append(Request(len(reqs), tok.encode_prompt("A lone prompt."), SamplingParams(max_new_tokens=4)))
    for r in edge_case_requests(tok, max_new_tokens=7):
        reqs.append(Request(len(reqs), r.prompt_ids, r.params))
    return reqs


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral", "gpt2", "qwen2"])
def test_rows_that_join_a_batch_in_flight_equal_uncached_generate(arch):
    tok = tokenizer()
    model = make_model(arch, seed=5)
    reqs = uneven_requests(tok)
    # a few rows per batch; on the copy path (gemma2, mistral) rows also hold their prefix
    budget = 300 if arch not in ("gemma2", "mistral") else 1500
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=budget)
    got = {(c.key, c.sample_index): c for c in engine.run(reqs)}
    assert engine.stats.admitted_rows > 5, "finished rows' slots were taken by waiting rows"
    assert len(got) == sum(r.params.n for r in reqs)
    for r in reqs:
        want = reference_generate(model, r, EOS)
        for s in range(r.params.n):
            assert got[(r.key, s)].token_ids == want, f"{arch}: job {r.key} sample {s}"
    assert engine.stats.completion_tokens == sum(len(c.token_ids) for c in got.values())


def test_joining_rows_reuse_the_batch_buffers(monkeypatch):
    """No new batch buffers while rows join: the slots finished rows left are reused in place."""
    tok = tokenizer()
    reqs = uneven_requests(tok)[:27]
    allocated = []
    real = kvcache.fan_out

    def spy(*a, into=None, **kw):
        out = real(*a, into=into, **kw)
        if into is None:
            allocated.append(out)
        return out

    monkeypatch.setattr(kvcache, "fan_out", spy)
    engine = Engine(make_model("llama"), eos_token_ids=[], min_shared_tokens=4, max_batch_tokens=300)
    engine.generate(reqs)
    assert engine.stats.admitted_rows > 0
    assert len(allocated) == engine.stats.batches
    # without joining, every planned batch would allocate its own buffers
    again = Engine(make_model("llama"), eos_token_ids=[], min_shared_tokens=4, max_batch_tokens=300, join=False)
    again.generate(reqs)
    assert again.stats.admitted_rows == 0 and again.stats.batches > engine.stats.batches


def test_seeded_samples_do_not_depend_on_joining():
    tok = tokenizer()
    model = make_model("qwen2", seed=2)
    reqs = [Request(i, tok.encode_prompt(SYSTEM + f"Story {i}."),
                    SamplingParams(max_new_tokens=2 + i % 9, temperature=0.8, top_p=0.9, seed=i, n=1 + i % 3))
            for i in range(30)]
    joined = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=200)
    one_batch = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=10**6)
    a = sorted((c.key, c.sample_index, c.token_ids) for c in joined.run(reqs))
    b = sorted((c.key, c.sample_index, c.token_ids) for c in one_batch.run(reqs))
    assert joined.stats.admitted_rows > 0 and one_batch.stats.admitted_rows == 0
    assert a == b


def take(work, free, fits=lambda rows: True, in_use=()):
    log = []
    rows = work.take(free, fits, set(in_use), lambda op: log.append(("prefill", op.node)),
                     lambda node: log.append(("release", node)))
    return rows, log


def test_the_worklist_fills_free_slots_in_plan_order():
    work = WorkList([Batch((Row("a", 1, 5, range(1)), Row("b", 1, 5, range(4)))), Batch((Row("c", 1, 9, range(2)),))])
    rows, _ = take(work, 3)
    assert rows == [Row("a", 1, 5, range(1))]  # b's 4 samples share one suffix prefill: they wait
    rows, _ = take(work, 8)
    assert rows == [Row("b", 1, 5, range(4)), Row("c", 1, 9, range(2))]
    assert work.pop() is None


def test_the_worklist_stops_at_the_first_row_that_does_not_fit():
    work = WorkList([Batch((Row("a", 1, 5, range(1)), Row("big", 1, 5, range(1)), Row("c", 1, 5, range(1))))])
    rows, _ = take(work, 5, fits=lambda rows: all(r.key != "big" for r in rows))
    assert rows == [Row("a", 1, 5, range(1))]
    assert [r.key for r in work.pop().rows] == ["big", "c"]  # order kept: no job overtakes another


def test_the_worklist_prefills_on_the_way_and_holds_releases_of_prefixes_in_use():
    ops = [Release(1), Release(2), Prefill(3, None, "x", 0, 20), Batch((Row("d", 3, 20, range(2)),)), Release(3),
           Batch((Row("e", None, 0, range(1)),))]
    work = WorkList(ops)
    rows, log = take(work, 4, in_use={1})
    assert rows == [Row("d", 3, 20, range(2)), Row("e", None, 0, range(1))]
    # prefix 1 is read by rows in flight, 3 by a row that just joined: both wait for the batch's end
    assert log == [("release", 2), ("prefill", 3)]
    work.end_batch()
    assert work.pop() == Release(1) and work.pop() == Release(3) and work.pop() is None


def test_the_worklist_peeks_at_the_rows_planned_next():
    work = WorkList([Prefill(1, None, "x", 0, 4), Batch((Row("a", 1, 4, range(1)),)), Release(1),
                     Batch((Row("b", None, 0, range(2)), Row("c", None, 0, range(1))))])
    assert [r.key for r in work.peek_rows(2)] == ["a", "b"]
    assert isinstance(work.pop(), Prefill)


def test_out_of_memory_while_rows_join_reruns_them_with_the_halves(monkeypatch):
    import torch

    tok = tokenizer()
    model = make_model("llama", seed=5)
    reqs = uneven_requests(tok)
    want = sorted((c.key, c.sample_index, c.token_ids)
                  for c in Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=300).run(reqs))
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=300)
    real = engine._prefill_suffixes
    fired = []

    def failing(b, prefixes, into=None, **kw):
        if into is not None and len(fired) < 2:  # the joining rows' prefill runs out of memory, twice
            fired.append(len(b.rows))
            raise torch.OutOfMemoryError("injected")
        return real(b, prefixes, into=into, **kw)

    engine._prefill_suffixes = failing
    got = sorted((c.key, c.sample_index, c.token_ids) for c in engine.run(reqs))
    assert len(fired) == 2 and engine.stats.oom_splits == 2
    assert got == want  # every job exactly once, and the same text


def test_a_prefill_that_fails_on_the_way_stays_planned():
    work = WorkList([Prefill(3, None, "x", 0, 20), Batch((Row("d", 3, 20, range(1)),))])

    def oom(op):
        raise MemoryError("injected")

    with pytest.raises(MemoryError):
        work.take(2, lambda rows: True, set(), oom, lambda node: None)
    assert work.pop() == Prefill(3, None, "x", 0, 20)


def test_finished_rows_are_yielded_while_their_batch_runs_on():
    """A batch that rows keep joining may run for the whole job: its finished rows must reach the
    output (and a resume) as they finish, and a stop keeps every one yielded so far."""
    tok = tokenizer()
    model = make_model("llama", seed=5)
    reqs = uneven_requests(tok)[:27]
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=300)
    steps_at = [engine.stats.decode_steps for _ in engine.run(reqs)]
    assert engine.stats.admitted_rows > 0
    assert steps_at[0] < steps_at[-1] / 4  # the first rows came out long before the batch ended

    seen = []
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=300)
    for c in engine.run(reqs, should_stop=lambda: len(seen) >= 10):
        seen.append(c)
    assert 10 <= len(seen) < sum(r.params.n for r in reqs)
    by_key = {r.key: r for r in reqs}
    for c in seen:  # complete and right, not cut short by the stop
        assert c.token_ids == reference_generate(model, by_key[c.key], EOS)


def test_unfinished_keeps_the_samples_still_to_run():
    from pipeline.batch import unfinished

    rows = (Row("a", 1, 5, range(4)), Row("b", None, 0, range(1)), Row("c", 2, 3, range(2, 5)))
    done = {("a", 1), ("b", 0), ("c", 4)}
    assert unfinished(rows, done) == (Row("a", 1, 5, range(0, 1)), Row("a", 1, 5, range(2, 4)), Row("c", 2, 3, range(2, 4)))
    assert unfinished(rows, set()) == rows


def test_a_held_release_runs_once_its_prefix_is_out_of_use():
    work = WorkList([Batch((Row("d", 3, 20, range(1)),)), Release(3), Batch((Row("e", None, 0, range(1)),)),
                     Batch((Row("f", None, 0, range(1)),))])
    _, log = take(work, 1)
    assert log == []  # d joined: prefix 3 is read
    _, log = take(work, 1, in_use={3})
    assert log == []  # still read
    _, log = take(work, 1, in_use=set())
    assert log == [("release", 3)]  # d finished: freed while the batch runs on


def test_prefixes_are_freed_while_one_batch_runs_on_through_many_groups(monkeypatch):
    """Joining can keep one batch running through every group of a job: each group's prefix must
    still be freed once its rows finish, or memory would grow with the number of groups."""
    tok = tokenizer()
    model = make_model("llama", seed=5)
    reqs = [Request(f"g{g}-q{i}", tok.encode_prompt(f"Group {g} header: " + "context words here " * 3 + f"Q{i}?"),
                    SamplingParams(max_new_tokens=1 + (7 * i + g) % 9)) for g in range(24) for i in range(4)]
    engine = Engine(model, eos_token_ids=[], min_shared_tokens=4, max_batch_tokens=100)
    alive = []
    real = engine._prefill_op

    def spy(op, requests, prefixes):
        real(op, requests, prefixes)
        alive.append(len(prefixes))

    monkeypatch.setattr(engine, "_prefill_op", spy)
    got = sorted((c.key, c.token_ids) for c in engine.run(reqs))
    assert engine.stats.admitted_rows > 40 and engine.stats.batches <= 3 and engine.stats.prefix_nodes >= 24
    assert max(alive) <= 12, alive  # a few groups in flight plus the plan's path, not one per group (25)
    want = sorted((c.key, c.token_ids) for c in Engine(model, eos_token_ids=[], min_shared_tokens=4, join=False).run(reqs))
    assert got == want
