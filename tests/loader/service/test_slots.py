"""A stream's segment slots: reused when free, one-offs beyond the limit, grown for a larger batch, and a slot given
up comes back under a new generation (a client never mistakes the new segment for the one it mapped)."""

from __future__ import annotations

from omnifeed.loader.service._slots import SegmentSlots


def test_slots_are_filled_to_the_limit_then_one_offs_and_a_free_segment_is_reused() -> None:
    slots = SegmentSlots()
    taken = [slots.take(limit=2) for _ in range(3)]
    assert [(s.slot, s.generation) for s in taken] == [(0, 0), (1, 0), (-1, 0)] and slots.one_offs == 1
    slots.recycle(taken[0], abandoned=False, limit=2)
    assert slots.take(limit=2) is taken[0]
    slots.recycle(taken[2], abandoned=False, limit=2)  # a one-off is never kept
    assert taken[2].fd == -1 and len(slots.kept()) == 2
    slots.close()


def test_an_abandoned_segment_is_closed_and_its_slot_comes_back_under_a_new_generation() -> None:
    slots = SegmentSlots()
    first = slots.take(limit=2)
    slots.recycle(first, abandoned=True, limit=2)  # a departed client may still read it
    assert first.fd == -1 and slots.kept() == []
    again = slots.take(limit=2)
    assert (again.slot, again.generation) == (0, 1)
    slots.close()


def test_an_overflowed_segment_grows_and_later_segments_are_as_large() -> None:
    slots = SegmentSlots()
    small = slots.take(limit=4)
    grown = slots.grow(small, needed=3 << 20)
    small.close()
    assert (grown.slot, grown.generation) == (0, 1) and grown.size >= 3 << 20 and slots.kept() == [grown]
    assert slots.take(limit=4).size == grown.size
    slots.close()


def test_free_segments_beyond_a_smaller_limit_are_closed_when_the_group_shrinks() -> None:
    slots = SegmentSlots()
    taken = [slots.take(limit=4) for _ in range(4)]
    for segment in taken:
        slots.recycle(segment, abandoned=False, limit=4)
    slots.trim(limit=2)
    assert [s.slot for s in slots.kept()] == [0, 1] and taken[3].fd == -1
    assert (slots.take(limit=4).slot, slots.take(limit=4).slot) in {(0, 1), (1, 0)}  # the free ones first
    assert slots.take(limit=4).generation == 1  # slot 2 was given up
    slots.close()
