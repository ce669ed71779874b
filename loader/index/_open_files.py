"""Source files kept open per process, each checked against its path on every use.

Reading a Parquet or Arrow cell needs the file's footer or schema; opening the file and parsing
them for every cell cost more than reading the cell (issue 28). ``OpenFiles`` keeps up to
``MAX_OPEN`` files open (least recently used closed first) with whatever a reader parsed of
them (``OpenedFile.state``), and on every ``use`` compares the kept file's identity with the
path's now:

- a local file (a plain path or ``file://``) is one descriptor, opened non-blocking and refused
  unless it is a regular file (a FIFO swapped in never blocks a reader); its identity is
  ``(st_dev, st_ino, st_size, st_mtime_ns)`` from ``fstat``, compared with ``stat`` of the path;
- any other URL is read by fsspec ranged reads; its identity is the size and the first version
  tag ``fs.info`` gives (ETag, mtime, LastModified, ...).

A file replaced or rewritten under its path has another identity: the kept one is retired with
everything parsed from it (closed once its last reader is done) and the path opened again, so
nothing read from the old file is ever served for the new one (docs/security.md §3). A reader
holding a file (``with files.use(url) as opened``) keeps reading that one file to the end.
After a fork the child starts with nothing open (``os.register_at_fork``).
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
from fsspec.core import url_to_fs

from .._errors import SourceError

MAX_OPEN = 64
_VERSION_KEYS = (
    "ETag",
    "etag",
    "mtime",
    "LastModified",
    "last_modified",
    "updated",
    "modified",
    "created",
    "generation",
    "version_id",
)
_INSTANCES: weakref.WeakSet[OpenFiles] = weakref.WeakSet()


def local_path(url: str) -> str | None:
    """The file system path of a local URL (a plain path or ``file://``), else None."""
    if url.startswith("file://"):
        return url[len("file://") :]
    return url if "://" not in url and "::" not in url else None


def _remote_identity(fs: Any, path: str) -> tuple[int, str]:
    info = fs.info(path)
    version = next((info[k] for k in _VERSION_KEYS if info.get(k) is not None), None)
    return int(info.get("size") or 0), str(version)


def _local_identity(status: os.stat_result) -> tuple[Hashable, ...]:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


class OpenedFile:
    """One kept file: ranged reads, its size and identity, and ``state`` (what readers parsed, under ``lock``)."""

    def __init__(
        self,
        url: str,
        identity: tuple[Hashable, ...],
        size: int,
        *,
        descriptor: int = -1,
        fs: Any = None,
        path: str = "",
    ) -> None:
        self.url, self.identity, self.size = url, identity, size
        self.descriptor, self.fs, self.path = descriptor, fs, path
        self.state: dict[Any, Any] = {}
        self.lock = threading.Lock()
        self.bytes_read = [0]  # shared with its OpenFiles: bytes read from every file it kept
        self._users = 0
        self._retired = False

    @property
    def local(self) -> bool:
        """Whether this is a local descriptor (else fsspec ranged reads)."""
        return self.descriptor >= 0

    def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer only at the end of the file)."""
        size = max(0, min(size, self.size - offset))
        if size == 0 or offset < 0:
            return b""
        if not self.local:
            data: bytes = self.fs.cat_file(self.path, start=offset, end=offset + size)
        else:
            data = os.pread(self.descriptor, size, offset)
            if len(data) < size:  # a read over 2 GiB comes back in pieces
                buffer = bytearray(size)
                return bytes(buffer[: self.read_into(memoryview(buffer), offset)])
        self.bytes_read[0] += len(data)
        return data

    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset``; returns the bytes read (fewer only at the end of the file)."""
        if not self.local:
            data = self.read(offset, len(view))
            view[: len(data)] = data
            return len(data)
        done = 0
        while done < len(view):
            got = os.preadv(self.descriptor, [view[done:]], offset + done)
            if got <= 0:
                break
            done += got
        self.bytes_read[0] += done
        return done

    def mapped(self) -> pa.Buffer:
        """The whole local file memory-mapped (once; pages are read when touched)."""
        with self.lock:
            if "mapped" not in self.state:
                if self.size == 0:
                    self.state["mapped"] = pa.py_buffer(b"")
                else:
                    self.state["mapped"] = pa.py_buffer(mmap.mmap(self.descriptor, self.size, access=mmap.ACCESS_READ))
            buffer: pa.Buffer = self.state["mapped"]
            return buffer

    def _close(self) -> None:
        with self.lock:
            self.state.clear()  # a mapping goes once the last buffer sliced from it does
        if self.descriptor >= 0:
            descriptor, self.descriptor = self.descriptor, -2
            os.close(descriptor)


