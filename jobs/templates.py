"""--prompt-template: the columns a template reads, and one row's prompt from it."""

from __future__ import annotations

import string
from typing import Any, Mapping

from .errors import BatchgenError, OptionError


class TemplateRowError(BatchgenError):
    """A row the template cannot fill; `field` is the column to blame, if one is."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(reason)
        self.field, self.reason = field, reason


def template_fields(template: str) -> list[str]:
    """Column names a ``str.format`` template refers to; raises OptionError for bad templates."""
    if not template.strip():
        raise OptionError("prompt_template", "is empty: every row's prompt would be empty", repr(template))
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise OptionError("prompt_template", f"invalid prompt template: {e}", repr(template)) from None
    names = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        base = name.split(".", 1)[0].split("[", 1)[0]
        # str.format reads a field as a position where it is decimal digits (isdecimal: "٣" is
        # one, "²" is not, though isdigit says it is); any other name is a column
        if not base or base.isdecimal():
            raise OptionError("prompt_template", f"uses a positional field '{{{name}}}'; name a column "
                                                 "instead, like {text}", repr(template))
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
