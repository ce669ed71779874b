"""The RAM tier segment's body: an open-addressing slot table and a ring arena of entries, with frequency-guarded
eviction.

Layout of the segment (all little-endian)::

    header   4 KiB   magic, geometry, ring head/tail, occupancy, a dirty flag, time of last use (``_ram_layout``)
    slots    n x 32  open-addressing table: key (16 B), arena offset, length, in-use flag
    sketch   4 x w   frequency counters (admission)
    arena            a ring of entries: [key 16 B | length 4 B | pad 4 B | data], 8-byte aligned

New entries are appended at the ring's tail; space is made at its head. The entry at the
head is evicted unless it has been used at least as often as the newcomer, in which case
it is copied to the tail (a FIFO with frequency-guarded reinsertion, see `_sketch.py`).

`RingArena` is the part of `RamTier` that reads and changes these tables; the tier (``_ram``)
calls it with its lock held (and the dirty flag set around every change to the ring).
"""

from __future__ import annotations

import mmap
import time

import numpy as np

from ._ram_layout import (
    _H_CAPACITY,
    _H_ENTRIES,
    _H_HEAD,
    _H_MAGIC,
    _H_READY,
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
)
from ._sketch import SCAN_LIMIT, FrequencySketch, keeps_victim

ENTRY_HEADER = 24
_WRAP = 0xFFFFFFFF
SLOT = np.dtype([("k0", "<u8"), ("k1", "<u8"), ("offset", "<u8"), ("length", "<u4"), ("used", "u1"), ("_pad", "u1", 3)])
AVERAGE_ENTRY = 4096  # sizing assumption for the slot table and the sketch


def align(n: int) -> int:
    """``n`` rounded up to a multiple of 8."""
    return (n + 7) & ~7


def geometry(capacity_bytes: int) -> tuple[int, int, int, int]:
    """(arena bytes, slots, sketch width, segment bytes) of a segment holding ``capacity_bytes`` of entries."""
    arena = align(capacity_bytes)
    slots = 1 << max(10, (2 * arena // AVERAGE_ENTRY - 1).bit_length())
    width = FrequencySketch.width_for(arena // AVERAGE_ENTRY)
    return arena, slots, width, _HEADER_BYTES + slots * SLOT.itemsize + FrequencySketch.nbytes(width) + arena


def split_key(key: bytes) -> tuple[int, int]:
    """A 16-byte key as the two little-endian uint64 a slot holds; ValueError for any other length."""
    if len(key) != 16:
        raise ValueError(f"cache keys are 16-byte digests, got {len(key)} bytes")
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")


class RingArena:
    """The slot table, sketch and ring of a mapped segment; `RamTier` is one (its lock held around every call)."""

    capacity: int
    _segment: mmap.mmap
    _header: np.ndarray
    _slots: np.ndarray
    _mask: int
    _sketch: FrequencySketch
    _arena: memoryview
    _max_entries: int
    _stats: dict[str, int]

    def _initialise(self, arena: int, slots: int, width: int) -> None:
        header = self._header
        header[:] = 0
        header[_H_MAGIC], header[_H_VERSION], header[_H_CAPACITY] = _MAGIC, _VERSION, arena
        header[_H_SLOTS], header[_H_WIDTH] = slots, width
        body = np.frombuffer(
            self._segment,
            dtype=np.uint8,
            offset=_HEADER_BYTES,
            count=slots * SLOT.itemsize + FrequencySketch.nbytes(width),
        )
        body[:] = 0
        header[_H_READY] = 1

    def _map(self) -> None:
        header, buf = self._header, self._segment
        slots, width, arena = int(header[_H_SLOTS]), int(header[_H_WIDTH]), int(header[_H_CAPACITY])
        self._slots = np.frombuffer(buf, dtype=SLOT, offset=_HEADER_BYTES, count=slots)
        self._mask = slots - 1
        sketch_at = _HEADER_BYTES + slots * SLOT.itemsize
        counters = np.frombuffer(buf, dtype=np.uint8, offset=sketch_at, count=FrequencySketch.nbytes(width))
        self._sketch = FrequencySketch(counters, width, sample_size=10 * max(1024, arena // AVERAGE_ENTRY))
        arena_at = sketch_at + FrequencySketch.nbytes(width)
        self._arena = memoryview(buf)[arena_at : arena_at + arena]
        self._max_entries = slots // 2

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
            if cap - tail >= ENTRY_HEADER:
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
        if cap - at < ENTRY_HEADER or self._entry_header(at)[4] == _WRAP:
            return 0
        return at

    def _entry_at(self, at: int) -> tuple[bytes, int]:
        fields = self._entry_header(at)
        return bytes(self._arena[at : at + 16]), int(fields[4])

    def _live(self, key: bytes, at: int) -> int:
        """The slot of the entry at ``at``, or -1 when it was discarded (its key gone, or held anew elsewhere)."""
        i = self._find(*split_key(key))
        return i if i >= 0 and int(self._slots[i]["offset"]) == at else -1

    def _victims_kept(self, newcomer: int) -> int | None:
        """How many head entries outrank the newcomer before one it displaces; None if the first SCAN_LIMIT all do."""
        at = int(self._header[_H_HEAD])
        for n in range(min(SCAN_LIMIT, int(self._header[_H_ENTRIES]))):
            at = self._skip_wrap(at)
            key, length = self._entry_at(at)
            if self._live(key, at) < 0 or not keeps_victim(self._sketch.estimate(key), newcomer):
                return n
            at += align(ENTRY_HEADER + length)
        return None

    def _pop_head(self) -> tuple[bytes, int]:
        """Remove the entry at the head; (its key, its offset in the arena)."""
        header, cap = self._header, self.capacity
        head = int(header[_H_HEAD])
        at = self._skip_wrap(head)
        if at != head:
            header[_H_USED] -= cap - head
        key, length = self._entry_at(at)
        size = align(ENTRY_HEADER + length)
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
        data = bytes(self._arena[at + ENTRY_HEADER : at + ENTRY_HEADER + length])
        to = self._contiguous_at_tail(align(ENTRY_HEADER + length))
        assert to >= 0, "a requeued entry always fits where it was freed"
        self._write(to, *split_key(key), data)
        self._stats["reinserted"] += 1

    def _write(self, at: int, k0: int, k1: int, value: bytes) -> None:
        header = self._header
        size = align(ENTRY_HEADER + len(value))
        np.frombuffer(self._arena, dtype="<u8", count=2, offset=at)[:] = (k0, k1)
        self._entry_header(at)[4] = len(value)
        self._arena[at + ENTRY_HEADER : at + ENTRY_HEADER + len(value)] = value
        where = self._find(k0, k1)
        slot = self._slots[-where - 1]
        slot["k0"], slot["k1"], slot["offset"], slot["length"], slot["used"] = k0, k1, at, len(value), 1
        header[_H_TAIL] = (at + size) % self.capacity
        header[_H_USED] += size
        header[_H_ENTRIES] += 1
