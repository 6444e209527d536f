"""--prompt-template: the columns a template reads, and one row's prompt from it."""

from __future__ import annotations

import string
from typing import Any, Mapping

from .errors import JobError


class TemplateRowError(Exception):
    """A row the template cannot fill; `field` is the column to blame, if one is."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(reason)
        self.field, self.reason = field, reason


def template_fields(template: str) -> list[str]:
    """Column names a ``str.format`` template refers to; raises JobError for bad templates."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise JobError(f"invalid prompt template {template!r}: {e}") from None
    names = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        base = name.split(".", 1)[0].split("[", 1)[0]
        if not base or base.isdigit():
            raise JobError(f"prompt template {template!r} uses a positional field "
                           f"'{{{name}}}'; name a column instead, like {{text}}")
        names.append(base)
    return names


def fill_template(template: str, row: Mapping[str, Any]) -> str:
    for name in template_fields(template):
        if name not in row:
            cols = ", ".join(map(str, row)) or "none"
            raise TemplateRowError(None, f"prompt template needs column '{name}', which this row "
                                         f"does not have (columns: {cols})")
        if row[name] is None:
            raise TemplateRowError(name, "is null but the prompt template uses it")
    try:
        return template.format(**row)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise TemplateRowError(None, f"cannot fill the prompt template: {e}") from None
