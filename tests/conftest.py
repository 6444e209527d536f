import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random Llama and the tiny tokenizer saved as a model directory, for CLI runs."""
    from tests.helpers.tiny_models import make_model
    from tests.helpers.tiny_tokenizer import make_tokenizer

    d = tmp_path_factory.mktemp("tiny-llama")
    make_model("llama").save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    return d
