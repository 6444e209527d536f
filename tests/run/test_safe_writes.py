"""Writes that a shared folder, a full disk or a read-only directory cannot turn against the
user: no link followed, no other output's files removed, no stale errors file, one-line errors
with committed work kept."""
import errno
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.pipeline.cli import main

HEAD = "Shared instructions for every job: reply with a short and friendly sentence. "
ARGS = ["--max-new-tokens", "3", "--min-shared-tokens", "4", "--commit-every", "2"]


def write_jobs(path, n=6, bad=()):
    lines = [json.dumps({"id": f"j{i}", "prompt": HEAD + f"Item {i}?"}) for i in range(n)]
    for i in bad:
        lines[i] = "{broken"
    path.write_text("".join(x + "\n" for x in lines))
    return path


def run(src, out, model_dir, *extra):
    return CliRunner().invoke(main, ["process", str(src), "-o", str(out), *ARGS, *extra, "--model", str(model_dir)])


def one_line_error(res, *words):
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    assert "Traceback" not in res.output
    lines = [x for x in res.output.splitlines() if x.startswith("Error:")]
    assert len(lines) == 1, res.output
    for w in words:
        assert w in lines[0], lines[0]


# --- 4: temp files never follow a planted link ---------------------------------------------

def test_links_planted_at_temp_names_are_never_written_through(tmp_path, model_dir, monkeypatch):
    import batchgen.pipeline.run.parts

    src = write_jobs(tmp_path / "jobs.jsonl")
    shared = tmp_path / "shared"
    out = shared / "out.parquet"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    pid = os.getpid()  # the old writer's names (.NAME.tmp-<pid>, PART.tmp-<pid>) were predictable
    real_commit = batchgen.pipeline.run.parts.PartStore.commit

    def commit(store, *a, **k):
        # another user of the shared folder plants links while the run goes on (after its cleanup)
        plants = [shared / f".{n}.tmp-{pid}" for n in ("out.parquet", "out.parquet.errors.parquet",
                                                      "out.parquet.summary.json")]
        plants += [shared / "out.parquet.parts" / f"{n}.tmp-{pid}"
                   for n in ("part-000001.parquet", "part-000002.parquet", "manifest.json")]
        for link in plants:
            if not os.path.lexists(link):
                link.symlink_to(victim)
        return real_commit(store, *a, **k)

    monkeypatch.setattr(batchgen.pipeline.run.parts.PartStore, "commit", commit)
    res = run(src, out, model_dir)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert victim.read_text() == "precious"
    assert not out.is_symlink() and pq.read_table(out).num_rows == 6
    assert not os.path.islink(str(out) + ".summary.json")


def test_a_parts_directory_that_is_a_link_is_refused(tmp_path, model_dir):
    src = write_jobs(tmp_path / "jobs.jsonl")
    elsewhere = tmp_path / "someone_else"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("keep me")
    (tmp_path / "out.parquet.parts").symlink_to(elsewhere)
    res = run(src, tmp_path / "out.parquet", model_dir)
    one_line_error(res, "out.parquet.parts")
    assert os.listdir(elsewhere) == ["notes.txt"] and (elsewhere / "notes.txt").read_text() == "keep me"


def test_a_lock_file_that_is_a_link_is_not_truncated(tmp_path, model_dir):
    src = write_jobs(tmp_path / "jobs.jsonl")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "out.parquet.parts").mkdir()
    (tmp_path / "out.parquet.parts" / ".lock").symlink_to(victim)
    res = run(src, tmp_path / "out.parquet", model_dir)
    one_line_error(res, ".lock")
    assert victim.read_text() == "precious"


