"""The one worker: batches in creation order, each through batchgen's runner in a child process
(child.py) in the batch's own directory under `--data/batches/<id>/`.

Each step reads the batch's status from SQLite and moves it on, so the worker resumes anything
after a SIGKILL of the server: `validating` is checked again, `in_progress` runs the child again
(the runner resumes from the committed parts of the same output), `finalizing` registers the
finished files, `cancelling` finishes from what is committed. While the child runs, the worker
moves `request_counts` as parts commit, and on a cancel or at the end of the completion window
it sends the child SIGTERM: the runner commits what is finished and exits 75. A child run with
`RunOptions.finish_now` then writes the output from the committed parts, each request that did
not run an error line (`batch_cancelled`, `batch_expired`), so every custom_id is in the output
or the error file exactly once. A batch runs with the options it started with (saved in its
directory), whatever a restarted server is told.
"""
from __future__ import annotations

import fcntl
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import replace

from batchgen.jobs.errors import BatchgenError
from batchgen.jobs.openai_batch import not_run_reason
from batchgen.pipeline.run.options import RunOptions
from batchgen.pipeline.batchapi.batches import Committed, check_input, custom_ids, lines_in, read_outcome
from batchgen.pipeline.batchapi.config import ServeConfig
from batchgen.pipeline.batchapi.store import Store, new_id

BATCHES = "batches"  # the batches' folder in the data directory
INPUT, OUTPUT = "input.jsonl", "output.jsonl"
ERRORS, SUMMARY, PARTS = OUTPUT + ".errors.jsonl", OUTPUT + ".summary.json", OUTPUT + ".parts"
SPEC, LOG = "run-options.pickle", "run.log"
PREEMPTED = 75
POLL_SECONDS = 0.2


class StatusChanged(BatchgenError):
    """A batch's status moved under the worker (a cancel): its step is looked at again."""


