"""Relative paths in a YAML config mean one thing: relative to the folder of the file that holds them."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FEED_PATHS: tuple[tuple[str, ...], ...] = (("cache", "nvme", "path"),)
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
        parent: Any = out
        for name in path[:-1]:
            parent = parent.get(name) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or not isinstance(parent.get(path[-1]), str):
            continue
        value: str = parent[path[-1]]
        if "://" in value:
            continue
        expanded = Path(value).expanduser()
        parent[path[-1]] = str(expanded if expanded.is_absolute() else folder / expanded)
    return out
