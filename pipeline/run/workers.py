"""Worker processes for the pure Python work of `validate` and `plan` on a big input: tokenizing
plain rows (`inputrows.tokenize_in_worker`) and planning windows (`planning.plan_window`).

Why processes: that work is Python, and in one process it shares one GIL with reading the next
chunk, so at a million rows `plan` took the sum of both (BENCHMARKS.md, "A million jobs"). A task
is a module-level function and its arguments; its result is the value the caller's own thread
would have computed, so nothing after it changes.

A worker is a Python process running this module's `main` (imported by its name, not as
`__main__`), fed pickled tasks on its stdin and answering on its stdout, one frame each (8-byte length, then the pickle), in order. Not multiprocessing: its
`spawn` start imports the caller's main module again, which a script calling the Python API
without a `__main__` guard would run again; and forking this process would fork the reader's
thread and the Rust tokenizer's pool. Task i goes to worker i mod N, so answers are taken in
submission order (`Answer.result`); a thread per worker drains its stdout, so that neither side
blocks on a full pipe. Workers start on the first task (each costs a Python start, about a
quarter of a second, and whatever its first task loads).
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from typing import IO, Any, Callable, Iterable

from batchgen.pipeline.errors import BatchgenError
from batchgen.pipeline.model.cpus import available_cpus


class WorkerError(BatchgenError, RuntimeError):
    """A worker process stopped before it answered (killed, as by the kernel's out-of-memory killer),
    or a task's answer could not be sent back."""


def worker_count() -> int:
    """One worker per core this process may use, as torch's threads are counted (the reader takes
    its share of them too)."""
    return available_cpus()


def _write(out: IO[bytes], value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(len(data).to_bytes(8, "little") + data)
    out.flush()


def _read(src: IO[bytes]) -> bytes | None:
    head = src.read(8)
    return src.read(int.from_bytes(head, "little")) if len(head) == 8 else None


class _Worker:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's modules
        # imported by its name, not run as __main__: what it pickles (its own WorkerError) unpickles here
        self.proc = subprocess.Popen([sys.executable, "-c", f"from {__name__} import main; main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.answers: queue.Queue[bytes | None] = queue.Queue()
        self.reader = threading.Thread(target=self._drain, daemon=True, name="batchgen-worker-answers")
        self.reader.start()

    def _drain(self) -> None:
        while (frame := _read(self.proc.stdout)) is not None:  # type: ignore[arg-type]
            self.answers.put(frame)
        self.answers.put(None)

    def answer(self) -> Any:
        frame = self.answers.get()
        if frame is None:
            raise WorkerError(f"a batchgen worker process stopped (exit status {self.proc.wait()}) before it "
                              "answered; rerun the command (with less memory in use, if it was killed for it)")
        kind, value = pickle.loads(frame)
        if kind == "error":
            raise value
        return value

    def send(self, task: Any) -> None:
        try:
            _write(self.proc.stdin, task)  # type: ignore[arg-type]
        except OSError:  # it stopped: its answers end, and `answer` says so
            pass

    def close(self, now: bool = False) -> None:
        """Its stdin closed, it exits once its tasks are done; `now`: stopped at once (a run that
        failed does not wait for the chunks it had sent ahead)."""
        if now:
            self.proc.kill()
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=5)


class Answer:
    """A task's result, taken from its worker (in submission order)."""

    def __init__(self, worker: _Worker) -> None:
        self._worker, self._value, self._done = worker, None, False

    def result(self) -> Any:
        if not self._done:
            self._value, self._done = self._worker.answer(), True
        return self._value


class Workers:
    """`count` worker processes, started on the first task; a context manager that stops them."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._workers: list[_Worker] = []
        self._sent = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Answer:
        if not self._workers:
            self._workers = [_Worker() for _ in range(self.count)]
        worker = self._workers[self._sent % self.count]
        self._sent += 1
        worker.send((fn, args))
        return Answer(worker)

    def map(self, fn: Callable[..., Any], calls: Iterable[tuple[Any, ...]]) -> list[Any]:
        return [a.result() for a in [self.submit(fn, *args) for args in calls]]

    def close(self, now: bool = False) -> None:
        for w in self._workers:
            w.close(now)
        self._workers = []

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(now=kind is not None)


def main() -> None:
    """A worker: tasks (fn, args) until stdin closes, each answered ("ok", value) or ("error", exc)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes our stdin
    src, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the answers
    while (frame := _read(src)) is not None:
        try:
            fn, args = pickle.loads(frame)
            answer: tuple[str, Any] = ("ok", fn(*args))
        except Exception as e:  # noqa: BLE001 - handed to the parent, which raises it where its thread would
            answer = ("error", e)
        try:
            _write(out, answer)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # an answer or error pickle cannot carry
            _write(out, ("error", WorkerError(f"the {answer[0]} answer of a batchgen worker's task could not be sent: {e}")))
