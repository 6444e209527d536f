"""lm-evaluation-harness with `--model batchgen`: the same accuracy and loglikelihoods as `--model hf`
on a local 5-shot multiple-choice task, with the shared few-shot header prefilled once."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")  # the [eval] extra; `make setup` installs it

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    (d / "mc_task.yaml").write_text((DATA / "mc_task.yaml").read_text().replace("DATA_DIR", str(DATA)))
    return d


def evaluate(model: str, model_args: str, tasks_dir: Path, **kw):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import batchgen.pipeline.evalharness  # noqa: F401  registers "batchgen"

    return simple_evaluate(model=model, model_args=model_args, tasks=["batchgen_mc"],
                           task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True, **kw)


def per_request(result) -> list[float]:
    samples = sorted(result["samples"]["batchgen_mc"], key=lambda s: s["doc_id"])
    return [r[0][0] for s in samples for r in s["resps"]]


def test_batchgen_scores_as_the_hf_backend_does(model_dir, tasks):
    hf = evaluate("hf", f"pretrained={model_dir},dtype=float32", tasks, batch_size=16, device="cpu")
    bg = evaluate("batchgen", f"pretrained={model_dir},dtype=float32,min_shared_tokens=8", tasks)
    assert bg["results"]["batchgen_mc"]["acc,none"] == hf["results"]["batchgen_mc"]["acc,none"]
    a, b = per_request(bg), per_request(hf)
    assert len(a) == len(b) == 24 * 4
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_rolling_loglikelihood_and_generation_match_the_hf_backend(model_dir):
    """Perplexity windows longer than the context, and greedy generation until a stop string."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import batchgen.pipeline.evalharness  # noqa: F401

    hf = get_model("hf").create_from_arg_string(f"pretrained={model_dir},dtype=float32,max_length=48,device=cpu",
                                                {"batch_size": 4})
    bg = get_model("batchgen").create_from_arg_string(f"pretrained={model_dir},dtype=float32,max_length=48", {})
    texts = ["the river runs long and cold by the quiet town " * 4, "a short one"]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    a, b = bg.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling)
    assert all(abs(x - y) < 1e-4 for x, y in zip(a, b))
    gen = [Instance("generate_until", {}, ("Q: what is it? A:", {"until": ["\n", "Q:"], "max_gen_toks": 8}), 0)]
    assert bg.generate_until(gen) == hf.generate_until(gen)


