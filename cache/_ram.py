"""The RAM tier: one byte-bounded shared-memory segment per node, shared by every process that opens it.

Layout of the segment (all little-endian)::

    header   4 KiB   magic, geometry, ring head/tail, occupancy, a dirty flag, time of last use (``_ram_layout``)
    slots    n x 32  open-addressing table: key (16 B), arena offset, length, in-use flag
    sketch   4 x w   frequency counters (admission)
    arena            a ring of entries: [key 16 B | length 4 B | pad 4 B | data], 8-byte aligned

New entries are appended at the ring's tail; space is made at its head. The entry at the
head is evicted unless it has been used at least as often as the newcomer, in which case
it is copied to the tail (a FIFO with frequency-guarded reinsertion, see `_sketch.py`).

Every mutation happens under an exclusive ``flock`` (plus a thread lock: flock does not
exclude threads sharing a descriptor) and sets a dirty flag for its duration. A process
killed mid-mutation leaves the flag set; the next process to take the lock finds it and
empties the tier rather than serving half-written entries.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from ._config import RAM_TIER_NAME, RamTierConfig
from ._errors import CacheError
from ._ram_layout import (
    _H_CAPACITY,
    _H_DIRTY,
    _H_ENTRIES,
    _H_HEAD,
    _H_MAGIC,
    _H_READY,
    _H_RESETS,
    _H_SKETCH_OPS,
    _H_SLOTS,
    _H_TAIL,
    _H_USED,
    _H_USED_AT,
    _H_VERSION,
    _H_WIDTH,
    _HEADER_BYTES,
    _MAGIC,
    _VERSION,
    SEGMENT_PREFIX,
    _segment_name,
    _segment_path,
)
from ._ram_segments import RamSegment, find_segment, list_segments
from ._sketch import SCAN_LIMIT, FrequencySketch, keeps_victim

log = logging.getLogger(__name__)

_ENTRY_HEADER = 24
_WRAP = 0xFFFFFFFF
_SLOT = np.dtype(
    [("k0", "<u8"), ("k1", "<u8"), ("offset", "<u8"), ("length", "<u4"), ("used", "u1"), ("_pad", "u1", 3)]
)
_AVERAGE_ENTRY = 4096  # sizing assumption for the slot table and the sketch


def _align(n: int) -> int:
    return (n + 7) & ~7


def _attach(path: Path, size: int) -> tuple[mmap.mmap, bool]:
    """Map the segment, creating it with ``size`` bytes if it does not exist; (mapping, created).

    A plain file in /dev/shm and ``mmap`` rather than ``multiprocessing.shared_memory``: the
    segment outlives its creator on purpose (a restarted trainer finds it warm), which the
    latter's resource tracker fights (before Python 3.13 it unlinks segments at exit).
    """
    try:
        fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), True
    except FileExistsError:
        fd, created = _open_private(path, os.O_RDWR), False
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


def _open_private(path: Path, flags: int, mode: int = 0o600) -> int:
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


class RamTier:
    """Byte-bounded shared-memory cache of immutable entries keyed by 16-byte digests."""

    SEGMENT_PREFIX = SEGMENT_PREFIX  # a segment's file name: this prefix, then ``RamTierConfig.name``

    def __init__(self, config: RamTierConfig) -> None:
        self.config = config
        self.name = _segment_name(config.name)
        arena = _align(config.capacity_bytes)
        slots = 1 << max(10, (2 * arena // _AVERAGE_ENTRY - 1).bit_length())
        width = FrequencySketch.width_for(arena // _AVERAGE_ENTRY)
        self._thread_lock = threading.Lock()
        self.path = _segment_path(self.name)
        self._lock_path = self.path.with_name(self.name + ".lock")
        self._lock_fd = -1
        self._pid = -1
        self._open_lock()
        with self._locked(check_dirty=False):
            self._segment, created = _attach(
                self.path, _HEADER_BYTES + slots * _SLOT.itemsize + FrequencySketch.nbytes(width) + arena
            )
            self._header = np.frombuffer(self._segment, dtype="<u8", count=_HEADER_BYTES // 8)
            if created or self._header[_H_READY] != 1:
                self._initialise(arena, slots, width)
            elif int(self._header[_H_MAGIC]) != _MAGIC or int(self._header[_H_VERSION]) != _VERSION:
                self._header = None  # type: ignore[assignment]
                self._segment.close()
                raise CacheError(
                    f"shared-memory segment {self.path} is not an omnifeed RAM tier of this version: "
                    "remove it (or pick another ram.name)"
                )
            elif int(self._header[_H_CAPACITY]) != arena:
                log.warning(
                    "RAM tier %s exists with %d bytes of capacity, not the %d configured: using it as it is "
                    "(remove %s to resize it)",
                    self.name,
                    int(self._header[_H_CAPACITY]),
                    arena,
                    self.path,
                )
            self._map()
            self._header[_H_USED_AT] = int(time.time())
        self.capacity = int(self._header[_H_CAPACITY])
        log.info(
            "RAM tier: %s shared-memory segment %s (%d bytes, %d entries); it outlives this process on purpose, "
            "remove it with `omnifeed cache remove %s`",
            "created" if created else "attached to",
            self.path,
            self.capacity,
            int(self._header[_H_ENTRIES]),
            config.name,
        )
        self._max_entry = int(self.capacity * config.max_entry_fraction)
        self._stats = {
            "hits": 0,
            "misses": 0,
            "bytes_hit": 0,
            "puts": 0,
            "bytes_put": 0,
            "rejected": 0,
            "evicted": 0,
            "reinserted": 0,
            "too_large": 0,
            "discarded": 0,
        }
        self._finalizer = weakref.finalize(self, RamTier._release, self._segment, self._lock_fd)

    # -- lifecycle ---------------------------------------------------------------------------

    def _open_lock(self) -> None:
        self._lock_fd = _open_private(self._lock_path, os.O_RDWR | os.O_CREAT)
        self._pid = os.getpid()

    def _initialise(self, arena: int, slots: int, width: int) -> None:
        header = self._header
        header[:] = 0
        header[_H_MAGIC], header[_H_VERSION], header[_H_CAPACITY] = _MAGIC, _VERSION, arena
        header[_H_SLOTS], header[_H_WIDTH] = slots, width
        body = np.frombuffer(
            self._segment,
            dtype=np.uint8,
            offset=_HEADER_BYTES,
            count=slots * _SLOT.itemsize + FrequencySketch.nbytes(width),
        )
        body[:] = 0
        header[_H_READY] = 1

    def _map(self) -> None:
        header, buf = self._header, self._segment
        slots, width, arena = int(header[_H_SLOTS]), int(header[_H_WIDTH]), int(header[_H_CAPACITY])
        self._slots = np.frombuffer(buf, dtype=_SLOT, offset=_HEADER_BYTES, count=slots)
        self._mask = slots - 1
        sketch_at = _HEADER_BYTES + slots * _SLOT.itemsize
        counters = np.frombuffer(buf, dtype=np.uint8, offset=sketch_at, count=FrequencySketch.nbytes(width))
        self._sketch = FrequencySketch(counters, width, sample_size=10 * max(1024, arena // _AVERAGE_ENTRY))
        arena_at = sketch_at + FrequencySketch.nbytes(width)
        self._arena = memoryview(buf)[arena_at : arena_at + arena]
        self._max_entries = slots // 2

    def close(self) -> None:
        """Detach from the segment (it stays for the node's other processes; `unlink` removes it)."""
        if self._finalizer.alive:
            self._arena.release()
            self._header = self._slots = self._sketch = None  # type: ignore[assignment]
            self._finalizer()

    def unlink(self) -> None:
        """Close, and remove the segment from the node (processes still attached keep their mapping)."""
        self.close()
        RamTier.remove(self.config.name)

    @staticmethod
    def remove(name: str) -> None:
        """Remove the node's segment called ``name`` (``RamTierConfig.name``), if there is one."""
        path = _segment_path(_segment_name(name))
        for file in (path, path.with_name(path.name + ".lock")):
            file.unlink(missing_ok=True)

    @staticmethod
    def segments() -> list[RamSegment]:
        """The RAM tier segments on this node (every user's), by name; a file merely named like one is left out.

        Read without locking or mapping: the figures are a snapshot. `omnifeed cache list` prints them.
        """
        return list_segments()

    @staticmethod
    def segment(name: str) -> RamSegment | None:
        """The segment called ``name`` (``RamTierConfig.name``); None when there is none, or the file is not one.

        Raises ValueError for a name no RAM tier can have (it would name a file elsewhere).
        """
        if not re.fullmatch(RAM_TIER_NAME, name):
            raise ValueError(f"{name!r} is not a RAM tier name (letters, digits, _ . -)")
        return find_segment(name)

    @staticmethod
    def _release(segment: mmap.mmap, lock_fd: int) -> None:
        try:
            segment.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes when it does
            pass
        try:
            os.close(lock_fd)
        except OSError:
            pass

    def __enter__(self) -> RamTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])  # type: ignore[misc]

    # -- locking -------------------------------------------------------------------------------

    class _Locked:
        def __init__(self, tier: RamTier, check_dirty: bool) -> None:
            self.tier, self.check_dirty = tier, check_dirty

        def __enter__(self) -> None:
            tier = self.tier
            tier._thread_lock.acquire()
            if tier._pid != os.getpid():  # a forked child must not share the parent's flock
                tier._open_lock()
            fcntl.flock(tier._lock_fd, fcntl.LOCK_EX)
            if self.check_dirty and tier._header[_H_DIRTY]:
                tier._reset("a process died while changing it")

        def __exit__(self, *exc: object) -> None:
            fcntl.flock(self.tier._lock_fd, fcntl.LOCK_UN)
            self.tier._thread_lock.release()

    def _locked(self, check_dirty: bool = True) -> RamTier._Locked:
        return RamTier._Locked(self, check_dirty)

    def _reset(self, why: str) -> None:
        log.warning("RAM tier %s emptied: %s", self.name, why)
        header = self._header
        header[_H_HEAD] = header[_H_TAIL] = header[_H_USED] = header[_H_ENTRIES] = 0
        self._slots[:] = np.zeros(1, dtype=_SLOT)
        header[_H_RESETS] += 1
        header[_H_DIRTY] = 0

    # -- slot table (linear probing, backward-shift deletion) ---------------------------------

    def _find(self, k0: int, k1: int) -> int:
        slots, mask = self._slots, self._mask
        i = k0 & mask
        while slots[i]["used"]:
            if slots[i]["k0"] == k0 and slots[i]["k1"] == k1:
                return i
            i = (i + 1) & mask
        return -(i + 1)  # where it would go

    def _remove_slot(self, i: int) -> None:
        slots, mask = self._slots, self._mask
        j = i
        while True:
            j = (j + 1) & mask
            if not slots[j]["used"]:
                break
            home = int(slots[j]["k0"]) & mask
            if (i <= j and (home <= i or home > j)) or (i > j and (home <= i and home > j)):
                slots[i] = slots[j]
                i = j
        slots[i]["used"] = 0

    # -- public operations -----------------------------------------------------------------------

    def get(self, key: bytes, *, count_miss: bool = True) -> bytes | None:
        """The entry's bytes, or None; counts the access for admission.

        ``count_miss=False``: a miss counts nothing (a lookup of an entry that may never be stored: neither an
        access nor a miss), so a caller does not first ask `contains` and then look the entry up again.
        """
        k0, k1 = _split(key)
        with self._locked():
            i = self._find(k0, k1)
            if i < 0 and not count_miss:
                return None
            self._count(key)
            if i < 0:
                self._stats["misses"] += 1
                return None
            offset, length = int(self._slots[i]["offset"]), int(self._slots[i]["length"])
            data = bytes(self._arena[offset + _ENTRY_HEADER : offset + _ENTRY_HEADER + length])
            self._stats["hits"] += 1
            self._stats["bytes_hit"] += length
        return data

    def contains(self, key: bytes) -> bool:
        """Whether an entry is held (does not count as an access)."""
        k0, k1 = _split(key)
        with self._locked():
            return self._find(k0, k1) >= 0

    def put(self, key: bytes, value: bytes, *, accessed: bool = True) -> bool:
        """Store an entry unless the admission rule turns it away; True when it is (now) held.

        ``accessed``: the caller's `get` of this key just missed, so its access is already counted.
        """
        size = _align(_ENTRY_HEADER + len(value))
        if size > self._max_entry:
            with self._thread_lock:
                self._stats["too_large"] += 1
            return False
        k0, k1 = _split(key)
        with self._locked():
            if self._find(k0, k1) >= 0:
                return True
            newcomer = self._sketch.estimate(key) - (1 if accessed else 0)
            self._header[_H_USED_AT] = int(time.time())
            self._header[_H_DIRTY] = 1
            try:
                at = self._make_room(size, newcomer)
                if at < 0:
                    self._stats["rejected"] += 1
                    return False
                self._write(at, k0, k1, value)
            finally:
                self._header[_H_DIRTY] = 0
            self._stats["puts"] += 1
            self._stats["bytes_put"] += len(value)
        return True

    def discard(self, key: bytes) -> None:
        """Forget an entry a reader found unusable (a later ``put`` stores anew); the ring reclaims its bytes in turn."""
        k0, k1 = _split(key)
        with self._locked():
            i = self._find(k0, k1)
            if i >= 0:
                self._remove_slot(i)
                self._stats["discarded"] += 1

    def stats(self) -> dict[str, Any]:
        """This process's hits/misses/bytes, and the tier's occupancy (node-wide)."""
        header = self._header
        return {
            **self._stats,
            "entries": int(header[_H_ENTRIES]),
            "bytes_used": int(header[_H_USED]),
            "capacity_bytes": self.capacity,
            "resets": int(header[_H_RESETS]),
        }

    def clear(self) -> None:
        """Drop every entry."""
        with self._locked():
            self._header[_H_DIRTY] = 1
            self._reset("cleared")

    # -- ring ------------------------------------------------------------------------------------

    def _count(self, key: bytes) -> None:
        self._sketch.increment(key)
        header = self._header
        header[_H_USED_AT] = int(time.time())
        header[_H_SKETCH_OPS] += 1
        if header[_H_SKETCH_OPS] >= self._sketch.sample_size:
            header[_H_SKETCH_OPS] = 0
            self._sketch.halve()

    def _contiguous_at_tail(self, size: int) -> int:
        """Where ``size`` bytes fit at the tail now (wrapping if that helps), else -1."""
        header, cap = self._header, self.capacity
        head, tail, used = int(header[_H_HEAD]), int(header[_H_TAIL]), int(header[_H_USED])
        if used == 0:
            header[_H_HEAD] = header[_H_TAIL] = 0
            return 0 if size <= cap else -1
        if cap - used < size:
            return -1
        if tail < head:
            return tail if head - tail >= size else -1
        if cap - tail >= size:
            return tail
        if head >= size:  # wrap: the bytes after the tail are wasted until the head passes them
            if cap - tail >= _ENTRY_HEADER:
                self._entry_header(tail)[4] = _WRAP
            header[_H_USED] += cap - tail
            header[_H_TAIL] = 0
            return 0
        return -1

    def _entry_header(self, at: int) -> np.ndarray:
        return np.frombuffer(self._arena, dtype="<u4", count=6, offset=at)

    def _make_room(self, size: int, newcomer: int) -> int:
        """Where the newcomer goes after making room at the head, or -1 when it is turned away."""
        header = self._header
        while True:
            if int(header[_H_ENTRIES]) < self._max_entries:
                at = self._contiguous_at_tail(size)
                if at >= 0:
                    return at
            kept = self._victims_kept(newcomer)
            if kept is None:
                return -1
            for _ in range(kept):
                self._requeue_head()
            self._pop_head()
            self._stats["evicted"] += 1

    def _skip_wrap(self, at: int) -> int:
        cap = self.capacity
        if cap - at < _ENTRY_HEADER or self._entry_header(at)[4] == _WRAP:
            return 0
        return at

    def _entry_at(self, at: int) -> tuple[bytes, int]:
        fields = self._entry_header(at)
        return bytes(self._arena[at : at + 16]), int(fields[4])

    def _live(self, key: bytes, at: int) -> int:
        """The slot of the entry at ``at``, or -1 when it was discarded (its key gone, or held anew elsewhere)."""
        i = self._find(*_split(key))
        return i if i >= 0 and int(self._slots[i]["offset"]) == at else -1

    def _victims_kept(self, newcomer: int) -> int | None:
        """How many head entries outrank the newcomer before one it displaces; None if the first SCAN_LIMIT all do."""
        at = int(self._header[_H_HEAD])
        for n in range(min(SCAN_LIMIT, int(self._header[_H_ENTRIES]))):
            at = self._skip_wrap(at)
            key, length = self._entry_at(at)
            if self._live(key, at) < 0 or not keeps_victim(self._sketch.estimate(key), newcomer):
                return n
            at += _align(_ENTRY_HEADER + length)
        return None

    def _pop_head(self) -> tuple[bytes, int]:
        """Remove the entry at the head; (its key, its length)."""
        header, cap = self._header, self.capacity
        head = int(header[_H_HEAD])
        at = self._skip_wrap(head)
        if at != head:
            header[_H_USED] -= cap - head
        key, length = self._entry_at(at)
        size = _align(_ENTRY_HEADER + length)
        slot = self._live(key, at)
        if slot >= 0:  # a discarded entry has no slot left to remove (or its key's slot is a newer entry's)
            self._remove_slot(slot)
        header[_H_HEAD] = (at + size) % cap
        header[_H_USED] -= size
        header[_H_ENTRIES] -= 1
        return key, at

    def _requeue_head(self) -> None:
        """Second chance: move the head entry to the tail (room is there: popping it freed as much)."""
        key, at = self._pop_head()
        length = int(self._entry_header(at)[4])
        data = bytes(self._arena[at + _ENTRY_HEADER : at + _ENTRY_HEADER + length])
        to = self._contiguous_at_tail(_align(_ENTRY_HEADER + length))
        assert to >= 0, "a requeued entry always fits where it was freed"
        self._write(to, *_split(key), data)
        self._stats["reinserted"] += 1

    def _write(self, at: int, k0: int, k1: int, value: bytes) -> None:
        header = self._header
        size = _align(_ENTRY_HEADER + len(value))
        np.frombuffer(self._arena, dtype="<u8", count=2, offset=at)[:] = (k0, k1)
        self._entry_header(at)[4] = len(value)
        self._arena[at + _ENTRY_HEADER : at + _ENTRY_HEADER + len(value)] = value
        where = self._find(k0, k1)
        slot = self._slots[-where - 1]
        slot["k0"], slot["k1"], slot["offset"], slot["length"], slot["used"] = k0, k1, at, len(value), 1
        header[_H_TAIL] = (at + size) % self.capacity
        header[_H_USED] += size
        header[_H_ENTRIES] += 1


def _split(key: bytes) -> tuple[int, int]:
    if len(key) != 16:
        raise ValueError(f"cache keys are 16-byte digests, got {len(key)} bytes")
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
