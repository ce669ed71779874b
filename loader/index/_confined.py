"""Paths confined to their root: a folder source's files opened without following a link out of it.

`open_beneath` walks a path one component at a time with ``O_NOFOLLOW``, relative to its
parent's descriptor (``openat``), resolving a link itself only while it stays inside the root:
a writer swapping a file for a link between a check and the open cannot make a read return an
outside file (docs/security.md §4).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

from fsspec.implementations.cached import CachingFileSystem
from fsspec.implementations.local import LocalFileSystem

from .._errors import SourceError


def escapes_root(name: str) -> bool:
    """Whether a member path is empty, absolute or has a '..' component (would leave its root)."""
    return not name or name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/")


def on_local_disk(fs: Any) -> bool:
    """Whether ``fs`` reads this machine's files: the local file system, or an fsspec cache over it
    (``simplecache::``)."""
    while isinstance(fs, CachingFileSystem):  # its paths are the wrapped file system's: links and FIFOs are there too
        fs = fs.fs
    return isinstance(fs, LocalFileSystem)


def link_outside(fs: Any, root: str, relative: str) -> str | None:
    """Where a folder's file really is, when a symbolic link takes it outside ``root`` (local files); else None."""
    if not on_local_disk(fs):
        return None  # object stores and HTTP have no links
    real = os.path.realpath(os.path.join(root, relative))
    return None if inside_root(os.path.realpath(root), real) else real


def inside_root(real_root: str, path: str) -> bool:
    """Whether the real path ``path`` is ``real_root`` or below it."""
    return path == real_root or path.startswith(real_root.rstrip(os.sep) + os.sep)


OPENAT = os.open in os.supports_dir_fd and os.readlink in os.supports_dir_fd and hasattr(os, "O_NOFOLLOW")
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO for reading would wait for a writer; the file type is checked once opened
_FILE_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
)  # a terminal device is refused, never made the controlling one
_MAX_LINKS = 40  # as the kernel's own limit for one path
FIX_LINK = "copy the file into the folder or remove the link, then re-run `omnifeed index`"


def file_type(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    for test, name in (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISDIR, "folder"),
        (stat.S_ISLNK, "symbolic link"),
    ):
        if test(mode):
            return name
    return "regular file" if stat.S_ISREG(mode) else "special file"


def _refuse_special(mode: int, where: str, url: str) -> None:
    """SourceError (prefixed ``where``) unless ``mode`` is a regular file's."""
    if not stat.S_ISREG(mode):
        raise SourceError(f"{where}: a {file_type(mode)}, not a regular file; remove it from the folder", url=url)


def open_beneath(root: str, relative: str, where: str, url: str) -> int:
    """A read-only descriptor of the regular file ``relative`` under the local folder ``root``.

    The path is walked one component at a time, each opened with ``O_NOFOLLOW`` relative to
    the descriptor of the folder above it; a symbolic link met on the way is resolved here,
    and only while it stays inside ``root`` (``..`` never climbs above it). A link swapped in
    by a concurrent writer is therefore seen as a link, never followed by the kernel: no
    outside file can be opened, whatever happens to the folder meanwhile. FIFOs, sockets and
    devices are opened without blocking and refused. Raises SourceError (prefixed ``where``)
    for a link leading outside, a link loop or a file that is not regular; OSError otherwise.
    """
    stack = [os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))]
    names: list[str] = []  # the folders walked below root (real ones: links are never opened)
    pending = relative.split("/")
    pending.reverse()  # a stack: the next component last
    links = 0
    real_root = ""
    try:
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if len(stack) == 1:
                    raise SourceError(f"{where}: the path leads above the folder; {FIX_LINK}", url=url)
                os.close(stack.pop())
                names.pop()
                continue
            last = all(p in ("", ".") for p in pending)
            try:
                fd = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=stack[-1])
            except OSError as exc:
                links += 1
                if links > _MAX_LINKS:
                    raise SourceError(
                        f"{where}: a symbolic link loop (more than {_MAX_LINKS} links); remove or fix "
                        "the link, then re-run `omnifeed index`",
                        url=url,
                    ) from None
                try:
                    os.readlink(part, dir_fd=stack[-1])
                except OSError as not_link:
                    if not_link.errno == errno.EINVAL and exc.errno in (errno.ELOOP, errno.EMLINK):
                        pending.append(part)  # a link when opened, not now (swapped back): open it again
                        continue
                    if exc.errno == errno.ENXIO:  # a socket (or a device without a driver): refused as below
                        _refuse_special(os.stat(part, dir_fd=stack[-1], follow_symlinks=False).st_mode, where, url)
                    raise exc from None
                # A link: where the kernel would resolve it, as a name only; that name is walked again
                # from the root, component by component, so what it leads to is checked the same way.
                real_root = real_root or os.path.realpath(root)
                try:
                    real = os.path.realpath(os.path.join(real_root, *names, part))
                except OSError:  # swapped again while realpath read it (EINVAL): open the component again
                    pending.append(part)
                    continue
                if not inside_root(real_root, real):
                    raise SourceError(
                        f"{where}: a symbolic link to {real}, outside the folder; {FIX_LINK}", url=url
                    ) from None
                while len(stack) > 1:
                    os.close(stack.pop())
                names.clear()
                pending.extend(reversed(real[len(real_root) :].split("/")))
                continue
            if last:
                try:
                    _refuse_special(os.fstat(fd).st_mode, where, url)
                except BaseException:
                    os.close(fd)
                    raise
                return fd
            stack.append(fd)
            names.append(part)
        raise IsADirectoryError(errno.EISDIR, "a folder, not a file", relative)
    finally:
        for descriptor in stack:
            os.close(descriptor)


def read_whole(fd: int, size: int) -> bytes:
    """``size`` bytes from the start of an open file, fewer when it is shorter."""
    data = os.pread(fd, size, 0)
    if 0 < len(data) < size:  # a short read that is not the end (rare; large reads on some file systems)
        parts = [data]
        done = len(data)
        while done < size and (more := os.pread(fd, size - done, done)):
            parts.append(more)
            done += len(more)
        data = b"".join(parts)
    return data
