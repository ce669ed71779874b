"""The RAM tier: one byte-bounded shared-memory segment per node, shared by every process that opens it.

The segment's files are made, checked and mapped by ``_ram_file``; its header is laid out in
``_ram_layout``; its slot table and ring of entries, and how the ring makes room, are
``_ram_ring``'s `RingArena`, which `RamTier` is. This module is the tier's public operations,
its lifecycle, and the lock around them.

Every mutation happens under an exclusive ``flock`` (plus a thread lock: flock does not
exclude threads sharing a descriptor) and sets a dirty flag for its duration. A process
killed mid-mutation leaves the flag set; the next process to take the lock finds it and
empties the tier rather than serving half-written entries.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import time
import weakref
from typing import Any

import numpy as np

from ._config import RAM_TIER_NAME, RamTierConfig
from ._errors import CacheError
from ._ram_file import attach, open_private, release, remove_segment
from ._ram_layout import (
    _H_CAPACITY,
    _H_DIRTY,
    _H_ENTRIES,
    _H_HEAD,
    _H_MAGIC,
    _H_READY,
    _H_RESETS,
    _H_TAIL,
    _H_USED,
    _H_USED_AT,
    _H_VERSION,
    _HEADER_BYTES,
    _MAGIC,
    _VERSION,
    SEGMENT_PREFIX,
    _segment_name,
    _segment_path,
)
from ._ram_ring import ENTRY_HEADER, SLOT, RingArena, align, geometry, split_key
from ._ram_segments import RamSegment, find_segment, list_segments

log = logging.getLogger(__name__)


class RamTier(RingArena):
    """Byte-bounded shared-memory cache of immutable entries keyed by 16-byte digests."""

    SEGMENT_PREFIX = SEGMENT_PREFIX  # a segment's file name: this prefix, then ``RamTierConfig.name``

    def __init__(self, config: RamTierConfig) -> None:
        self.config = config
        self.name = _segment_name(config.name)
        arena, slots, width, size = geometry(config.capacity_bytes)
        self._thread_lock = threading.Lock()
        self.path = _segment_path(self.name)
        self._lock_path = self.path.with_name(self.name + ".lock")
        self._lock_fd = -1
        self._pid = -1
        self._open_lock()
        with self._locked(check_dirty=False):
            self._segment, created = attach(self.path, size)
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
        self._finalizer = weakref.finalize(self, release, self._segment, self._lock_fd)

    # -- lifecycle ---------------------------------------------------------------------------

    def _open_lock(self) -> None:
        self._lock_fd = open_private(self._lock_path, os.O_RDWR | os.O_CREAT)
        self._pid = os.getpid()

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
        remove_segment(name)

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
        self._slots[:] = np.zeros(1, dtype=SLOT)
        header[_H_RESETS] += 1
        header[_H_DIRTY] = 0

    # -- public operations -----------------------------------------------------------------------

    def get(self, key: bytes, *, count_miss: bool = True) -> bytes | None:
        """The entry's bytes, or None; counts the access for admission.

        ``count_miss=False``: a miss counts nothing (a lookup of an entry that may never be stored: neither an
        access nor a miss), so a caller does not first ask `contains` and then look the entry up again.
        """
        k0, k1 = split_key(key)
        with self._locked():
            i = self._find(k0, k1)
            if i < 0 and not count_miss:
                return None
            self._count(key)
            if i < 0:
                self._stats["misses"] += 1
                return None
            offset, length = int(self._slots[i]["offset"]), int(self._slots[i]["length"])
            data = bytes(self._arena[offset + ENTRY_HEADER : offset + ENTRY_HEADER + length])
            self._stats["hits"] += 1
            self._stats["bytes_hit"] += length
        return data

    def contains(self, key: bytes) -> bool:
        """Whether an entry is held (does not count as an access)."""
        k0, k1 = split_key(key)
        with self._locked():
            return self._find(k0, k1) >= 0

    def put(self, key: bytes, value: bytes, *, accessed: bool = True) -> bool:
        """Store an entry unless the admission rule turns it away; True when it is (now) held.

        ``accessed``: the caller's `get` of this key just missed, so its access is already counted.
        """
        size = align(ENTRY_HEADER + len(value))
        if size > self._max_entry:
            with self._thread_lock:
                self._stats["too_large"] += 1
            return False
        k0, k1 = split_key(key)
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
        """Forget an entry a reader found unusable (a later ``put`` stores anew); the ring reclaims its bytes in
        turn."""
        k0, k1 = split_key(key)
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
