"""The RAM tier segments on a node, seen from outside: what `omnifeed cache list` shows and `remove` checks.

A segment outlives its processes on purpose (a restarted trainer finds it warm), so a user
needs to see the ones on a node and remove them. Each is read from its file's first bytes,
without the tier's lock and without mapping it: a snapshot. A file named like a segment whose
header does not carry the tier's magic number is not one, and is left out.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ._ram_layout import (
    _H_CAPACITY,
    _H_ENTRIES,
    _H_FIELDS,
    _H_MAGIC,
    _H_READY,
    _H_USED,
    _H_USED_AT,
    _H_VERSION,
    _MAGIC,
    _VERSION,
    SEGMENT_PREFIX,
    _segment_name,
    _segment_path,
)

SegmentState = Literal["ready", "other version", "uninitialised", "unreadable", "lock file only"]


@dataclass(frozen=True)
class RamSegment:
    """A RAM tier segment found on the node; figures are None where they cannot be read.

    ``state``: ``ready``; ``other version`` (another omnifeed version's layout); ``uninitialised``
    (its creation was interrupted); ``unreadable`` (another user's); ``lock file only`` (the
    segment is gone, its lock file is left).
    """

    name: str  # RamTierConfig.name
    path: Path
    owner: int  # uid
    size_bytes: int  # shared memory the file holds: header, tables and arena
    capacity_bytes: int | None
    entries: int | None
    bytes_used: int | None
    last_used: float  # unix seconds: the tier's last get or put, else the file's modification time
    state: SegmentState


def list_segments() -> list[RamSegment]:
    """Every RAM tier segment on the node (every user's), sorted by name."""
    folder = _segment_path(SEGMENT_PREFIX).parent
    names = {path.name.removeprefix(SEGMENT_PREFIX).removesuffix(".lock") for path in folder.glob(SEGMENT_PREFIX + "*")}
    found = (find_segment(name) for name in sorted(names))
    return [segment for segment in found if segment is not None]


def find_segment(name: str) -> RamSegment | None:
    """The segment called ``name`` (``RamTierConfig.name``); None when there is none or the file is not one."""
    path = _segment_path(_segment_name(name))
    lock = path.with_name(path.name + ".lock")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return _lock_only(name, path, lock)
    if not stat.S_ISREG(info.st_mode):  # a link, a pipe, ...: not a file the tier made
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except PermissionError:  # another user's: its owner and size are all there is to see
        return RamSegment(name, path, info.st_uid, info.st_size, None, None, None, info.st_mtime, "unreadable")
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        raw = os.pread(fd, 8 * _H_FIELDS, 0) if stat.S_ISREG(info.st_mode) else b""
    finally:
        os.close(fd)
    if len(raw) < 8 * _H_FIELDS:
        return None
    header = struct.unpack(f"<{_H_FIELDS}Q", raw)
    state: SegmentState
    if not any(header):
        state = "uninitialised"
    elif header[_H_MAGIC] != _MAGIC:
        return None
    else:
        state = "ready" if header[_H_VERSION] == _VERSION and header[_H_READY] == 1 else "other version"
    if state != "ready":
        return RamSegment(name, path, info.st_uid, info.st_size, None, None, None, info.st_mtime, state)
    return RamSegment(
        name,
        path,
        info.st_uid,
        info.st_size,
        header[_H_CAPACITY],
        header[_H_ENTRIES],
        header[_H_USED],
        max(float(header[_H_USED_AT]), info.st_mtime),
        state,
    )


def _lock_only(name: str, path: Path, lock: Path) -> RamSegment | None:
    try:
        info = os.lstat(lock)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    return RamSegment(name, path, info.st_uid, 0, None, None, None, info.st_mtime, "lock file only")