def _open(url: str) -> OpenedFile:
    path = local_path(url)
    if path is None:
        fs, remote = url_to_fs(url)
        identity = _remote_identity(fs, remote)
        return OpenedFile(url, identity, identity[0], fs=fs, path=remote)
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise SourceError(
                f"{url}: not a regular file (a FIFO, socket, device or folder is never read); "
                "restore the file, then re-run `omnifeed index`",
                url=url,
            )
    except BaseException:
        os.close(descriptor)
        raise
    return OpenedFile(url, _local_identity(status), status.st_size, descriptor=descriptor, path=path)


def _identity_now(url: str, kept: OpenedFile | None) -> tuple[Hashable, ...] | None:
    """The path's identity now (None when it cannot be had: the file is opened again, which says why)."""
    try:
        if kept is not None and not kept.local:
            return _remote_identity(kept.fs, kept.path)
        path = local_path(url)
        return _local_identity(os.stat(path)) if path is not None else None
    except OSError:
        return None


class OpenFiles:
    """Up to ``max_open`` files kept open, least recently used closed first; identity checked on each use."""

    def __init__(self, max_open: int = MAX_OPEN) -> None:
        self.max_open = max_open
        self._files: OrderedDict[str, OpenedFile] = OrderedDict()
        self._lock = threading.Lock()
        self.opened = 0  # files opened (again) so far
        self._bytes_read = [0]
        _INSTANCES.add(self)

    @property
    def bytes_read(self) -> int:
        """Bytes read so far from the files this kept (footers, pages, batches)."""
        return self._bytes_read[0]

    @contextmanager
    def use(self, url: str) -> Iterator[OpenedFile]:
        """The file at ``url``, open and the same as the path now; held (never closed) until the block ends.

        Raises OSError from opening it, SourceError when it is not a regular file.
        """
        opened = self._acquire(url)
        try:
            yield opened
        finally:
            with self._lock:
                opened._users -= 1
                done = opened._retired and opened._users == 0
            if done:
                opened._close()

    def _acquire(self, url: str) -> OpenedFile:
        with self._lock:
            kept = self._files.get(url)
        now = _identity_now(url, kept) if kept is not None else None
        with self._lock:
            kept = self._files.get(url)
            if kept is not None and kept.identity == now:
                self._files.move_to_end(url)
                kept._users += 1
                return kept
        fresh = _open(url)
        fresh.bytes_read = self._bytes_read
        closing: list[OpenedFile] = []
        with self._lock:
            self.opened += 1
            current = self._files.pop(url, None)
            if current is not None and current.identity == fresh.identity:  # another thread opened it meanwhile
                fresh, closing = current, [fresh]
            elif current is not None:
                closing += self._retire(current)
            self._files[url] = fresh
            fresh._users += 1
            while len(self._files) > self.max_open:
                closing += self._retire(self._files.popitem(last=False)[1])
        for old in closing:
            old._close()
        return fresh

    def _retire(self, opened: OpenedFile) -> list[OpenedFile]:
        """Mark ``opened`` retired (under the lock); it is returned to be closed now if nobody holds it."""
        opened._retired = True
        return [opened] if opened._users == 0 else []

    def clear(self) -> None:
        """Retire every kept file (each closed once its readers are done)."""
        with self._lock:
            closing = [f for opened in self._files.values() for f in self._retire(opened)]
            self._files.clear()
        for opened in closing:
            opened._close()

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's files (their descriptors are closed, nothing else touched)."""
        self._lock = threading.Lock()
        for opened in self._files.values():
            opened.lock = threading.Lock()
            opened._users, opened._retired = 0, True
            opened._close()
        self._files.clear()


def _forget_in_child() -> None:
    for files in list(_INSTANCES):
        files._after_fork()


os.register_at_fork(after_in_child=_forget_in_child)

SOURCE_FILES = OpenFiles()
"""This process's kept Parquet and Arrow source files (``_parquet_cells``, ``_arrow_files``)."""
