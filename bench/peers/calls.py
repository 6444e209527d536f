"""How a peer's runner splits a job file's rows into `generate` calls (stdlib only: each runner
imports it from its own directory, in its own venv)."""
from __future__ import annotations

import itertools


def request_groups(rows: list[dict], calls: str) -> list[list[dict]]:
    """"all": one call; "group": one call per run of a `group`; "warm": first one prompt per group
    (which fills a prefix cache), then all the others in one call."""
    if calls == "all":
        return [rows]
    if calls == "group":
        return [list(gr) for _, gr in itertools.groupby(rows, key=lambda r: r.get("group", ""))]
    firsts: dict[str, dict] = {}
    for r in rows:
        firsts.setdefault(r.get("group", ""), r)
    return [list(firsts.values()), [r for r in rows if firsts[r.get("group", "")] is not r]]
