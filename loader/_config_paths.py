"""Relative paths in a YAML config mean one thing: relative to the folder of the file that holds them."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FEED_PATHS: tuple[tuple[str, ...], ...] = (
    ("cache", "nvme", "path"),
    ("plan", "mixture", "sources", "*", "index"),
    ("plan", "mixture", "plans"),
)
"""The path-valued settings of a feed config (key paths into its YAML mapping)."""

SERVICE_PATHS: tuple[tuple[str, ...], ...] = (
    ("index",),
    ("audit_log",),
    ("socket",),
    *(("feed", *p) for p in FEED_PATHS),
)
"""The path-valued settings of a service config."""


def resolve_paths(data: dict[str, Any], config_file: Path, paths: Sequence[tuple[str, ...]]) -> dict[str, Any]:
    """A copy of ``data`` with each relative local path at ``paths`` made absolute against ``config_file``'s folder.

    URLs (``scheme://``) and absolute paths are left as they are; ``~`` is expanded. The caller's
    dict is not changed.
    """
    folder = config_file.resolve().parent
    out = copy.deepcopy(data)
    for path in paths:
        parents: list[Any] = [out]
        for name in path[:-1]:  # ``*``: every value of a mapping (a mixture's sources)
            found = [p.get(name) for p in parents] if name != "*" else [v for p in parents for v in p.values()]
            parents = [p for p in found if isinstance(p, dict)]
        for parent in parents:
            value = parent.get(path[-1])
            if not isinstance(value, str) or "://" in value:
                continue
            expanded = Path(value).expanduser()
            parent[path[-1]] = str(expanded if expanded.is_absolute() else folder / expanded)
    return out
