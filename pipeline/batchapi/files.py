"""Uploaded files: the multipart body streamed to a temporary file under the data directory as it
arrives (never held in memory, never past the size limit), then renamed to its id and recorded.

An upload is stored whole or not at all: its bytes go to `files/.upload-*` (created with
O_EXCL, never through a link), are fsynced and renamed to `files/<id>`; only then is its row
inserted, the commit point. A temporary file, or a renamed one without a row, is what a killed
server left behind, and the next start removes it (`clean`). The uploaded file name is kept as
data; paths are made of ids only.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import AsyncIterator

from python_multipart.multipart import MultipartParser, parse_options_header

from batchgen.pipeline.batchapi.errors import ApiError

FILES = "files"  # the uploads' folder in the data directory
UPLOAD_PURPOSES = ("batch", "user_data", "assistants", "fine-tune", "vision", "evals")
MAX_FIELD_BYTES = 1024  # a form field other than the file (purpose): short text
FORM_OVERHEAD = 64 * 1024  # what a multipart body holds besides the file's bytes (headers, boundaries, fields)


@dataclass
class Upload:
    path: str  # the temporary file, fsynced
    size: int
    filename: str
    purpose: str


@dataclass
class _Form:
    """The state of one multipart body as python-multipart's callbacks walk it."""

    out: object  # the temporary file, opened for writing
    limit: int
    size: int = 0
    filename: str | None = None
    fields: dict[str, bytes] = field(default_factory=dict)
    files: int = 0
    _header: bytes = b""
    _value: bytes = b""
    _headers: dict[bytes, bytes] = field(default_factory=dict)
    _part: str | None = None  # "file", a field's name, or None (a part we skip)

    def callbacks(self) -> dict:
        return {"on_part_begin": self.part_begin, "on_header_field": self.header_field,
                "on_header_value": self.header_value, "on_header_end": self.header_end,
                "on_headers_finished": self.headers_finished, "on_part_data": self.part_data}

    def part_begin(self) -> None:
        self._headers, self._part = {}, None

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def header_end(self) -> None:
        self._headers[self._header.lower()] = self._value
        self._header, self._value = b"", b""

    def headers_finished(self) -> None:
        kind, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        if kind != b"form-data" or not name:
            raise ApiError(400, "each part of the multipart body needs a Content-Disposition: form-data name")
        if name == "file":
            self.files += 1
            if self.files > 1:
                raise ApiError(400, "send one file per upload", param="file")
            self.filename = params.get(b"filename", b"upload").decode("utf-8", "replace")[:1024]
            self._part = "file"
        elif name == "purpose":
            self.fields[name] = b""
            self._part = name
        else:  # expires_after[...] and the like: this service keeps a file until it is deleted
            raise ApiError(400, f"unsupported parameter {name!r} (an upload takes file and purpose)", param=name)

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part == "file":
            self.size += end - start
            if self.size > self.limit:
                raise ApiError(413, f"the file is larger than this server's limit of {self.limit} bytes",
                               param="file", code="file_too_large")
            self.out.write(data[start:end])  # type: ignore[attr-defined]
        elif self._part is not None:
            value = self.fields[self._part] + data[start:end]
            if len(value) > MAX_FIELD_BYTES:
                raise ApiError(400, f"the form field {self._part!r} is too long", param=self._part)
            self.fields[self._part] = value


async def receive(content_type: str, length: str | None, body: AsyncIterator[bytes], data_dir: str,
                  limit: int) -> Upload:
    """A multipart/form-data upload (a `file` and its `purpose`, as the openai client sends them)
    streamed to a temporary file under `data_dir/files`; the caller renames it or removes it."""
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data" or not params.get(b"boundary"):
        raise ApiError(400, "upload a file as multipart/form-data, with the fields file and purpose")
    if length is not None and length.isdigit() and int(length) > limit + FORM_OVERHEAD:
        raise ApiError(413, f"the file is larger than this server's limit of {limit} bytes", param="file",
                       code="file_too_large")  # refused before a byte of it is read
    fd, tmp = tempfile.mkstemp(prefix=".upload-", dir=os.path.join(data_dir, FILES))
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as out:
            form = _Form(out, limit)
            parser = MultipartParser(params[b"boundary"], form.callbacks())
            async for chunk in body:
                parser.write(chunk)
            parser.finalize()
            out.flush()
            os.fsync(out.fileno())
        if form.filename is None:
            raise ApiError(400, "the upload has no file field", param="file")
        purpose = form.fields.get("purpose", b"").decode("utf-8", "replace")
        if purpose not in UPLOAD_PURPOSES:
            raise ApiError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}",
                           param="purpose")
        return Upload(tmp, form.size, form.filename, purpose)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, ValueError) and not isinstance(e, ApiError):  # python-multipart's parse errors
            raise ApiError(400, f"the multipart body is malformed: {e}") from None
        raise


def keep(upload: Upload, data_dir: str, file_id: str) -> str:
    """The upload renamed to its id (atomic), the folder synced; its path relative to `data_dir`."""
    rel = os.path.join(FILES, file_id)
    os.replace(upload.path, os.path.join(data_dir, rel))
    sync_dir(os.path.join(data_dir, FILES))
    return rel


def sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean(data_dir: str, recorded: set[str]) -> list[str]:
    """Remove what a killed server left in `files/`: temporary uploads and files without a row."""
    folder = os.path.join(data_dir, FILES)
    removed = []
    for name in os.listdir(folder):
        rel = os.path.join(FILES, name)
        if rel not in recorded and os.path.isfile(os.path.join(folder, name)):
            os.unlink(os.path.join(folder, name))
            removed.append(rel)
    return removed
