"""`batchgen serve`: OpenAI's Files and Batch API over batchgen's runner, on FastAPI and uvicorn.

Routes and shapes are OpenAI's, as the `openai` Python client sends and reads them:
`POST/GET /v1/files`, `GET/DELETE /v1/files/{id}`, `GET /v1/files/{id}/content`, `POST/GET
/v1/batches` (cursor pages: `limit`, `after`), `GET /v1/batches/{id}`, `POST
/v1/batches/{id}/cancel`. With an API key every request needs `Authorization: Bearer KEY`
(compared in constant time, before the body is read); without one the server listens on
loopback only (config.prepare). State is SQLite under `--data` (store.py), batches run on one
worker (worker.py).
"""
from __future__ import annotations

import fcntl
import hmac
import json
import os
import shutil
import socket
import sys
from contextlib import asynccontextmanager
from typing import Any, Literal

from batchgen.jobs.schema import OPENAI_ENDPOINTS
from batchgen.pipeline.errors import BatchgenError
from batchgen.pipeline.batchapi import files as uploads
from batchgen.pipeline.batchapi.config import ServeConfig, prepare
from batchgen.pipeline.batchapi.errors import ApiError, error_body, not_found
from batchgen.pipeline.batchapi.store import Store, new_id
from batchgen.pipeline.batchapi.worker import BATCHES, INPUT, Worker

WINDOWS = {"24h": 24 * 3600}  # the Batch API's one completion window
CREATE_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata"}

try:
    from fastapi import FastAPI, Query, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError:  # the `serve` extra is not installed: the command says so
    FastAPI = None  # type: ignore[assignment,misc]


def serve(config: ServeConfig) -> None:
    """Run the server until it is stopped (SIGINT/SIGTERM: the running batch commits first)."""
    if FastAPI is None:
        raise BatchgenError("batchgen serve needs FastAPI and uvicorn: pip install 'batchgen[serve]'")
    import uvicorn

    config = prepare(config)
    lock = hold_data_dir(config.data)
    try:
        sock = listen(config.host, config.port)  # before any work: a port in use is one line
        app = create_app(config)
        port = sock.getsockname()[1]
        host = f"[{config.host}]" if ":" in config.host else config.host
        print(f"batchgen serve: http://{host}:{port}/v1, data in {config.data}" +
              ("" if config.api_key else ", no API key (loopback only)"), file=sys.stderr, flush=True)
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        os.close(lock)


def listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise BatchgenError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --host or --port") \
            from None
    return sock


