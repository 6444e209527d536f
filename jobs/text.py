"""Text a row may not hold: a lone surrogate, which JSON's ``\\ud800`` escape (without its
pair) decodes to. No tokenizer takes it and no UTF-8 file (output, errors file) can hold it, so
the row is refused up front, naming where the bad text is.
"""

from __future__ import annotations

from collections.abc import Mapping  # isinstance is faster than with typing's alias (a check per row)
from typing import Any


def encodes(text: str) -> bool:
    """Whether `text` is valid Unicode (encodes as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def bad_text_at(value: Any, path: str = "") -> str | None:
    """Where in a row (``messages[0].content``) a string or a key is not valid Unicode; None if all is."""
    if isinstance(value, str):
        return None if value.isascii() or encodes(value) else path
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not encodes(key):
                return where
            found = bad_text_at(item, where)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = bad_text_at(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None