def test_every_rename_into_the_parts_directory_is_followed_by_a_directory_fsync(tmp_path, model_dir, monkeypatch):
    events = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src, dst, *a, **k):
        real_replace(src, dst, *a, **k)
        events.append(("replace", os.path.dirname(os.path.abspath(dst))))

    def fsync(fd):
        real_fsync(fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    src = write_jobs(tmp_path / "jobs.jsonl")
    res = run(src, tmp_path / "out.parquet", model_dir)
    assert res.exit_code == 0, res.output + repr(res.exception)
    parts = str(tmp_path / "out.parquet.parts")
    renames = [i for i, e in enumerate(events) if e == ("replace", parts)]
    assert len(renames) >= 4  # parts and manifests
    for i in renames:
        assert events[i + 1] == ("fsync", parts), events[i:i + 2]


# --- 5: cleanup removes only this output's temp files ----------------------------------------

def test_stale_temp_cleanup_spares_other_outputs(tmp_path, model_dir):
    src = write_jobs(tmp_path / "jobs.jsonl")
    o = tmp_path / "o"
    o.mkdir()
    mine = [o / ".run.tmp-1", o / ".run.summary.json.tmp-abc", o / ".run.errors.parquet.tmp-2"]
    others = [o / ".run2.tmp-424242", o / ".run.old.tmp-5", o / ".runx.summary.json.tmp-1"]
    for f in mine + others:
        f.write_text("x")
    res = run(src, o / "run", model_dir)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert [f.exists() for f in mine] == [False] * 3
    assert [f.exists() for f in others] == [True] * 3


# --- 6: no stale errors file after --overwrite ------------------------------------------------

def test_overwrite_without_errors_removes_the_old_errors_file(tmp_path, model_dir):
    out = tmp_path / "out.parquet"
    res = run(write_jobs(tmp_path / "jobs.jsonl", bad=[2]), out, model_dir)
    assert res.exit_code == 0 and os.path.exists(str(out) + ".errors.parquet")
    res = run(write_jobs(tmp_path / "jobs.jsonl"), out, model_dir, "--overwrite")
    assert res.exit_code == 0, res.output
    assert not os.path.exists(str(out) + ".errors.parquet")
    summary = json.loads(open(str(out) + ".summary.json").read())
    assert summary["failed"] == 0 and summary["errors_file"] is None and pq.read_table(out).num_rows == 6


# --- 8: full disk, read-only directory ------------------------------------------------------

def test_a_full_disk_is_one_line_and_keeps_the_committed_parts(tmp_path, model_dir, monkeypatch):
    import batchgen.pipeline.run.parts

    src = write_jobs(tmp_path / "jobs.jsonl")
    out = tmp_path / "out.parquet"
    real, calls = batchgen.pipeline.run.parts.write_part, []

    def write_part(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, *a, **k)

    monkeypatch.setattr(batchgen.pipeline.run.parts, "write_part", write_part)
    one_line_error(run(src, out, model_dir), "No space left on device", "free some space", "to resume")
    manifest = json.loads(open(str(out) + ".parts/manifest.json").read())
    assert [p["files"] for p in manifest["parts"]] == [["part-000000.parquet"]]
    monkeypatch.setattr(batchgen.pipeline.run.parts, "write_part", real)
    res = run(src, out, model_dir)
    assert res.exit_code == 0, res.output
    summary = json.loads(open(str(out) + ".summary.json").read())
    assert summary["resumed_jobs"] == 2 and summary["completed"] == 6 and pq.read_table(out).num_rows == 6


def test_a_read_only_output_directory_fails_before_the_model_loads(tmp_path, model_dir, monkeypatch):
    import builtins

    import batchgen.pipeline.model.load

    ro = tmp_path / "ro"
    ro.mkdir()
    erofs = OSError(errno.EROFS, os.strerror(errno.EROFS))
    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def inside(path):
        return os.path.abspath(os.fspath(path)).startswith(str(ro))

    def fake_open(file, mode="r", *a, **k):
        if isinstance(file, (str, os.PathLike)) and inside(file) and any(c in mode for c in "wax+"):
            raise erofs
        return real_open(file, mode, *a, **k)

    def fake_os_open(path, flags, *a, **k):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise erofs
        return real_os_open(path, flags, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    def fake_mkdir(path, *a, **k):
        if inside(path):
            raise erofs
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(batchgen.pipeline.model.load, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    res = run(write_jobs(tmp_path / "jobs.jsonl"), ro / "out.parquet", model_dir)
    one_line_error(res, "Read-only file system", str(ro))
    assert os.listdir(ro) == []


def test_a_refused_pickle_checkpoint_is_one_line(tmp_path, model_dir):
    import shutil

    import torch

    bad = tmp_path / "pickled"
    bad.mkdir()
    for name in os.listdir(model_dir):
        if name != "model.safetensors":
            shutil.copy(model_dir / name, bad / name)

    class Payload:
        def __reduce__(self):
            return (print, ("this must never run",))

    torch.save({"model.embed_tokens.weight": Payload()}, bad / "pytorch_model.bin")
    res = run(write_jobs(tmp_path / "jobs.jsonl"), tmp_path / "out.parquet", bad)
    one_line_error(res, "refused to load its pickled checkpoint", "safetensors")
    assert not os.path.exists(tmp_path / "out.parquet.parts")


# --- an output never overwrites an input ------------------------------------------------------

def _same_file(tmp_path, src, fmt):
    return src, tmp_path / src.name


def _symlink(tmp_path, src, fmt):
    (tmp_path / "link.jsonl").symlink_to(src)
    return src, tmp_path / "link.jsonl"


def _input_is_a_link_to_the_output(tmp_path, src, fmt):
    (tmp_path / "link.jsonl").symlink_to(src)
    return tmp_path / "link.jsonl", src


def _hard_link(tmp_path, src, fmt):
    os.link(src, tmp_path / "hard.jsonl")
    return src, tmp_path / "hard.jsonl"


def _another_spelling(tmp_path, src, fmt):
    (tmp_path / "sub").mkdir()
    return src, f"{tmp_path}/sub/..//./{src.name}"


def _its_summary(tmp_path, src, fmt):  # out.summary.json is the summary of the output `out`
    summary = tmp_path / "out.summary.json"
    os.replace(src, summary)
    return summary, tmp_path / "out"


def _its_errors_file(tmp_path, src, fmt):  # OpenAI output has its errors as lines, the others in Parquet
    errors = tmp_path / ("out.jsonl.errors.jsonl" if fmt == "openai" else "out.jsonl.errors.parquet")
    if fmt == "openai":
        os.replace(src, errors)
    else:
        pq.write_table(pa.table({"prompt": [HEAD + "one", HEAD + "two"]}), errors)
    return errors, tmp_path / "out.jsonl"


def _inside_an_input_directory(tmp_path, src, fmt):
    (tmp_path / "data").mkdir()
    os.replace(src, tmp_path / "data" / "part-0.jsonl")
    return tmp_path / "data", tmp_path / "data" / "out.jsonl"


def _inside_the_parts_directory(tmp_path, src, fmt):
    (tmp_path / "out.jsonl.parts").mkdir()
    os.replace(src, tmp_path / "out.jsonl.parts" / "jobs.jsonl")
    return tmp_path / "out.jsonl.parts" / "jobs.jsonl", tmp_path / "out.jsonl"


def _named_as_a_temp_file(tmp_path, src, fmt):  # the cleanup after a crash removes such names
    temp = tmp_path / ".out.jsonl.tmp-x.jsonl"
    os.replace(src, temp)
    return temp, tmp_path / "out.jsonl"


@pytest.mark.parametrize("layout", [_same_file, _symlink, _input_is_a_link_to_the_output, _hard_link,
                                    _another_spelling, _its_summary, _its_errors_file, _inside_an_input_directory,
                                    _inside_the_parts_directory, _named_as_a_temp_file],
                         ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("fmt", ["jsonl", "openai"])
def test_an_output_that_would_replace_an_input_is_refused_before_any_work(tmp_path, model_dir, monkeypatch,
                                                                         layout, fmt):
    import batchgen.pipeline.model.load

    src, out = layout(tmp_path, write_jobs(tmp_path / "jobs.jsonl"), fmt)
    files = sorted(p for p in tmp_path.rglob("*"))
    before = {p: p.read_bytes() for p in files if p.is_file()}
    monkeypatch.setattr(batchgen.pipeline.model.load, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    res = run(src, out, model_dir, "--output-format", fmt, "--overwrite")
    assert res.exit_code == 2 and "Error: Invalid value for '-o' / '--output'" in res.output, res.output
    assert "an input" in res.output or "input directory" in res.output or "unfinished work" in res.output \
        or "temporary file" in res.output, res.output
    assert sorted(p for p in tmp_path.rglob("*")) == files  # nothing written, nothing removed
    assert {p: p.read_bytes() for p in files if p.is_file()} == before


def test_a_parquet_input_is_never_its_own_output(tmp_path, model_dir):
    src = tmp_path / "jobs.parquet"
    pq.write_table(pa.table({"prompt": [HEAD + "one", HEAD + "two"]}), src)
    before = src.read_bytes()
    res = run(src, src, model_dir, "--overwrite")
    assert res.exit_code == 2 and "the same file" in res.output, res.output
    assert src.read_bytes() == before


def test_merge_never_writes_over_a_shard(tmp_path, model_dir):
    src = write_jobs(tmp_path / "jobs.jsonl")
    shards = [tmp_path / f"s{i}.parquet" for i in range(2)]
    for i, shard in enumerate(shards):
        assert run(src, shard, model_dir, "--shard", f"{i}/2").exit_code == 0
    before = [s.read_bytes() for s in shards]
    os.link(shards[1], tmp_path / "other-name.parquet")
    for out in (shards[0], tmp_path / "other-name.parquet"):
        res = CliRunner().invoke(main, ["merge", *map(str, shards), "-o", str(out), "--overwrite"])
        assert res.exit_code == 2 and "is the shard" in res.output and "the same file" in res.output, res.output
    assert [s.read_bytes() for s in shards] == before
    res = CliRunner().invoke(main, ["merge", *map(str, shards), "-o", str(tmp_path / "all.parquet")])
    assert res.exit_code == 0 and pq.read_table(tmp_path / "all.parquet").num_rows == 6, res.output


def test_a_ray_output_directory_never_holds_an_input(tmp_path, model_dir):
    out = tmp_path / "out"
    out.mkdir()
    src = write_jobs(out / "jobs.jsonl")
    res = run(src, out, model_dir, "--engine", "ray")
    assert res.exit_code == 2 and "holds the input" in res.output, res.output
    assert os.listdir(out) == ["jobs.jsonl"]
