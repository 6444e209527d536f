"""Requests to OpenAI-compatible completions servers, in the order given, a bounded number in
flight on each server.

The runner gives each window's requests in prefix-sorted order; they go out in that order and
at most `concurrency` at a time per server, so a group's requests are in the server together and
its prefix cache holds the group's prefix while the group runs. Each request is one POST to
`/v1/completions` (a thread each: httpx's client is thread-safe and pools connections).

- Connection errors, timeouts, 429 and 5xx are retried with exponential backoff (0.5 s doubling
  to 8 s) for as long as `retry_seconds` since the first failure: then the server is gone
  (`ServerUnreachable`), and the run stops there, resumable (exit 75).
- Any other 4xx is that request's own fault: its completion carries the server's message as its
  error, and the job becomes a located error row (results.job_rows).
"""
from __future__ import annotations

import threading
import time
from collections import deque
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import httpx

from batchgen.pipeline.serve.errors import ServerAnswerError, ServerUnreachable

__all__ = ["Failed", "ServerAnswerError", "ServerUnreachable", "Servers"]

RETRY_SECONDS = 120.0  # a server unreachable this long is gone (a vLLM restart takes ~30 s on a CPU)
REQUEST_TIMEOUT = 3600.0  # one request's answer: long generations queue behind a full batch
_BACKOFF = (0.5, 8.0)


@dataclass
class Failed:
    """A request the server refused (4xx): its job fails alone."""

    status: int
    message: str