class Worker:
    def __init__(self, store: Store, config: ServeConfig) -> None:
        self.store, self.config = store, config
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batchgen-serve-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, grace: float = 120.0) -> None:
        """Stop after the running batch commits what is finished (it resumes at the next start)."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(grace)

    def dir(self, batch_id: str) -> str:
        return os.path.join(self.config.data, BATCHES, batch_id)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            batch = self.store.next_open()
            if batch is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self._step(batch)
            except StatusChanged:
                continue
            except Exception as e:  # a bug, or the disk: this batch fails, the next ones still run
                traceback.print_exc()
                try:
                    self._fail(batch, ("validating", "in_progress", "finalizing", "cancelling"), "internal_error",
                               f"the server could not run this batch: {type(e).__name__}: {e}")
                except StatusChanged:
                    pass

    def _step(self, batch: dict) -> None:
        status = batch["status"]
        if status == "validating" and self._expired(batch):  # never checked, never ran: no files
            self._end(batch, "batch_expired", "expired", ("validating",))
        elif status == "validating":
            self._validate(batch)
        elif status == "in_progress":
            self._run(batch)
        elif status == "finalizing":
            self._finalize(batch, ("finalizing",), "completed")
        elif status == "cancelling":
            self._end(batch, "batch_cancelled", "cancelled", ("cancelling",))

    def _validate(self, batch: dict) -> None:
        checked = check_input(os.path.join(self.dir(batch["id"]), INPUT), batch["endpoint"],
                              self.config.max_requests, self.config.max_file_bytes)
        if checked.problems:
            errors = json.dumps({"object": "list", "data": checked.problems})
            self.store.move(batch["id"], ("validating",), "failed", self.config.now(), errors=errors,
                            total=checked.total)
        else:
            self.store.move(batch["id"], ("validating",), "in_progress", self.config.now(), total=checked.total,
                            model=checked.model)

    def _run(self, batch: dict) -> None:
        d = self.dir(batch["id"])
        if self._expired(batch):
            return self._end(batch, "batch_expired", "expired", ("in_progress", "cancelling"))
        if not os.path.exists(os.path.join(d, SUMMARY)):  # (else it finished before the server stopped)
            committed = Committed(os.path.join(d, PARTS))
            why = None
            with self._child(d, self._options(d)) as proc:
                while (rc := proc.poll()) is None:
                    if why is None:
                        why = self._why_stop(batch)
                        if why is not None:
                            proc.send_signal(signal.SIGTERM)  # commit what is finished, exit 75
                    self._count(batch, committed)
                    time.sleep(POLL_SECONDS)
            self._count(batch, committed)
            # stopped: it committed and exited 75, or our SIGTERM came before its handler was installed
            stopped = rc == PREEMPTED or (rc != 0 and why is not None)
            if stopped and why == "expired":
                return self._end(self.store.batch(batch["id"]), "batch_expired", "expired",
                                 ("in_progress", "cancelling"))
            if stopped:
                return  # cancelling: the next step finishes it; a stop or a stray signal: resumed later
            if rc != 0:
                return self._fail(batch, ("in_progress",), "batch_failed", self._child_error(d, rc))
        self.store.move(batch["id"], ("in_progress",), "finalizing", self.config.now())

    def _why_stop(self, batch: dict) -> str | None:
        if self._stopping.is_set():
            return "stop"
        if self.store.batch(batch["id"])["status"] == "cancelling":
            return "cancelled"
        if self._expired(batch):
            return "expired"
        return None

    def _end(self, batch: dict, code: str, final: str, frm: tuple[str, ...]) -> None:
        """Cancelled or expired: the output from what is committed, the rest error lines `code`."""
        d = self.dir(batch["id"])
        if batch["in_progress_at"] is None:  # it never ran: no files
            if not self.store.move(batch["id"], frm, final, self.config.now()):
                raise StatusChanged
            return
        if not os.path.exists(os.path.join(d, SUMMARY)):
            with self._child(d, replace(self._options(d), finish_now=not_run_reason(code))) as proc:
                while (rc := proc.poll()) is None:
                    time.sleep(POLL_SECONDS)  # no model work: it only writes the files
            if rc != 0:
                if self._stopping.is_set():
                    return
                return self._fail(batch, frm, "batch_failed", self._child_error(d, rc))
        self._finalize(batch, frm, final)

    def _finalize(self, batch: dict, frm: tuple[str, ...], final: str) -> None:
        """The output and error files registered (purpose batch_output), the counts and the final
        status: one transaction."""
        d, bid = self.dir(batch["id"]), batch["id"]
        outcome = read_outcome(os.path.join(d, OUTPUT), os.path.join(d, ERRORS), custom_ids(os.path.join(d, INPUT)))
        if outcome.problem is not None:  # never expected: the runner lands each request once
            return self._fail(batch, frm, "internal_error", outcome.problem)
        now = self.config.now()
        with self.store.tx() as db:
            ids = {}
            for key, name, label in (("output_file_id", OUTPUT, "output"), ("error_file_id", ERRORS, "error")):
                path = os.path.join(d, name)
                if lines_in(path):
                    ids[key] = new_id("file-")
                    self.store.add_file(ids[key], os.path.getsize(path), f"{bid}_{label}.jsonl", "batch_output",
                                        os.path.join(BATCHES, bid, name), now, db)
            moved = self.store.move(bid, frm, final, now, db, completed=outcome.completed, failed=outcome.failed,
                                    usage=json.dumps(outcome.usage), **ids)
            if not moved:
                raise StatusChanged  # (rolls the files back too)

    def _fail(self, batch: dict, frm: tuple[str, ...], code: str, message: str) -> None:
        errors = json.dumps({"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                         "line": None}]})
        if not self.store.move(batch["id"], frm, "failed", self.config.now(), errors=errors):
            raise StatusChanged

    def _count(self, batch: dict, committed: Committed) -> None:
        """request_counts from the committed parts (jobs; a list prompt's elements are one request)."""
        done, failed = committed.counts()
        total = batch["total"]
        failed = min(failed, total)
        done = min(done, total - failed)
        if (done, failed) != (batch["completed"], batch["failed"]):
            self.store.set_counts(batch["id"], total, done, failed)
            batch["completed"], batch["failed"] = done, failed

    def _expired(self, batch: dict) -> bool:
        return self.config.now() >= batch["expires_at"]

    def _options(self, d: str) -> RunOptions:
        """The options the batch started with; the server's, saved, at its first run."""
        path = os.path.join(d, SPEC)
        if os.path.exists(path):
            with open(path, "rb") as f:
                return pickle.load(f)
        fd, tmp = tempfile.mkstemp(prefix=".spec-", dir=d)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(self.config.options, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return self.config.options

    def _child(self, d: str, options: RunOptions) -> "_Child":
        _wait_unlocked(os.path.join(d, PARTS))
        return _Child(d, options)

    def _child_error(self, d: str, rc: int) -> str:
        try:
            with open(os.path.join(d, LOG), "rb") as f:
                lines = [x for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
        except OSError:
            lines = []
        what = lines[-1] if lines and rc == 1 else f"the run ended with exit code {rc}"
        return f"the batch could not run: {what}"


class _Child:
    """`python -m batchgen.pipeline.batchapi.child` in directory `d`, handed its spec on standard input,
    which stays open while it runs: its end tells the child that the server is gone."""

    def __init__(self, d: str, options: RunOptions) -> None:
        spec = pickle.dumps(([INPUT], OUTPUT, options))
        env = {**os.environ, "BATCHGEN_SERVE_PARENT": str(os.getpid())}
        with open(os.path.join(d, LOG), "wb") as log:
            # its own session: a Ctrl-C at the server's terminal is the server's to pass on (as a SIGTERM
            # once it stops), not a second stop signal racing the worker's
            self.proc = subprocess.Popen([sys.executable, "-m", "batchgen.pipeline.batchapi.child"], cwd=d,
                                         stdin=subprocess.PIPE, stdout=log, stderr=log, env=env,
                                         start_new_session=True)
        try:
            self.proc.stdin.write(len(spec).to_bytes(8, "big") + spec)  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except BrokenPipeError:
            pass  # it died at once: its exit code says so

    def __enter__(self) -> subprocess.Popen:
        return self.proc

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:  # leaving early (an error in the worker): no orphan run
            self.proc.kill()
            self.proc.wait()
        self.proc.stdin.close()  # type: ignore[union-attr]


def _wait_unlocked(parts: str, seconds: float = 30.0) -> None:
    """Until no process holds the output's lock: a child of a killed server dies a moment after it."""
    lock = os.path.join(parts, ".lock")
    if not os.path.exists(lock):
        return
    deadline = time.monotonic() + seconds
    fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return  # the child then says "another batchgen process is writing this output"
                time.sleep(0.1)
    finally:
        os.close(fd)
