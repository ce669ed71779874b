"""`SegmentSlots`: a stream's shared-memory segments, one per slot, reused from batch to batch.

A stream keeps at most ``limit`` slots (``prefetch_batches + 2 × peers + 2``: the stream says,
as its peer group changes). A batch goes to a free segment, else to a new one in an empty slot,
else (clients hold every slot) to a one-off segment (slot -1) that is forgotten once sent.
Every segment is at least as large as the largest batch so far (``size``), so a batch that
overflows its segment grows the size for all of them. A slot given up (a shrunken group, or a
segment a departed client may still read) gets its next segment under a new generation: a
client never mistakes the new segment for the one it mapped. Not locked: the stream calls it
holding its own lock.
"""

from __future__ import annotations

from ._arena import Segment, grown_size


class SegmentSlots:
    """The segments of one stream by slot: free ones, the size of the next, generations of slots given up."""

    def __init__(self) -> None:
        self._slots: list[Segment | None] = []  # None: a slot given up when the peer group shrank
        self._free: list[Segment] = []
        self._next_generation: dict[
            int, int
        ] = {}  # of slots given up: a new segment there is never mistaken for the old
        self.size = 0  # bytes of new and reused segments: grown_size of the largest batch so far
        self.one_offs = 0  # batches sent in one-off segments because clients held every slot

    def take(self, limit: int) -> Segment:
        """A segment for the next batch, at least ``size`` bytes: sized per slot, every slot would overflow on its own
        and its batch be collated twice (one epoch of the mixed benchmark did that for most batches)."""
        if self._free:
            segment = self._free.pop()
            if segment.size >= self.size:
                return segment
            grown = Segment(segment.slot, segment.generation + 1, self.size)
            self._slots[segment.slot] = grown
            segment.close()
            return grown
        slot = next((i for i, s in enumerate(self._slots[:limit]) if s is None), None)
        if slot is None and len(self._slots) < limit:
            slot = len(self._slots)
            self._slots.append(None)
        if slot is not None:
            segment = Segment(slot, self._next_generation.pop(slot, 0), self.size)
            self._slots[slot] = segment
            return segment
        self.one_offs += 1
        return Segment(-1, 0, self.size)  # clients hold every slot: a one-off

    def grow(self, segment: Segment, needed: int) -> Segment:
        """The segment that replaces ``segment`` after a batch of ``needed`` bytes overflowed it (the caller closes
        the old one); every later segment is at least as large."""
        self.size = max(self.size, grown_size(needed))
        grown = Segment(segment.slot, segment.generation + 1, self.size)
        if segment.slot >= 0:
            self._slots[segment.slot] = grown
        return grown

    def recycle(self, segment: Segment, abandoned: bool, limit: int) -> None:
        """No client holds ``segment``'s batch any more: free again, or closed if a departed client may read it
        (``abandoned``) or it is a one-off."""
        mine = 0 <= segment.slot < len(self._slots) and self._slots[segment.slot] is segment
        if mine and not abandoned:
            self._free.append(segment)
            self.trim(limit)
            return
        if mine:  # a departed client may read it: the slot gets a fresh segment (a new generation) when next needed
            self._give_up(segment)
            self.trim(limit)
        segment.close()

    def trim(self, limit: int) -> None:
        """Close free segments in slots at or beyond ``limit`` (the peer group shrank)."""
        for segment in [s for s in self._free if s.slot >= limit]:
            self._free.remove(segment)
            if 0 <= segment.slot < len(self._slots) and self._slots[segment.slot] is segment:
                self._give_up(segment)
            segment.close()
        while self._slots and self._slots[-1] is None:
            self._slots.pop()

    def _give_up(self, segment: Segment) -> None:
        self._slots[segment.slot] = None
        self._next_generation[segment.slot] = segment.generation + 1

    def kept(self) -> list[Segment]:
        """The segments held in slots (one-offs aside)."""
        return [s for s in self._slots if s is not None]

    def close(self) -> None:
        """Close every segment held in a slot (idempotent)."""
        for segment in self.kept():
            segment.close()
        self._slots.clear()
        self._free.clear()
