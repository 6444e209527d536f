"""`batchgen plan` predicts the work the engine then does: the same batches, the same prefill."""
import pytest

from jobsets import edge_case_requests, tokenizer
from pipeline.engine import Engine
from pipeline.planning import summarize
from tiny_models import make_model


@pytest.mark.parametrize("budget", [120, 250, 100_000])
def test_plan_predicts_the_engines_batches_and_prefill(budget):
    reqs = edge_case_requests(tokenizer(), max_new_tokens=6)
    engine = Engine(make_model("llama"), eos_token_ids=[2], min_shared_tokens=4, max_batch_tokens=budget)
    engine.generate(reqs)  # rows may stop early at EOS: the batches do not depend on it
    planned = summarize([r.prompt_ids for r in reqs], [r.params.max_new_tokens for r in reqs],
                        [r.params.n for r in reqs], min_shared_tokens=4, max_batch_tokens=budget)
    assert planned["batches"] == engine.stats.batches
    assert planned["prefill_tokens"] == engine.stats.prefill_tokens
    assert planned["shared_prefixes"] == engine.stats.prefix_nodes
