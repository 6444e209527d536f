"""Inputs behind a URI: s3://, gs://, hdfs://, file:// through pyarrow's filesystems, and hf://
(Hugging Face Hub datasets) through fsspec, so a cluster run can read where its data lives."""
from __future__ import annotations

from typing import Any

from .schema import JobError


def is_uri(path: str) -> bool:
    return "://" in path


def filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it)."""
    import pyarrow.fs as pafs

    if uri.startswith("hf://"):
        try:
            from huggingface_hub import HfFileSystem
        except ImportError as e:  # pragma: no cover - huggingface_hub comes with transformers
            raise JobError(f"{uri}: reading hf:// needs huggingface_hub") from e
        return pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem())), uri[len("hf://"):]
    try:
        return pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as e:
        raise JobError(f"{uri}: cannot open this location ({e})") from None


def kind(uri: str) -> str:
    """'file', 'dir' or 'missing'."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(uri)
    try:
        info = fs.get_file_info(inner)
    except OSError as e:
        raise JobError(f"{uri}: cannot read ({e})") from None
    return {pafs.FileType.File: "file", pafs.FileType.Directory: "dir"}.get(info.type, "missing")


def list_files(uri: str) -> list[str]:
    """Files directly inside a directory URI, as URIs, sorted by name."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(uri)
    prefix = uri[: len(uri) - len(inner)] if uri.endswith(inner) else uri.split("://")[0] + "://"
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=False))
    return sorted(prefix + i.path for i in infos if i.type == pafs.FileType.File)


def open_input_file(uri: str):
    """Seekable (Parquet footers)."""
    fs, inner = filesystem(uri)
    return fs.open_input_file(inner)


def open_input_stream(uri: str):
    fs, inner = filesystem(uri)
    return fs.open_input_stream(inner, compression=None)  # the reader picks the codec itself
