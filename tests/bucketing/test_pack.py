"""Packing: first-fit decreasing, overlong samples, borrowing from the lookahead, pack layout."""

from __future__ import annotations

import pickle
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.bucketing import OverlongSampleError, Pack, Segment, pack_window


def _layout(packs: list[Pack]) -> list[list[tuple[int, int, int]]]:
    """Packs as lists of (position, start, stop)."""
    return [[(s.position, s.start, s.stop) for s in pack.segments] for pack in packs]


def _reference_ffd(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing, written the slow obvious way: input indices per pack."""
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = next((j for j, r in enumerate(room) if r >= lengths[i]), len(packs))
        if j == len(packs):
            packs.append([])
            room.append(capacity)
        packs[j].append(i)
        room[j] -= lengths[i]
    return packs


def test_first_fit_decreasing_places_longest_first() -> None:
    packs, borrowed = pack_window(np.array([10, 11, 12, 13, 14]), np.array([3, 6, 5, 2, 4]), 10)
    assert borrowed == 0
    # sorted: 11(6) 12(5) 14(4) 10(3) 13(2) -> [11, 14], [12, 10, 13]
    assert _layout(packs) == [[(11, 0, 6), (14, 0, 4)], [(12, 0, 5), (10, 0, 3), (13, 0, 2)]]


def test_equal_lengths_keep_input_order() -> None:
    packs, _ = pack_window(np.array([7, 3, 5, 1]), np.array([4, 4, 4, 4]), 8)
    assert [pack.positions.tolist() for pack in packs] == [[7, 3], [5, 1]]


@pytest.mark.parametrize(
    ("lengths", "expected"),
    [
        ([0], [[(0, 0, 0)]]),  # only absent samples: one empty pack holds them
        ([0, 0], [[(0, 0, 0), (1, 0, 0)]]),
        ([0, 5, 0], [[(1, 0, 5), (0, 0, 0), (2, 0, 0)]]),
        ([6, 0, 6], [[(0, 0, 6), (1, 0, 0)], [(2, 0, 6)]]),  # the first pack, even when full
        ([], []),
    ],
)
def test_zero_length_samples_join_the_first_pack(
    lengths: list[int], expected: list[list[tuple[int, int, int]]]
) -> None:
    packs, _ = pack_window(np.arange(len(lengths)), np.array(lengths, dtype=np.int64), 6)
    assert _layout(packs) == expected


def test_overlong_sample_is_rejected_with_what_to_do() -> None:
    with pytest.raises(OverlongSampleError, match="overlong='split'") as caught:
        pack_window(np.array([4, 5, 6]), np.array([3, 12, 20]), 10)
    error = caught.value
    assert (error.position, error.length, error.capacity) == (5, 12, 10)  # the first in input order
    assert isinstance(error, ValueError)
    again = pickle.loads(pickle.dumps(error))
    assert (again.position, again.length, again.capacity, str(again)) == (5, 12, 10, str(error))


@pytest.mark.parametrize(
    ("lengths", "expected"),
    [
        ([25], [[(0, 0, 10)], [(0, 10, 20)], [(0, 20, 25)]]),
        ([20], [[(0, 0, 10)], [(0, 10, 20)]]),  # an exact multiple leaves no remainder
        ([3, 14, 12], [[(1, 0, 10)], [(2, 0, 10)], [(1, 10, 14), (0, 0, 3), (2, 10, 12)]]),
        ([10, 11], [[(1, 0, 10)], [(0, 0, 10)], [(1, 10, 11)]]),  # exactly capacity is not overlong
    ],
)
def test_split_emits_full_packs_first_then_packs_remainders(
    lengths: list[int], expected: list[list[tuple[int, int, int]]]
) -> None:
    packs, _ = pack_window(np.arange(len(lengths)), np.array(lengths), 10, overlong="split")
    assert _layout(packs) == expected


@pytest.mark.parametrize(
    ("extra", "borrowed"),
    [
        ([1, 2], 2),
        ([3, 1], 0),  # the first does not fit: stop, though the second would
        ([2, 5, 1], 1),
        ([0, 2, 2], 2),  # zero-length fits anywhere; then room is gone
        ([11], 0),  # overlong stops borrowing, never raises
        ([], 0),
    ],
)
def test_borrowing_takes_a_prefix_of_the_lookahead(extra: list[int], borrowed: int) -> None:
    packs, used = pack_window(
        np.array([0, 1]),
        np.array([8, 9]),
        10,
        lookahead_positions=np.arange(100, 100 + len(extra)),
        lookahead_lengths=np.array(extra, dtype=np.int64),
    )
    assert used == borrowed
    assert len(packs) == 2  # borrowing never opens a pack
    assert sorted(p for pack in packs for p in pack.positions.tolist() if p >= 100) == list(range(100, 100 + borrowed))


def test_empty_window_borrows_nothing() -> None:
    empty = np.zeros(0, dtype=np.int64)
    packs, used = pack_window(empty, empty, 8, lookahead_positions=np.array([1]), lookahead_lengths=np.array([0]))
    assert (packs, used) == ([], 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 0}, "capacity"),
        ({"lengths": np.array([1, 2])}, "1-D of one size"),
        ({"lengths": np.array([-1, 2, 3])}, "non-negative"),
        ({"lookahead_positions": np.array([1])}, "both"),
        ({"overlong": "truncate"}, "overlong"),
    ],
)
def test_malformed_arguments_are_rejected(kwargs: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {"positions": np.arange(3), "lengths": np.array([1, 2, 3]), "capacity": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        pack_window(**arguments)


def test_pack_layout_is_flash_attention_varlen() -> None:
    pack = Pack((Segment(7, 10, 14), Segment(3, 0, 0), Segment(5, 0, 2)))
    assert pack.length == 6
    assert pack.positions.tolist() == [7, 3, 5] and pack.positions.dtype == np.int64
    assert pack.cu_seqlens.tolist() == [0, 4, 4, 6] and pack.cu_seqlens.dtype == np.int32
    assert pack.position_ids.tolist() == [10, 11, 12, 13, 0, 1]  # a split piece continues its numbering
    assert pack.position_ids.dtype == np.int64
    empty = Pack(())
    assert (empty.length, empty.cu_seqlens.tolist(), empty.position_ids.tolist()) == (0, [0], [])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30), st.integers(1, 40))
def test_packing_matches_reference_first_fit_decreasing(lengths: list[int], capacity: int) -> None:
    fitting = [min(length, capacity) for length in lengths]
    packs, _ = pack_window(np.arange(len(fitting)) + 1000, np.array(fitting, dtype=np.int64), capacity)
    assert [(pack.positions - 1000).tolist() for pack in packs] == _reference_ffd(fitting, capacity)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.integers(0, 60), max_size=25),
    st.lists(st.integers(0, 30), max_size=10),
    st.integers(1, 25),
)
def test_split_packs_cover_every_token_once_within_capacity(
    lengths: list[int], extra: list[int], capacity: int
) -> None:
    window, ahead = np.array(lengths, dtype=np.int64), np.array(extra, dtype=np.int64)
    packs, used = pack_window(
        np.arange(window.size),
        window,
        capacity,
        overlong="split",
        lookahead_positions=np.arange(window.size, window.size + ahead.size),
        lookahead_lengths=ahead,
    )
    covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for pack in packs:
        assert pack.length <= capacity
        assert np.array_equal(np.diff(pack.cu_seqlens), [s.length for s in pack.segments])
        assert pack.position_ids.size == pack.cu_seqlens[-1] == pack.length
        for segment in pack.segments:
            covered[segment.position].append((segment.start, segment.stop))
    everything = np.concatenate([window, ahead[:used]])
    assert sorted(covered) == list(range(everything.size))  # every sample, and a prefix of the lookahead
    for position, pieces in covered.items():
        tokens = sorted(t for start, stop in pieces for t in range(start, stop))
        assert tokens == list(range(everything[position]))  # each token exactly once
    stopped = used < ahead.size
    assert not stopped or not packs or ahead[used] > capacity - min(pack.length for pack in packs)  # it fit nowhere


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=2, max_size=30), st.integers(1, 30))
def test_no_two_packs_could_be_merged(lengths: list[int], capacity: int) -> None:
    packs, _ = pack_window(np.arange(len(lengths)), np.array(lengths), capacity, overlong="split")
    sizes = sorted(pack.length for pack in packs)
    assert len(sizes) < 2 or sizes[0] + sizes[1] > capacity
