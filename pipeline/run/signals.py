"""SIGTERM and SIGINT during a run: exit code 75 (EX_TEMPFAIL) and nothing half-written.

The handler is installed when a run starts, not when it starts generating: reading and
tokenizing a big input takes minutes, and a scheduler's SIGTERM in that time must still mean
"requeue me" (exit 75), not a kill (143). Until the run starts writing, a signal stops it at
once (nothing has been written yet); from then on it only asks the generation loop to stop
between steps, so the loop commits what is finished first.
"""
from __future__ import annotations

import signal
import threading
from typing import Any

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: a scheduler may requeue the same command


class Preempted(BaseException):
    """SIGTERM/SIGINT: finished work is committed; rerun the same command to resume.

    A BaseException, like KeyboardInterrupt, so that no library's `except Exception` around
    reading or loading swallows it and carries on."""


class StopOnSignal:
    """Raises Preempted at the signal until `defer()`; then a signal only sets `requested()`.
    A second SIGINT after `defer()` interrupts at once."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._deferred = False
        self._old: dict[int, Any] = {}

    def requested(self) -> bool:
        return self._event.is_set()

    def defer(self) -> None:
        """The run is about to write: from now on, stop between steps instead of at once."""
        self._deferred = True

    def _handle(self, signum, frame) -> None:
        self._event.set()
        if not self._deferred:
            raise Preempted(f"stopped by signal {signal.Signals(signum).name} before generation started; "
                            "nothing was written; rerun the same command")
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