def hold_data_dir(data: str) -> int:
    """The data directory's lock, held while the server runs: one server (one worker) per directory.
    Folders it makes are its user's only: they hold every uploaded file and every answer."""
    os.makedirs(data, mode=0o700, exist_ok=True)
    for sub in (uploads.FILES, BATCHES):
        os.makedirs(os.path.join(data, sub), mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(data, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BatchgenError(f"{data}: another batchgen serve is using this data directory") from None
    return fd


def clean(config: ServeConfig, store: Store) -> None:
    """What a killed server left half made: uploads without a row, batch folders without a batch."""
    uploads.clean(config.data, store.file_paths())
    known = {b["id"] for b in store.read("SELECT id FROM batches")}
    folder = os.path.join(config.data, BATCHES)
    for name in os.listdir(folder):
        if name not in known:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


class BearerAuth:
    """Every HTTP request needs `Authorization: Bearer KEY`; anything else is a 401, answered
    before the route runs or the body is read (a refused upload stores nothing)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, b"Bearer " + key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(given) != 1 or not hmac.compare_digest(given[0], self.expected):
                body = error_body(401, "Incorrect API key provided: send Authorization: Bearer KEY with this "
                                       "server's key", code="invalid_api_key")
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(config: ServeConfig) -> "FastAPI":
    store = Store(config.data)
    worker = Worker(store, config)

    @asynccontextmanager
    async def lifespan(app):
        clean(config, store)
        worker.start()
        yield
        await run_in_threadpool(worker.stop)
        print("batchgen serve: stopped; a batch that was running committed its finished requests and resumes "
              "at the next start", file=sys.stderr, flush=True)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store, app.state.worker = store, worker
    if config.api_key:
        app.add_middleware(BearerAuth, key=config.api_key)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        return JSONResponse(error_body(400, f"{where}: {first.get('msg', 'invalid value')}", param=where or None),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    @app.post("/v1/files")
    async def upload(request: Request):
        got = await uploads.receive(request.headers.get("content-type", ""), request.headers.get("content-length"),
                                    request.stream(), config.data, config.max_file_bytes)
        file_id = new_id("file-")
        try:
            rel = uploads.keep(got, config.data, file_id)
            row = await run_in_threadpool(store.add_file, file_id, got.size, got.filename, got.purpose, rel,
                                          config.now())
        except BaseException:
            for path in (got.path, os.path.join(config.data, uploads.FILES, file_id)):
                if os.path.exists(path):
                    os.unlink(path)
            raise
        return file_object(row)

    @app.get("/v1/files")
    def list_files(purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000), after: str | None = None,
                   order: Literal["asc", "desc"] = "desc"):
        try:
            rows, more = store.files(purpose, limit, after, order == "asc")
        except KeyError:
            raise not_found("file", after or "", "after") from None
        return page([file_object(r) for r in rows], more)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str):
        return file_object(_file(file_id))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str):
        row = _file(file_id)
        try:
            f = open(os.path.join(config.data, row["path"]), "rb")  # open: a delete now cannot cut it short
        except FileNotFoundError:
            raise not_found("file", file_id) from None

        def chunks():
            with f:
                while block := f.read(1 << 20):
                    yield block

        return StreamingResponse(chunks(), media_type="application/octet-stream",
                                 headers={"Content-Length": str(os.fstat(f.fileno()).st_size)})

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str):
        row = store.delete_file(file_id)
        if row is None:
            raise not_found("file", file_id)
        try:
            os.unlink(os.path.join(config.data, row["path"]))
        except FileNotFoundError:
            pass
        return {"id": file_id, "object": "file", "deleted": True}

    def _file(file_id: str) -> dict[str, Any]:
        row = store.file(file_id)
        if row is None:
            raise not_found("file", file_id)
        return row

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the request body must be a JSON object") from None
        batch_id = await run_in_threadpool(new_batch, config, store, body)
        created = batch_object(store.batch(batch_id))  # as created (validating), whatever the worker does next
        worker.wake()
        return created

    @app.get("/v1/batches")
    def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None):
        try:
            rows, more = store.batches(limit, after)
        except KeyError:
            raise not_found("batch", after or "", "after") from None
        return page([batch_object(r) for r in rows], more)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str):
        return batch_object(_batch(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str):
        _batch(batch_id)
        now = config.now()
        with store.tx() as db:
            # a batch not yet checked has not run: nothing to stop, cancelled at once (the worker's own
            # move from validating then finds it gone); a running one stops at its next step
            if store.move(batch_id, ("validating",), "cancelling", now, db):
                store.move(batch_id, ("cancelling",), "cancelled", now, db)
                changed = True
            else:
                changed = store.move(batch_id, ("in_progress",), "cancelling", now, db)
        if not changed:
            row = _batch(batch_id)
            if row["status"] not in ("cancelling", "cancelled"):
                raise ApiError(400, f"batch {batch_id} is {row['status']}: only a validating or in_progress batch "
                                    "can be cancelled", code="invalid_status")
        worker.wake()
        return batch_object(_batch(batch_id))

    def _batch(batch_id: str) -> dict[str, Any]:
        row = store.batch(batch_id)
        if row is None:
            raise not_found("batch", batch_id)
        return row

    return app


def new_batch(config: ServeConfig, store: Store, body: Any) -> str:
    """A batch of an uploaded file, checked as the API checks the request; its input linked into
    its own folder (a later delete of the file does not take it away), then its row: the commit."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - CREATE_FIELDS)
    if unknown:
        raise ApiError(400, f"unsupported parameter {unknown[0]!r} (this server takes "
                            f"{', '.join(sorted(CREATE_FIELDS))})", param=unknown[0])
    endpoint, window, metadata = body.get("endpoint"), body.get("completion_window"), body.get("metadata")
    if endpoint not in OPENAI_ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(OPENAI_ENDPOINTS)}, got {endpoint!r}",
                       param="endpoint")
    if window not in WINDOWS:
        raise ApiError(400, f"completion_window must be one of {', '.join(WINDOWS)}, got {window!r}",
                       param="completion_window")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items())):
        raise ApiError(400, "metadata must be an object of at most 16 string values (keys up to 64 characters, "
                            "values up to 512)", param="metadata")
    file_id = body.get("input_file_id")
    row = store.file(file_id) if isinstance(file_id, str) else None
    if row is None:
        raise not_found("file", str(file_id), "input_file_id")
    if row["purpose"] != "batch":
        raise ApiError(400, f"file {file_id} has purpose {row['purpose']!r}; a batch's input needs purpose 'batch'",
                       param="input_file_id")
    batch_id = new_id("batch_")
    folder = os.path.join(config.data, BATCHES, batch_id)
    os.makedirs(folder)
    source, target = os.path.join(config.data, row["path"]), os.path.join(folder, INPUT)
    try:
        os.link(source, target)
    except FileNotFoundError:
        shutil.rmtree(folder)
        raise not_found("file", file_id, "input_file_id") from None
    except OSError:  # a file system without hard links: a copy
        shutil.copyfile(source, target)
    uploads.sync_dir(folder)
    now = config.now()
    store.add_batch(batch_id, endpoint, file_id, window, metadata, now, now + WINDOWS[window])
    return batch_id


def page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "expires_at": None, "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None}


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    stamps = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"], "model": row["model"],
            "errors": json.loads(row["errors"]) if row["errors"] else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{k: row[k] for k in stamps},
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
            "usage": json.loads(row["usage"]) if row["usage"] else None}
