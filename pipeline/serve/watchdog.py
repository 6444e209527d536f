"""Keeps a server from outliving the process that started it. Run as a plain script (it imports
nothing of batchgen, so it starts in a few milliseconds):

    python watchdog.py LOG_FILE COMMAND...

It starts COMMAND in a process group of its own with stdout and stderr into LOG_FILE, then waits
on its stdin, a pipe whose other end only batchgen holds. When that pipe closes (batchgen ended,
however: its normal stop, an exception, SIGKILL) or the watchdog gets SIGTERM/SIGINT, it stops
the whole group (vLLM's API server and its engine processes): SIGTERM, then SIGKILL after a grace
period. batchgen also starts the watchdog with PR_SET_PDEATHSIG (SIGTERM), so a SIGKILL of
batchgen reaches it by two roads; the server's leader gets SIGTERM by the same means should the
watchdog itself be killed. It exits with COMMAND's exit code when COMMAND ends first.
"""
import ctypes
import os
import select
import signal
import subprocess
import sys
import time

GRACE_SECONDS = 10.0


def stop_group(child: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if child.poll() is not None:
                try:  # the leader is gone; its group may still hold engine processes
                    os.killpg(child.pid, 0)
                except ProcessLookupError:
                    return
            time.sleep(0.1)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> int:
    log, command = sys.argv[1], sys.argv[2:]
    with open(log, "ab") as out:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=_die_with_parent)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    try:
        while not stopping:
            if child.poll() is not None:
                stop_group(child)  # its engine processes, should any remain
                return child.returncode
            try:
                ready, _, _ = select.select([sys.stdin], [], [], 0.5)
            except InterruptedError:
                continue
            if ready and not os.read(sys.stdin.fileno(), 4096):
                break  # the pipe closed: batchgen is gone or done
    finally:
        stop_group(child)
    return 0


if __name__ == "__main__":
    sys.exit(main())
