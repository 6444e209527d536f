"""The CLI as the end-to-end tests drive it: job files written, `batchgen` invoked in-process."""
import json
import os

from click.testing import CliRunner

from batchgen.pipeline.cli import main


def write_jsonl(path, rows):
    """Rows as JSON Lines (a str row is written as it is: a malformed line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run(args, model_dir, ok=True):
    """`batchgen ARGS --model MODEL_DIR`; with `ok`, it must exit 0."""
    result = CliRunner().invoke(main, [*args, "--model", str(model_dir)])
    if ok:
        assert result.exit_code == 0, result.output + repr(result.exception)
    return result


def die(*args, **kwargs):
    """A worker process's task that kills its process (tests/run/test_workers.py)."""
    os._exit(9)
