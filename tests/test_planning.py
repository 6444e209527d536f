"""`batchgen plan` predicts the work the engine then does: the same batches, the same prefill."""
import numpy as np
import pytest

from jobsets import edge_case_requests, tokenizer
from pipeline.engine import Engine
from pipeline.planning import summarize
from pipeline.prefix_index import PrefixIndex
from tiny_models import make_model


@pytest.mark.parametrize("budget", [120, 250, 100_000])
def test_plan_predicts_the_engines_batches_and_prefill(budget):
    reqs = edge_case_requests(tokenizer(), max_new_tokens=6)
    index = PrefixIndex.of([r.prompt_ids for r in reqs], [r.params.n for r in reqs],
                           [r.params.max_new_tokens for r in reqs])
    engine = Engine(make_model("llama"), eos_token_ids=[2], min_shared_tokens=4, max_batch_tokens=budget)
    # the runner hands the engine a window's requests in the index's sorted order
    engine.generate([reqs[j] for j in index.order[np.arange(len(index))].tolist()])
    planned = summarize(index, min_shared_tokens=4, max_batch_tokens=budget)
    assert planned["batches"] == engine.stats.batches  # rows may stop early at EOS: batches do not depend on it
    assert planned["prefill_tokens"] == engine.stats.prefill_tokens
    assert planned["shared_prefixes"] == engine.stats.prefix_nodes
