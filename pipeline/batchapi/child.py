"""One batch's run, in a process of its own (`python -m batchgen.pipeline.batchapi.child`), started
by the server's worker (worker.py) in the batch's directory: batchgen's runner on the batch's
input file, with its committed parts and resume, writing the Batch API's output and error files.

A process of its own, so that the model's work never holds up the server's requests, a cancel
is a SIGTERM (the runner commits what is finished and exits 75), and a crash of the model code
is one failed batch, not a dead server. It must not outlive the server: a SIGKILL of the server
kills it too (PR_SET_PDEATHSIG where Linux has it; everywhere, the end of its standard input,
which only the server holds open), and the next server resumes the batch from its parts.

Standard input: the length of a pickle (8 bytes, big-endian), then the pickle of
(inputs, output, RunOptions), written by the server from its own data directory.
Exit codes: 0 done, 75 stopped by a signal (finished work committed), 1 an error (its one line on
standard error), anything else a crash.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time

PREEMPTED = 75  # as pipeline/run/signals.py (not imported before the die-with-parent set-up)


def die_with_parent() -> None:
    """Be killed when the server goes, however it goes."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: standard input's end below is the one signal
        pass
    parent = os.environ.get("BATCHGEN_SERVE_PARENT")
    if parent is not None and os.getppid() != int(parent):
        os._exit(1)  # the server went before the signal was armed

    def watch() -> None:
        while os.read(sys.stdin.fileno(), 65536):
            pass
        os.kill(os.getpid(), signal.SIGKILL)  # no commit: the parts on disk are the state

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def read_spec() -> tuple:
    size = int.from_bytes(_read_exactly(8), "big")
    return pickle.loads(_read_exactly(size))


def _read_exactly(n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = os.read(sys.stdin.fileno(), n - len(data))
        if not got:
            os._exit(1)  # the server went while handing over the spec
        data += got
    return data


def main() -> int:
    inputs, output, options = read_spec()
    die_with_parent()
    from batchgen.pipeline.errors import BatchgenError
    from batchgen.pipeline.run.runner import process
    from batchgen.pipeline.run.signals import Preempted

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # the tests' pace (as the runner's BATCHGEN_FAULT, for tests only): seconds per finished
    # completion, so that a batch of a tiny model still runs long enough to be stopped in the middle
    pace = float(os.environ.get("BATCHGEN_SERVE_TEST_PACE") or 0)
    try:
        process(inputs, output, options, progress=(lambda p: time.sleep(pace)) if pace > 0 else None)
    except Preempted:
        return PREEMPTED
    except BatchgenError as e:
        print(str(e).splitlines()[0] if str(e) else type(e).__name__, file=sys.stderr, flush=True)
        return 1
    except OSError as e:
        print(f"{e.filename or output}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown (see cli.script); the outputs are closed and renamed
