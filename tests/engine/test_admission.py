"""Rows that finish early free their slots, and waiting rows of the next planned batch take them."""
import pytest

from tests.helpers.jobsets import DOCS, SHOTS, SYSTEM, edge_case_requests, tokenizer
from batchgen.pipeline.model import kv
from batchgen.pipeline.engine.engine import Engine
from batchgen.pipeline.engine.types import Request, SamplingParams
from tests.helpers.reference import reference_generate
from tests.helpers.tiny_models import make_model

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
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=300)  # a few rows per batch
    got = {(c.key, c.sample_index): c for c in engine.run(reqs)}
    assert engine.stats.admitted_rows > 5, "finished rows' slots were taken by waiting rows"
    assert len(got) == sum(r.params.n for r in reqs)
    for r in reqs:
        want = reference_generate(model, r, EOS)
        for s in range(r.params.n):
            assert got[(r.key, s)].token_ids == want, f"{arch}: job {r.key} sample {s}"
    assert engine.stats.completion_tokens == sum(len(c.token_ids) for c in got.values())


def test_joining_rows_reuse_the_batch_buffers(monkeypatch):
    """No new buffers while rows join: the slots finished rows left are reused in place."""
    tok = tokenizer()
    reqs = uneven_requests(tok)[:27]
    allocated = []
    real = kv.RowKV.__init__

    def spy(self, *a, **kw):
        allocated.append(1)
        real(self, *a, **kw)

    monkeypatch.setattr(kv.RowKV, "__init__", spy)
    model = make_model("llama")
    engine = Engine(model, eos_token_ids=[], min_shared_tokens=4, max_batch_tokens=300)
    got = sorted((c.key, c.sample_index, c.token_ids) for c in engine.run(reqs))
    assert engine.stats.admitted_rows > 0
    assert len(allocated) == engine.stats.batches < len(reqs) // 4
    # without joining, rows wait for the whole batch in flight to finish: the same text, more steps
    again = Engine(model, eos_token_ids=[], min_shared_tokens=4, max_batch_tokens=300, join=False)
    assert sorted((c.key, c.sample_index, c.token_ids) for c in again.run(reqs)) == got
    assert again.stats.admitted_rows == 0 and again.stats.decode_steps > engine.stats.decode_steps


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


def test_out_of_memory_while_rows_join_reruns_them(monkeypatch):
    import torch

    from batchgen.pipeline.model import attention

    tok = tokenizer()
    model = make_model("llama", seed=5)
    reqs = uneven_requests(tok)
    want = sorted((c.key, c.sample_index, c.token_ids)
                  for c in Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=300).run(reqs))
    engine = Engine(model, eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=300)
    real = engine.forward
    fired = []

    def failing(step, keep):
        if step.n_dec and step.segments and len(fired) < 2:  # joining rows' prefill beside decoding rows
            fired.append(step.tokens)
            raise torch.OutOfMemoryError("injected")
        return real(step, keep)

    engine.forward = failing
    got = sorted((c.key, c.sample_index, c.token_ids) for c in engine.run(reqs))
    assert len(fired) == 2 and engine.stats.oom_splits == 2
    assert got == want  # every job exactly once, and the same text
    assert attention  # the step layout the injection reads is the engine's own


def test_out_of_memory_halves_the_step_of_that_run_only():
    """A run that ran out of memory goes on in smaller steps; the engine's next run starts from
    its configured step again (the halving belongs to the run, not to the engine)."""
    import torch

    tok = tokenizer()
    model = make_model("llama", seed=5)
    reqs = uneven_requests(tok)

    def run(engine):
        sizes, real = [], engine.forward

        def spy(step, keep):
            sizes.append(step.tokens)
            return real(step, keep)

        engine.forward = spy
        out = sorted((c.key, c.sample_index, c.token_ids) for c in engine.run(reqs))
        del engine.forward
        return out, sizes

    options = dict(eos_token_ids=EOS, min_shared_tokens=4, max_batch_tokens=300, step_tokens=64)
    want, want_sizes = run(Engine(model, **options))
    engine = Engine(model, **options)
    real, fired = engine.forward, []

    def failing(step, keep):
        if not step.n_dec and step.tokens > 16 and not fired:  # the first prefill
            fired.append(step.tokens)
            raise torch.OutOfMemoryError("injected")
        return real(step, keep)

    engine.forward = failing
    assert sorted((c.key, c.sample_index, c.token_ids) for c in engine.run(reqs)) == want
    assert fired and engine.stats.oom_splits == 1
    del engine.forward
    got, sizes = run(engine)
    assert got == want
    assert sizes == want_sizes  # the same steps as a fresh engine's


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


def test_prefixes_are_freed_while_one_batch_runs_on_through_many_groups(monkeypatch):
    """Joining can keep one batch running through every group of a job: each group's prefix must
    be freed once its rows finish (its reference count falls to zero), or memory would grow with
    the number of groups."""
    tok = tokenizer()
    model = make_model("llama", seed=5)
    reqs = [Request(f"g{g}-q{i}", tok.encode_prompt(f"Group {g} header: " + "context words here " * 3 + f"Q{i}?"),
                    SamplingParams(max_new_tokens=1 + (7 * i + g) % 9)) for g in range(24) for i in range(4)]
    engine = Engine(model, eos_token_ids=[], min_shared_tokens=4, max_batch_tokens=100)
    from batchgen.pipeline.engine import loop

    alive, runs = [], []
    real = loop.Pass._prefill_prefixes

    def spy(self, needed):
        real(self, needed)
        runs.append(self)
        alive.append(len(self.prefixes))

    monkeypatch.setattr(loop.Pass, "_prefill_prefixes", spy)
    got = sorted((c.key, c.token_ids) for c in engine.run(reqs))
    assert engine.stats.admitted_rows > 40 and engine.stats.batches <= 3 and engine.stats.prefix_nodes >= 24
    assert max(alive) <= 12, alive  # a few groups in flight plus the plan's path, not one per group (25)
    assert not runs[-1].prefixes, "every prefix is freed by the end"
    want = sorted((c.key, c.token_ids) for c in Engine(model, eos_token_ids=[], min_shared_tokens=4, join=False).run(reqs))
    assert got == want


def test_prefixes_of_the_rows_queued_next_ride_along_in_a_prefix_forward():
    """Rows join a running batch a few at a time, each group under its own short prefix: a forward
    that prefills a group's prefix also takes the prefixes of the rows taking slots next, so the run
    makes fewer forwards of prefixes alone than it has prefixes, and every output is still
    uncached `generate`'s."""
    tok = tokenizer()
    model = make_model("llama", seed=5)
    reqs = [Request(f"g{g}-q{i}", tok.encode_prompt(f"Group {g} header: " + "context words here " * 3 + f"Q{i}?"),
                    SamplingParams(max_new_tokens=1 + (7 * i + g) % 9)) for g in range(12) for i in range(3)]
    engine = Engine(model, eos_token_ids=[], min_shared_tokens=4, max_batch_tokens=150)
    forwards = []
    real = engine.forward

    def counting(step, keep):
        forwards.append(step.kv is None)  # a forward of prefixes alone has no row slots
        return real(step, keep)

    engine.forward = counting
    got = {c.key: c.token_ids for c in engine.run(reqs)}
    assert engine.stats.admitted_rows > 10 and engine.stats.prefix_nodes >= 12
    assert sum(forwards) <= engine.stats.prefix_nodes // 2, (sum(forwards), engine.stats.prefix_nodes)
    for r in reqs:
        assert got[r.key] == reference_generate(model, r, []), r.key
