import os

import pytest


def pytest_sessionstart(session):
    """The references (transformers' forward and `generate` in this process) compute their rotary
    tables with ATen's cos: warm MKL's vector math first, as the engine does
    (`kernels.warm_vector_math`), so that no test compares against an inaccurate first call."""
    from batchgen.pipeline.model.kernels import warm_vector_math

    warm_vector_math()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random Llama and the tiny tokenizer saved as a model directory, for CLI runs."""
    from tests.helpers.tiny_models import make_model
    from tests.helpers.tiny_tokenizer import make_tokenizer

    d = tmp_path_factory.mktemp("tiny-llama")
    make_model("llama").save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def device():
    """Where the equivalence tests that take this fixture run their models: BATCHGEN_TEST_DEVICE
    (cpu by default; bench/gpu_check.sh sets cuda), the engine and its reference alike."""
    import torch

    return torch.device(os.environ.get("BATCHGEN_TEST_DEVICE", "cpu"))