def test_generation_kwargs_are_honoured_as_the_hf_backend_does_or_refused_by_name(model_dir, tmp_path):
    """top_k 1 makes sampling greedy, and repetition_penalty and min_new_tokens change the greedy
    text: each must give the hf backend's output. A kwarg batchgen cannot honour is refused."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import batchgen.pipeline.evalharness  # noqa: F401

    hf = get_model("hf").create_from_arg_string(f"pretrained={model_dir},dtype=float32,device=cpu",
                                                {"batch_size": 4})
    bg = get_model("batchgen").create_from_arg_string(f"pretrained={model_dir},dtype=float32", {})

    def gen(**kwargs):
        args = {"until": ["Q:"], "max_gen_toks": 12, **kwargs}
        return [Instance("generate_until", {}, (f"Q: what is {i}? A:", args), i) for i in range(3)]

    greedy = hf.generate_until(gen())
    for kwargs in ({"do_sample": True, "temperature": 1.0, "top_k": 1},
                   {"do_sample": True, "temperature": 0.7, "top_p": 1e-6},
                   {"repetition_penalty": 3.0}, {"min_new_tokens": 12, "max_new_tokens": 12}):
        want = hf.generate_until(gen(**kwargs))
        assert bg.generate_until(gen(**kwargs)) == want, kwargs
        if "do_sample" in kwargs:
            assert want == greedy
    assert hf.generate_until(gen(repetition_penalty=3.0)) != greedy  # the kwarg matters on this model
    assert bg.generate_until(gen(num_beams=1, do_sample=False, temperature=0.5)) == greedy
    for kwargs, message in [({"num_beams": 4}, "field 'num_beams' is a generation parameter batchgen does not "
                                               "support (batchgen samples, no beams)"),
                            ({"typical_p": 0.5}, "field 'typical_p' is a generation parameter batchgen does not"),
                            ({"frobnicate": 1}, "field 'frobnicate' is not a generation argument batchgen knows; "
                                                "batchgen takes until, max_gen_toks, do_sample, temperature, top_k"),
                            ({"n": 2}, "field 'n' is not a generate_until argument of lm-eval's hf backend"),
                            ({"top_k": -1}, "field 'top_k' must be an integer >= 0"),
                            ({"min_new_tokens": 20}, "field 'min_tokens' is 20, more than max_new_tokens (12)")]:
        with pytest.raises(ValueError, match=re.escape(f"batchgen: generate_until: {message}")):
            bg.generate_until(gen(**kwargs))
    # what a request leaves out comes from the model's generation_config, else transformers' own
    # defaults, as generate takes them: top_k 50 for a sampled request
    _, sampled = batchgen.pipeline.evalharness.generation({"do_sample": True, "temperature": 1.0}, "x", bg.gen_defaults)
    assert sampled.top_k == 50
    shutil.copytree(model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 3.0}))
    hf = get_model("hf").create_from_arg_string(f"pretrained={tmp_path / 'm'},dtype=float32,device=cpu",
                                                {"batch_size": 4})
    bg = get_model("batchgen").create_from_arg_string(f"pretrained={tmp_path / 'm'},dtype=float32", {})
    want = hf.generate_until(gen())
    assert want != greedy and bg.generate_until(gen()) == want


def test_the_start_up_hook_registers_batchgen_lazily_beside_lm_evals_own_models(tmp_path):
    """The .pth line, run by `site`: `batchgen` is in lm-eval's table once lm-eval reads it, and
    nothing of lm-eval or of the backend is imported before."""
    from batchgen.pipeline.lm_eval_plugin import write_pth

    write_pth(tmp_path)
    code = ("import site, sys; site.addsitedir(sys.argv[1]); "
            "print(any(m.startswith(('lm_eval', 'batchgen.pipeline.evalharness')) for m in sys.modules)); "
            "from lm_eval.api.registry import get_model; "
            "print(get_model('batchgen').__module__, get_model('hf').__name__)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "batchgen.pipeline.evalharness", "HFLM"]



def test_the_start_up_hook_imports_nothing_of_pipeline(tmp_path):
    """The .pth line runs at every start of Python, before a program sets its sys.path: it must
    not import the `pipeline` package (which would then be found wherever sys.path pointed first)."""
    from batchgen.pipeline.lm_eval_plugin import write_pth

    write_pth(tmp_path)
    code = ("import site, sys; site.addsitedir(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pipeline', 'jobs', 'batchgen')), "
            "'batchgen_lm_eval_hook' in sys.modules)")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[]", "True"]

@pytest.mark.slow
def test_lm_evals_own_command_runs_the_batchgen_model(model_dir, tasks, tmp_path):
    """`lm_eval --model batchgen` (lm-eval's own command, as installed): the same loglikelihoods as
    the backend in-process. Needs the .pth file `make setup` writes."""
    import sysconfig

    from batchgen.pipeline.lm_eval_plugin import PTH

    assert (Path(sysconfig.get_path("purelib")) / PTH).exists(), \
        f"no {PTH} in site-packages: run `make setup` (or `python -m batchgen.pipeline.lm_eval_plugin`)"
    out = tmp_path / "results"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([str(Path(sys.executable).parent / "lm_eval"), "--model", "batchgen", "--model_args",
                           f"pretrained={model_dir},dtype=float32", "--tasks", "batchgen_mc", "--include_path",
                           str(tasks), "--limit", "6", "--output_path", str(out), "--log_samples"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = [json.loads(line) for line in next(out.rglob("samples_batchgen_mc_*.jsonl")).read_text().splitlines()]
    got = [float(x) for x in per_request({"samples": {"batchgen_mc": samples}})]
    want = per_request(evaluate("batchgen", f"pretrained={model_dir},dtype=float32", tasks, limit=6))
    assert len(got) == len(want) == 6 * 4
    assert max(abs(x - y) for x, y in zip(got, want)) < 1e-5


@pytest.mark.slow
def test_the_command_line_runs_offline_with_the_default_model(tmp_path, tasks):
    """`batchgen-lm-eval` (lm-eval's command line, batchgen registered) on SmolLM2, offline."""
    exe = Path(sys.executable).parent / "batchgen-lm-eval"
    out = tmp_path / "results"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([str(exe), "--model", "batchgen", "--model_args", "dtype=float32",
                           "--tasks", "batchgen_mc", "--include_path", str(tasks), "--limit", "8",
                           "--output_path", str(out), "--log_samples"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob("samples_batchgen_mc_*.jsonl")).read_text().splitlines()]
    # the real model through lm-eval's own hf backend: the same accuracy, the same loglikelihoods
    from batchgen.pipeline.model.load import default_model_path

    hf = evaluate("hf", f"pretrained={default_model_path()},dtype=float32", tasks, batch_size=8, device="cpu",
                  limit=8)
    assert result["results"]["batchgen_mc"]["acc,none"] == hf["results"]["batchgen_mc"]["acc,none"]
    # the samples file holds the numbers as text
    a, b = [float(x) for x in per_request({"samples": {"batchgen_mc": samples}})], per_request(hf)
    assert len(a) == len(b) == 8 * 4
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_a_peft_adapter_scores_and_generates_as_the_hf_backend_on_its_merged_model(model_dir, tmp_path):
    """`peft=ADAPTER_DIR`: the loglikelihoods and greedy text of the hf backend on PEFT's merged
    model. (The hf backend's own `peft=` is no reference here: it resizes the model's embeddings to
    the tokenizer's length, which changes the tiny model's vocabulary.)"""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import batchgen.pipeline.evalharness  # noqa: F401
    from tests.helpers.tiny_adapters import make_adapter, merged
    from tests.helpers.tiny_models import make_model
    from tests.helpers.tiny_tokenizer import make_tokenizer

    adapter = make_adapter(make_model("llama"), tmp_path / "adapter", rank=8, seed=3)
    merged(make_model("llama"), adapter).save_pretrained(tmp_path / "merged")
    make_tokenizer().save_pretrained(tmp_path / "merged")
    hf = get_model("hf").create_from_arg_string(f"pretrained={tmp_path / 'merged'},dtype=float32,max_length=48,"
                                                "device=cpu", {"batch_size": 4})
    bg = get_model("batchgen").create_from_arg_string(f"pretrained={model_dir},dtype=float32,max_length=48,"
                                                      f"peft={adapter}", {})
    plain = get_model("batchgen").create_from_arg_string(f"pretrained={model_dir},dtype=float32,max_length=48", {})
    texts = ["the river runs long and cold by the quiet town " * 4, "a short one"]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    a, b = bg.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling)
    assert all(abs(x - y) < 1e-4 for x, y in zip(a, b))
    assert all(abs(x - y) > 1e-2 for x, y in zip(a, plain.loglikelihood_rolling(rolling)))  # the adapter counts
    pairs = [Instance("loglikelihood", {}, ("Q: what is it? A:", " a river"), 0)]
    assert abs(bg.loglikelihood(pairs)[0][0] - hf.loglikelihood(pairs)[0][0]) < 1e-4
    gen = [Instance("generate_until", {}, ("Q: what is it? A:", {"until": ["\n", "Q:"], "max_gen_toks": 8}), 0)]
    assert bg.generate_until(gen) == hf.generate_until(gen)