class Servers:
    """httpx clients for `urls`, each with its own bound on requests in flight."""

    def __init__(self, urls: Iterable[str], concurrency: int, retry_seconds: float = RETRY_SECONDS,
                 alive: Callable[[], str | None] | None = None, timeout: float = REQUEST_TIMEOUT) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.concurrency = concurrency
        self.retry_seconds = retry_seconds
        # why a server batchgen started is down (it exited), None while it runs: no use waiting for it
        self.alive = alive or (lambda: None)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.clients = [httpx.Client(base_url=u, limits=limits, timeout=httpx.Timeout(timeout, connect=10.0))
                        for u in self.urls]
        self.closed = threading.Event()  # set on close: sleeping retries give up

    def close(self) -> None:
        self.closed.set()
        for c in self.clients:
            c.close()

    def post(self, server: int, body: dict[str, Any]) -> dict[str, Any] | Failed:
        """One request's answer, retried while the server is unreachable or overloaded."""
        url, client = self.urls[server], self.clients[server]
        first_failure, delay = None, _BACKOFF[0]
        while True:
            try:
                r = client.post("/v1/completions", json=body)
                if r.status_code == 200:
                    return r.json()
                if r.status_code != 429 and r.status_code < 500:
                    return Failed(r.status_code, _message(r))
                why = f"HTTP {r.status_code}: {_message(r)}"
            except httpx.TransportError as e:  # connection refused or reset, timeouts, protocol errors
                if self.closed.is_set():
                    raise ServerUnreachable(f"{url}: the run is stopping") from None
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            except ValueError as e:  # a 200 whose body is not JSON
                raise ServerAnswerError(f"{url} answered with a body that is not JSON: {e}") from None
            down = self.alive()
            if down is not None:
                raise ServerUnreachable(f"{url}: {down}")
            now = time.monotonic()
            first_failure = first_failure or now
            if now - first_failure >= self.retry_seconds:
                raise ServerUnreachable(f"{url} unreachable for {now - first_failure:.0f} s ({why})")
            if self.closed.wait(delay):
                raise ServerUnreachable(f"{url}: the run is stopping")
            delay = min(delay * 2, _BACKOFF[1])

    def run(self, items: Iterable[tuple[int, Any, dict[str, Any]]], should_stop: Callable[[], bool],
            urgent: deque[tuple[int, Any, dict[str, Any]]] | None = None
            ) -> Iterator[tuple[Any, dict[str, Any] | Failed]]:
        """(tag, answer) of every (server, tag, body), in the order they finish; the bodies go out
        in the order given, at most `concurrency` in flight per server. Once `should_stop()` is
        true, nothing more is sent and what is in flight is dropped. A `ServerUnreachable` ends it.

        `urgent`: bodies the caller adds while it reads the answers (a conversation's next turn,
        made from its last turn's answer). They go out before any body of `items` not yet sent,
        in the order added, within the same bound, so the server's prefix cache still holds what
        they continue; the run ends once `items`, `urgent` and the requests in flight are all done."""
        pools = [ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"server{i}") for i in range(len(self.urls))]
        flying: dict[Future, tuple[int, Any]] = {}
        load = [0] * len(self.urls)
        urgent = urgent if urgent is not None else deque()
        pending = iter(items)
        held: tuple[int, Any, dict[str, Any]] | None = None  # the next of `items`, waiting for room on its server
        # finished requests, in the order they finish: O(1) a request, where waiting on every future
        # in flight (concurrent.futures.wait) costs O(in flight) a wake-up, 2,048 in flight on a GPU
        done: queue.SimpleQueue[Future] = queue.SimpleQueue()

        def send(server: int, tag: Any, body: dict[str, Any]) -> None:
            future = pools[server].submit(self.post, server, body)
            flying[future] = (server, tag)
            load[server] += 1
            future.add_done_callback(done.put)

        try:
            while True:
                if should_stop():
                    return
                waiting = deque()  # urgent bodies whose server is full: first in line when it has room
                while urgent:
                    server, tag, body = urgent.popleft()
                    if load[server] < self.concurrency:
                        send(server, tag, body)
                    else:
                        waiting.append((server, tag, body))
                urgent.extendleft(reversed(waiting))
                blocked = {server for server, _, _ in urgent}  # an urgent body goes before the next of `items`
                while pending is not None:
                    if held is None:
                        held = next(pending, None)
                        if held is None:
                            pending = None
                            break
                    server = held[0]
                    if load[server] >= self.concurrency or server in blocked:
                        break  # in the order given: the rest waits for room on this one's server
                    send(*held)
                    held = None
                if not flying:
                    if pending is None and not urgent:
                        return
                    raise AssertionError("requests wait for room on a server with none in flight")
                yield from self._finished(flying, load, should_stop, done)
        finally:
            for f in flying:
                f.cancel()
            for p in pools:  # threads in flight end when their answer comes or close() stops them
                p.shutdown(wait=False, cancel_futures=True)

    def _finished(self, flying: dict[Future, tuple[int, Any]], load: list[int], should_stop: Callable[[], bool],
                  done: queue.SimpleQueue) -> Iterator[tuple[Any, dict[str, Any] | Failed]]:
        """The answers of the requests that finished: at least one, or none after 0.25 s."""
        try:
            finished = [done.get(timeout=0.25)]
        except queue.Empty:
            return
        while True:
            try:
                finished.append(done.get_nowait())
            except queue.Empty:
                break
        for f in finished:
            server, tag = flying.pop(f)
            load[server] -= 1
            yield tag, f.result()  # raises the request's ServerUnreachable or ServerAnswerError
            if should_stop():
                return


def health(url: str, timeout: float = 2.0) -> bool:
    """Whether the server at `url` answers its health check (vLLM's `/health`)."""
    try:
        return httpx.get(url.rstrip("/") + "/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def served_models(url: str, timeout: float = 10.0) -> dict[str, str | None]:
    """The model names a server serves (`/v1/models`), each with its parent (vLLM lists a LoRA
    module with its base model's name as `parent`; a model itself has none), or raise ServerUnreachable."""
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout)
        r.raise_for_status()
        return {m["id"]: m.get("parent") for m in r.json().get("data", [])}
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ServerUnreachable(f"{url}: cannot list its models ({type(e).__name__}: {e})") from None


def _message(r: httpx.Response) -> str:
    """A server's error answer as one line: OpenAI's error message, else the body's start."""
    try:
        data = r.json()
        err = data.get("error") if isinstance(data, dict) else None
        msg = err.get("message") if isinstance(err, dict) else (err or data.get("message") or data.get("detail"))
        text = str(msg) if msg else r.text
    except ValueError:
        text = r.text
    return " ".join(text.split())[:300] or r.reason_phrase
