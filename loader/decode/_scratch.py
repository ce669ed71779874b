"""Decoded arrays from a worker process through shared memory: the pipe carries headers, never pixels.

Each decode worker process shares one scratch area with its parent: an anonymous memfd, never
named, so nothing is left to leak (no ``/dev/shm`` entry) — it is freed by the kernel with the
last process that maps it, whichever is killed first and however (``kill -9`` included)::

    parent: reserve a free block ──(function, args, block)──▶ worker: value = function(*args)
                                                              arrays copied into the block
    parent: numpy views of the block ◀── ("placed", value with headers, [(offset, dtype, shape)])
    each view's memory returns to the free list when the last array using it is garbage (a
    weakref finalizer on the view's owner): collated, dropped, or replaced, whichever comes last

A value larger than its block asks once for a block that fits (``("need", bytes)``, before
writing anything); only when none is free (the consumer holds the area) does it travel pickled
through the pipe as before (``ScratchArena.fallbacks`` counts those). Only the
parent allocates; finalizers only append to a deque that the next reservation drains, so a
garbage collection inside the allocator cannot deadlock or corrupt it.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import weakref
from collections import deque
from multiprocessing import reduction
from typing import Any

import numpy as np

ALIGN = 64
_MIN_WANT = 256 * 1024

Block = tuple[int, int]
"""(offset, size) of a reserved range of the scratch area."""


class Placed:
    """Where an array of a placed value sits: its index in the spec list that travels beside it."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[type[Placed], tuple[int]]:
        return Placed, (self.index,)


class _Region(np.ndarray):
    """The owner of one placed array's memory: views of it keep it alive, its finalizer frees the range."""


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _placeable(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and not value.dtype.hasobject


class WorkerScratch:
    """The worker's side: the mapping, and copying a value's arrays into a block the parent reserved."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer

    @staticmethod
    def needed(value: Any) -> int:
        """Bytes of scratch area that ``value``'s arrays take (0: nothing to place)."""
        arrays: list[np.ndarray] = []
        _strip(value, arrays)
        return sum(_round_up(a.nbytes) for a in arrays)

    def place(self, value: Any, block: Block) -> tuple[Any, list[tuple[int, str, tuple[int, ...]]]] | None:
        """(value with each array replaced by a `Placed`, the arrays' specs), or None if they do not fit the block."""
        arrays: list[np.ndarray] = []
        skeleton = _strip(value, arrays)
        if not arrays:
            return None
        offset, end = block[0], block[0] + block[1]
        specs = []
        for array in arrays:
            if offset + array.nbytes > end:
                return None
            specs.append((offset, array.dtype.str, tuple(array.shape)))
            offset += _round_up(array.nbytes)
        for array, (start, dtype, shape) in zip(arrays, specs):
            np.ndarray(shape, dtype, buffer=self.buffer, offset=start)[...] = array
        return skeleton, specs


def _strip(value: Any, arrays: list[np.ndarray]) -> Any:
    """``value`` with its placeable arrays (top level or in tuples and lists) taken out into ``arrays``."""
    if _placeable(value) and value.nbytes:
        arrays.append(value)
        return Placed(len(arrays) - 1)
    if isinstance(value, tuple):
        return tuple(_strip(v, arrays) for v in value)
    if isinstance(value, list):
        return [_strip(v, arrays) for v in value]
    return value


def _fill(skeleton: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(skeleton, Placed):
        return arrays[skeleton.index]
    if isinstance(skeleton, tuple):
        return tuple(_fill(v, arrays) for v in skeleton)
    if isinstance(skeleton, list):
        return [_fill(v, arrays) for v in skeleton]
    return skeleton


def _open_worker_scratch(dupfd: Any, size: int) -> WorkerScratch:
    fd = dupfd.detach()
    try:
        return WorkerScratch(mmap.mmap(fd, size))
    finally:
        os.close(fd)


class ScratchHandle:
    """What a worker process is started with: its scratch area's file descriptor (passed as the process starts)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size

    def __reduce__(self) -> tuple[Any, tuple[Any, int]]:
        return _open_worker_scratch, (reduction.DupFd(self.fd), self.size)


class ScratchArena:
    """The parent's side of one worker's scratch area: the mapping and its allocator (first fit, coalescing)."""

    def __init__(self, size: int) -> None:
        self.size = _round_up(size)
        self._fd: int | None = os.memfd_create("omnifeed-decode", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self.size)
            self.buffer = mmap.mmap(self._fd, self.size)
        except BaseException:
            self.close_fd()
            raise
        self._free: list[Block] = [(0, self.size)]  # sorted by offset, never adjacent
        self._freed: deque[Block] = deque()  # appended by finalizers, from any thread
        self._lock = threading.Lock()
        self._want = _MIN_WANT
        self.fallbacks = 0

    def handle(self) -> ScratchHandle:
        """The handle to start the worker process with (before `close_fd`)."""
        if self._fd is None:
            raise RuntimeError("the scratch area's descriptor is closed: start the worker before close_fd()")
        return ScratchHandle(self._fd, self.size)

    def close_fd(self) -> None:
        """Close the parent's descriptor once the worker has its copy (the mapping stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def reserve(self, need: int = 0) -> Block | None:
        """A free block for a call: the first as large as the largest result yet (else the largest); with ``need``,
        the first of at least ``need`` bytes. None if there is none."""
        with self._lock:
            self._drain()
            if need:
                self._want = max(self._want, need)
            index = next((i for i, (_, size) in enumerate(self._free) if size >= (need or self._want)), None)
            if index is None and (need or not self._free):
                self.fallbacks += 1  # the value comes through the pipe
                return None
            if index is None:
                index = max(range(len(self._free)), key=lambda i: self._free[i][1])
            return self._free.pop(index)

    def cancel(self, block: Block) -> None:
        """Return a reserved block unused (the value came through the pipe, or the call failed)."""
        with self._lock:
            self._insert(*block)

    def adopt(self, block: Block, skeleton: Any, specs: list[tuple[int, str, tuple[int, ...]]]) -> Any:
        """The value the worker placed in ``block``: its arrays as views, each freed when no array uses it any more."""
        arrays = []
        end = block[0]
        for offset, dtype, shape in specs:  # placed as `WorkerScratch.place` lays them out: aligned, in order
            region = _Region(shape, np.dtype(dtype), buffer=self.buffer, offset=offset)
            end = _round_up(offset + region.nbytes)
            weakref.finalize(region, self._freed.append, (offset, end - offset))
            arrays.append(region.view(np.ndarray))
        used = end - block[0]
        with self._lock:
            self._want = max(self._want, used)
            if used < block[1]:
                self._insert(block[0] + used, block[1] - used)
        return _fill(skeleton, arrays)

    def free_bytes(self) -> int:
        """Bytes of the scratch area free now (after the pending frees)."""
        with self._lock:
            self._drain()
            return sum(size for _, size in self._free)

    def _drain(self) -> None:
        while self._freed:
            self._insert(*self._freed.popleft())

    def _insert(self, offset: int, size: int) -> None:
        free = self._free
        i = bisect.bisect_left(free, (offset, 0))
        if i < len(free) and offset + size == free[i][0]:  # joins the next block
            size += free.pop(i)[1]
        if i and free[i - 1][0] + free[i - 1][1] == offset:  # joins the previous block
            offset, size = free[i - 1][0], free[i - 1][1] + size
            free[i - 1] = (offset, size)
            return
        free.insert(i, (offset, size))
