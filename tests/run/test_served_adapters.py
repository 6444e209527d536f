"""LoRA adapters on served runs without a server (pipeline/run/served_adapters.py): the served
names, the `vllm serve` flags built from the adapters (and a user's own --vllm-arg winning), the
restart set when jobs name directories the options do not, and `--server`'s refusals of a
directory no --adapter NAME=PATH names (in validate as in the resolution process uses)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from batchgen.jobs import GenerationDefaults, Job
from batchgen.jobs import Location
from batchgen.jobs.errors import OptionError
from batchgen.pipeline.run.adapters import Adapters
from batchgen.pipeline.run.served_adapters import (directory_refusal, lora_arguments, max_rank, missing,
                                                    option_modules, registered_names, served_names)
from tests.helpers.tiny_adapters import make_adapter
from tests.helpers.tiny_models import model_from_config
from tests.helpers.tiny_tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama saved with its tokenizer, and three adapters of ranks 8, 4 and 20."""
    d = tmp_path_factory.mktemp("served-adapters")
    tok = make_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = model_from_config(config, seed=1)
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    paths = {r: str(make_adapter(model, d / f"r{r}", rank=r, seed=r, targets=("q_proj", "v_proj"))) for r in (8, 4, 20)}
    return d, config.to_dict(), paths


def _job(i: int, adapter: str | None = None) -> Job:
    record = {"id": i, "prompt": "x", **({"adapter": adapter} if adapter is not None else {})}
    [job] = Job.from_record(record, Location("jobs.jsonl", i), GenerationDefaults(), i)
    return job


def test_ranks_round_up_to_what_vllm_takes():
    assert [max_rank(r) for r in (1, 2, 8, 9, 17, 300, 512)] == [1, 8, 8, 16, 32, 320, 512]
    with pytest.raises(Exception, match="ranks up to 512"):
        max_rank(600)


def test_server_flags_from_the_adapters(base):
    _, config, paths = base
    modules = option_modules([f"a={paths[8]}", f"b={paths[20]}", paths[4]], config, taken=["tiny"])
    assert [(m.name, m.path, m.rank) for m in modules] == [("a", paths[8], 8), ("b", paths[20], 20),
                                                           ("adapter-3", paths[4], 4)]
    args = lora_arguments(modules, [])
    assert args == ["--enable-lora", "--lora-modules", f"a={paths[8]}", f"b={paths[20]}", f"adapter-3={paths[4]}",
                    "--max-lora-rank", "32", "--max-loras", "4"]
    assert lora_arguments([], ["--max-lora-rank", "8"]) == []  # no adapters: no LoRA at all
    with pytest.raises(OptionError, match="the served model's own name"):
        option_modules([f"tiny={paths[8]}"], config, taken=["tiny"])


def test_a_users_own_flags_win_and_are_never_given_twice(base):
    _, config, paths = base
    modules = option_modules([f"a={paths[8]}"], config)
    args = lora_arguments(modules, ["--max-lora-rank=64", "--max-loras", "2", "--enable-lora"])
    assert args == ["--lora-modules", f"a={paths[8]}"]
    with pytest.raises(OptionError, match="--adapter NAME=PATH"):
        lora_arguments(modules, ["--lora-modules", "x=/y"])


def test_one_directory_once_under_its_first_name_and_a_broken_one_left_out(base, tmp_path):
    d, config, paths = base
    (tmp_path / "broken").mkdir()
    modules = option_modules([f"a={paths[8]}", f"alias={paths[8]}", paths[8], f"bad={tmp_path / 'broken'}"], config)
    assert [(m.name, m.path) for m in modules] == [("a", paths[8])]


def test_directories_met_in_jobs_restart_the_server_with_all_of_them(base):
    d, config, paths = base
    modules = option_modules([f"adapter-2={paths[8]}"], config)
    adapters = Adapters.of([f"adapter-2={paths[8]}"], config)
    for label in ("adapter-2", paths[4]):  # as rows name them: a registered name, then a directory
        adapters.check(_job(1, label))
    assert missing(modules, adapters.infos[:1]) == modules  # nothing new: the started server serves them
    wanted = missing(modules, adapters.infos, taken=["tiny"])
    assert [(m.name, m.path) for m in wanted] == [("adapter-2", paths[8]), ("adapter-2-2", paths[4])]
    assert served_names(wanted, adapters.infos) == ["adapter-2", "adapter-2-2"]


def test_on_a_running_server_a_directory_needs_a_registered_name(base):
    d, config, paths = base
    registered = {"a": paths[8]}
    adapters = Adapters.of([f"a={paths[8]}"], config, directory_refusal(registered))
    assert adapters.check(_job(1, "a")) is None
    assert adapters.check(_job(2, paths[8])) is None  # the same directory: served as "a"
    bad = adapters.check(_job(3, paths[4]))
    assert "field 'adapter'" in bad.reason and "--adapter NAME=PATH" in bad.reason and paths[4] in bad.reason
    assert registered_names(adapters) == ["a"]
    with pytest.raises(OptionError, match="cannot be asked for"):  # an unnamed default: an option error
        Adapters.of([paths[4]], config, directory_refusal({}))
    named_default = Adapters.of([paths[4], f"b={paths[4]}"], config, directory_refusal({"b": paths[4]}))
    named_default.check(_job(4))
    assert registered_names(named_default) == ["b"]


def test_validate_on_a_server_refuses_a_directory_with_its_location(base, tmp_path):
    """No server is asked: the directory is refused before (and jobs using no names ask none)."""
    d, _, paths = base
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": 1, "prompt": "hi"}) + "\n" + json.dumps({"id": 2, "prompt": "hi",
                                                                               "adapter": paths[4]}) + "\n")
    r = subprocess.run([sys.executable, "-m", "batchgen", "validate", str(jobs), "--model", str(d / "model"),
                        "--server", "http://127.0.0.1:9"], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and "jobs.jsonl:2" in lines[0] and "--adapter NAME=PATH" in lines[0], r.stdout
