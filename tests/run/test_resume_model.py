"""A resume never mixes two models (issue 48, 4): finished work is resumed only where the model's
files are the ones it ran (`batchgen.pipeline.model.identity`), so a checkpoint rewritten in place
between a crash and the rerun is refused as another model is."""
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.jobs import JobError
from batchgen.pipeline.cli import main
from batchgen.pipeline.model.identity import model_identity
from batchgen.pipeline.run.parts import may_resume

HEAD = "Shared instructions for every job: reply with a short and friendly sentence. "
ARGS = ["--max-new-tokens", "4", "--max-batch-tokens", "300", "--min-shared-tokens", "4", "--commit-every", "4"]


def save_model(directory, seed):
    """A tiny random Llama saved at `directory` (over whatever is there: a rewrite in place)."""
    from tests.helpers.tiny_models import make_model
    from tests.helpers.tiny_tokenizer import make_tokenizer

    make_model("llama", seed=seed).save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)


def a_tick_later():
    """A file's modification time advances with the kernel's clock tick (up to 10 ms), not the
    nanosecond: a rewrite within the same tick as the write before keeps its time (a run in
    between, which must load the model and commit, takes far longer)."""
    time.sleep(0.03)


@pytest.fixture
def jobs_file(tmp_path):
    rows = [{"id": f"j{i}", "prompt": HEAD + f"Item {i} of the list?"} for i in range(24)] + ["{broken"]
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def batchgen(args, extra_env=None):
    """`python -m batchgen ARGS` as a real process."""
    env = {**os.environ, **(extra_env or {})}
    return subprocess.run([sys.executable, "-m", "batchgen", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def parts(out):
    return json.loads(open(str(out) + ".parts/manifest.json").read())["parts"]


@pytest.mark.slow
def test_a_model_rewritten_in_place_after_a_sigkill_is_refused_and_an_untouched_one_resumes(tmp_path, jobs_file):
    model, out = tmp_path / "model", tmp_path / "out.parquet"
    save_model(model, seed=0)
    command = ["process", str(jobs_file), "-o", str(out), "--model", str(model), *ARGS]
    killed = batchgen(command, {"BATCHGEN_FAULT": "after-commit"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    first = parts(out)
    # the same files: the rerun resumes (and commits more on top of the first run's parts)
    killed = batchgen(command, {"BATCHGEN_FAULT": "after-commit"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert parts(out)[:len(first)] == first and len(parts(out)) > len(first)
    committed = parts(out)

    save_model(model, seed=1)  # the same path, new weights (same shapes, same file sizes)
    refused = batchgen(command)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1, refused.stderr
    assert "other jobs, options or model" in lines[0] and f"model {model} is not the one it ran" in lines[0]
    assert "--overwrite" in lines[0] and "Traceback" not in refused.stderr
    assert parts(out) == committed and not out.exists()  # nothing of the finished work is lost
    # the same exit code as a run of another model on that output
    other = tmp_path / "other"
    save_model(other, seed=0)
    another = batchgen(["process", str(jobs_file), "-o", str(out), "--model", str(other), *ARGS])
    assert another.returncode == refused.returncode and "other jobs, options or model" in another.stderr

    # --overwrite starts over: the output is the new weights' alone
    done = batchgen([*command, "--overwrite"])
    assert done.returncode == 0, done.stderr
    ref = tmp_path / "ref.parquet"
    res = CliRunner().invoke(main, ["process", str(jobs_file), "-o", str(ref), "--model", str(model), *ARGS])
    assert res.exit_code == 0, res.output
    assert pq.read_table(out).to_pylist() == pq.read_table(ref).to_pylist()
    assert json.loads(open(str(out) + ".summary.json").read())["resumed_jobs"] == 0


def test_what_counts_as_the_same_model_directory(tmp_path):
    model = tmp_path / "model"
    save_model(model, seed=0)
    same = model_identity(str(model))
    assert same.startswith("files ")
    (model / "README.md").write_text("notes")  # documentation and hidden files are not the model
    (model / ".cache").mkdir()
    (model / ".lock").write_text("")
    assert model_identity(str(model)) == same
    config = model / "config.json"
    a_tick_later()
    config.write_text(config.read_text())  # the same bytes, written again: the same model
    assert model_identity(str(model)) == same
    config.write_text(config.read_text().replace("}", ', "note": 1}', 1)[::1])  # other bytes
    assert model_identity(str(model)) != same
    changed = model_identity(str(model))
    (model / "chat_template.jinja").write_text("{{ messages }}")  # a file a loader reads, added
    assert model_identity(str(model)) != changed
    # a copy of the same bytes with new modification times (another node's scratch copy) is the same model
    copy = tmp_path / "copy"
    a_tick_later()
    subprocess.run(["cp", "-r", str(model), str(copy)], check=True)
    assert model_identity(str(copy)) == model_identity(str(model))
    save_model(copy, seed=1)  # new weights over it
    assert model_identity(str(copy)) != model_identity(str(model))


def test_large_files_are_sampled_every_tensor_at_both_ends(tmp_path):
    """Past 4 MiB a file is sampled: a safetensors file's header and both ends of every tensor
    (a small one whole), any other file's first MiB and 1,024 chunks spread over the rest."""
    import torch
    from safetensors.torch import save_file

    from batchgen.pipeline.model import identity

    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text("{}")
    tensors = {"big": torch.randn(3 << 20), "bias": torch.randn(16), "norm": torch.ones(64)}  # 12 MiB, then small ones
    save_file(tensors, model / "model.safetensors")
    (model / "other.bin").write_bytes(os.urandom(24 << 20))
    first = model_identity(str(model))
    reads = []
    real = os.pread
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(identity.os, "pread", lambda fd, n, at: reads.append(n) or real(fd, n, at))
        assert model_identity(str(model)) == first
    assert sum(reads) < 6 << 20  # of 36 MiB: the samples only (5 MiB of them in other.bin)
    for name, value in (("bias", tensors["bias"] + 1e-3), ("norm", tensors["norm"] * 2),
                        ("big", torch.cat([tensors["big"][:-1], torch.ones(1)]))):  # one element at the end
        save_file({**tensors, name: value}, model / "model.safetensors")
        assert model_identity(str(model)) != first, name
    save_file(tensors, model / "model.safetensors")
    assert model_identity(str(model)) == first
    data = bytearray((model / "other.bin").read_bytes())
    data[:8] = b"changed!"  # its head
    (model / "other.bin").write_bytes(bytes(data))
    assert model_identity(str(model)) != first


def test_the_default_model_is_its_converted_directorys_files(tmp_path, monkeypatch):
    """The embedded default model loads from its converted copy in batchgen's cache: its files
    are what a resume checks (converted again, it is another model)."""
    from batchgen.pipeline.model import default_model

    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    converted = tmp_path / "models" / default_model._CONVERTED_NAME
    save_model(converted, seed=0)
    (converted / default_model._MARKER).write_text("{}")
    assert model_identity(None) == model_identity(str(converted)) is not None
    before = model_identity(None)
    a_tick_later()
    save_model(converted, seed=0)  # converted again: the same bytes, new files, the same model
    assert model_identity(None) == before
    save_model(converted, seed=1)  # other weights in its place
    assert model_identity(None) != before


def test_a_hub_model_is_its_snapshot_revision(tmp_path, monkeypatch):
    """A hub id in the local Hugging Face cache: the revision its ref names (whatever files of it
    are downloaded); a ref moved on to another revision is another model; not cached: None."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--org--tiny"
    old, new = "a" * 40, "b" * 40
    for rev in (old, new):
        (repo / "snapshots" / rev).mkdir(parents=True)
        (repo / "snapshots" / rev / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(old)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_identity("org/tiny") == f"revision {old}"
    (repo / "snapshots" / old / "model.safetensors").write_text("")  # more files of it downloaded
    assert model_identity("org/tiny") == f"revision {old}"
    (repo / "refs" / "main").write_text(new)
    assert model_identity("org/tiny") == f"revision {new}"
    assert model_identity("org/not-cached") is None


def test_the_refusal_names_what_changed():
    then = {"model": "m", "model_files": "files 1", "dtype": "float32"}
    with pytest.raises(JobError, match=r"model m is not the one it ran: its files .* changed since"):
        may_resume("out.parts", {"key": "a", "settings": then}, "b", False, {**then, "model_files": "files 2"})
    with pytest.raises(JobError, match="its hub revision changed since"):
        may_resume("out.parts", {"key": "a", "settings": {**then, "model_files": "revision 1"}}, "b", False,
                   {**then, "model_files": "revision 2"})
    # other settings changed too: what it ran, as before
    with pytest.raises(JobError, match='it ran .*"dtype": "float32"'):
        may_resume("out.parts", {"key": "a", "settings": then}, "b", False,
                   {**then, "model_files": "files 2", "dtype": "bfloat16"})
    # work of a batchgen that recorded no model files cannot be told to be the same model's
    old = {k: v for k, v in then.items() if k != "model_files"}
    with pytest.raises(JobError, match="did not record which files of the model it ran"):
        may_resume("out.parts", {"key": "a", "settings": old}, "b", False, then)
    assert may_resume("out.parts", {"key": "a", "settings": then}, "b", True, then) is False  # --overwrite


def test_the_ray_runners_claim_refuses_a_changed_model(tmp_path):
    from batchgen.pipeline.run.ray_runner import claim

    settings = {"model": "m", "model_files": "files 1"}
    claim(str(tmp_path), "k1", settings, overwrite=False)
    (tmp_path / "part-0.parquet").write_text("")
    claim(str(tmp_path), "k1", settings, overwrite=False)  # the same model: its parts are kept
    assert (tmp_path / "part-0.parquet").exists()
    with pytest.raises(JobError, match="model m is not the one it ran"):
        claim(str(tmp_path), "k2", {**settings, "model_files": "files 2"}, overwrite=False)
    assert (tmp_path / "part-0.parquet").exists()


def test_merge_refuses_shards_of_two_models(tmp_path, jobs_file):
    model = tmp_path / "model"
    save_model(model, seed=0)
    outs = [str(tmp_path / f"shard-{i}.parquet") for i in range(2)]
    for i, out in enumerate(outs):
        if i == 1:
            save_model(model, seed=1)  # rewritten between the shards
        res = CliRunner().invoke(main, ["process", str(jobs_file), "-o", out, "--model", str(model), *ARGS,
                                        "--shard", f"{i}/2"])
        assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["merge", *outs, "-o", str(tmp_path / "all.parquet")])
    assert res.exit_code == 1 and "different model files" in res.output, res.output
