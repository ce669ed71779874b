"""The RAM tier segment's files: made and opened as the user's own, mapped, released, removed.

A segment is a plain file in /dev/shm (``_ram_layout`` names it) with a lock file beside it.
Both are opened never through a link and refused when another user owns them or could open
them (`CacheError`, naming the file and what to do): another user's segment would let them
read or write the cached samples.
"""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

from ._errors import CacheError
from ._ram_layout import _segment_name, _segment_path


def attach(path: Path, size: int) -> tuple[mmap.mmap, bool]:
    """Map the segment, creating it with ``size`` bytes if it does not exist; (mapping, created).

    A plain file in /dev/shm and ``mmap`` rather than ``multiprocessing.shared_memory``: the
    segment outlives its creator on purpose (a restarted trainer finds it warm), which the
    latter's resource tracker fights (before Python 3.13 it unlinks segments at exit).
    """
    try:
        fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), True
    except FileExistsError:
        fd, created = open_private(path, os.O_RDWR), False
    if created:
        # Reserve every page now: a write into a mapped tmpfs page that cannot be allocated
        # kills the process with SIGBUS, so a segment too big for /dev/shm must fail here.
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            free = shutil.disk_usage(path.parent).free
            raise CacheError(
                f"cannot reserve {size} bytes of shared memory for the RAM tier in {path.parent} "
                f"({free} free: {exc.strerror}): lower cache.ram.capacity_bytes or give the node more "
                "shared memory (e.g. docker --shm-size)"
            ) from exc
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size), created
    finally:
        os.close(fd)


def open_private(path: Path, flags: int, mode: int = 0o600) -> int:
    """Open ``path`` (never through a symlink), refusing a file another user owns or could open, or a hard link."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        raise CacheError(f"cannot open {path} ({exc.strerror}); if it is a link, remove it") from exc
    info = os.fstat(fd)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        raise CacheError(
            f"{path} belongs to uid {info.st_uid} with mode {info.st_mode & 0o777:o}: another user could "
            "read or write this cache; remove it, or name the RAM tier differently (cache.ram.name)"
        )
    if info.st_nlink != 1:  # a hard link another user planted at the name: the tier would overwrite that file
        os.close(fd)
        raise CacheError(
            f"{path} has {info.st_nlink} hard links: it may be another file of yours linked there; "
            "remove it, or name the RAM tier differently (cache.ram.name)"
        )
    return fd


def release(segment: mmap.mmap, lock_fd: int) -> None:
    """Unmap the segment and close the lock file (this process's hold on them; both files stay)."""
    try:
        segment.close()
    except BufferError:  # a view is still alive somewhere; the mapping goes when it does
        pass
    try:
        os.close(lock_fd)
    except OSError:
        pass


def remove_segment(name: str) -> None:
    """Remove the node's segment called ``name`` (``RamTierConfig.name``) and its lock file, if they are there."""
    path = _segment_path(_segment_name(name))
    for file in (path, path.with_name(path.name + ".lock")):
        file.unlink(missing_ok=True)
