"""Run metrics: padding per stream, pack fill, DP balance, and the costliest micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.bucketing import Pack, Segment, balance, costliest, pack_padding_fraction, padding_fraction


def _brute_force_padding(batches: list[list[int]], lengths: dict[str, list[int]]) -> dict[str, float]:
    """Build each padded tensor slot by slot and count the padding."""
    out: dict[str, float] = {}
    for stream, values in lengths.items():
        real = padded = 0
        for batch in batches:
            width = max((values[i] for i in batch), default=0)
            for i in batch:  # one row per member, absent or not
                real += values[i]
                padded += width
        if real:
            out[stream] = 1 - real / padded
    return out


def test_padding_counts_rows_of_absent_samples() -> None:
    lengths = {"text": np.array([4, 2, 0, 3]), "image": np.array([0, 0, 0, 9])}
    fractions = padding_fraction([np.array([0, 1, 2]), np.array([3])], lengths)
    # text: rows 4+2+0 of 3x4, then 3 of 1x3 -> 9 / 15; image: first batch has no tensor, then 9 of 9
    assert fractions == pytest.approx({"text": 1 - 9 / 15, "image": 0.0})


def test_streams_never_present_are_omitted() -> None:
    lengths = {"text": np.array([1, 1]), "audio": np.array([0, 0]), "video": np.array([0, 7])}
    assert set(padding_fraction([np.array([0, 1])], lengths)) == {"text", "video"}
    assert set(padding_fraction([np.array([0])], lengths)) == {"text"}  # present only outside the batches
    assert padding_fraction([], lengths) == {}
    assert padding_fraction([np.zeros(0, dtype=np.int64)], lengths) == {}


def test_equal_lengths_have_no_padding() -> None:
    lengths = {"text": np.full(6, 5)}
    assert padding_fraction([np.arange(3), np.arange(3, 6)], lengths) == {"text": 0.0}


@settings(max_examples=100, deadline=None)
@given(st.data(), st.integers(1, 20))
def test_padding_fraction_matches_brute_force(data: st.DataObject, num_samples: int) -> None:
    ids = st.lists(st.integers(0, num_samples - 1), max_size=8)
    batches = data.draw(st.lists(ids, max_size=6))
    lengths = {
        stream: data.draw(st.lists(st.integers(0, 50), min_size=num_samples, max_size=num_samples))
        for stream in ("text", "image", "audio")
    }
    got = padding_fraction([np.array(b, dtype=np.int64) for b in batches], {k: np.array(v) for k, v in lengths.items()})
    expected = _brute_force_padding(batches, lengths)
    assert got == pytest.approx(expected)
    assert all(0.0 <= value < 1.0 for value in got.values())


@pytest.mark.parametrize(
    ("lengths", "capacity", "expected"),
    [([10, 10], 10, 0.0), ([5, 10], 10, 0.25), ([0], 8, 1.0), ([], 8, 0.0), ([3, 1, 0], 4, 1 - 4 / 12)],
)
def test_pack_padding_is_the_empty_share_of_slots(lengths: list[int], capacity: int, expected: float) -> None:
    packs = [Pack((Segment(i, 0, length),)) for i, length in enumerate(lengths)]
    assert pack_padding_fraction(packs, capacity) == pytest.approx(expected)


def test_pack_padding_rejects_nonpositive_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        pack_padding_fraction([], 0)


@pytest.mark.parametrize(
    ("steps", "worst", "mean"),
    [
        ([], 1.0, 1.0),
        ([[]], 1.0, 1.0),
        ([[0.0, 0.0]], 1.0, 1.0),  # all-zero steps are balanced
        ([[5.0, 5.0, 5.0]], 1.0, 1.0),
        ([[1.0, 3.0]], 1.5, 1.5),
        ([[1.0, 3.0], [2.0, 2.0], [0.0, 0.0]], 1.5, (1.5 + 1.0 + 1.0) / 3),
        ([[0.0, 0.0, 0.0, 4.0]], 4.0, 4.0),  # one rank does all the work
    ],
)
def test_balance_is_max_over_mean_per_step(steps: list[list[float]], worst: float, mean: float) -> None:
    assert balance(steps) == pytest.approx({"worst": worst, "mean": mean})


@pytest.mark.parametrize(
    ("costs", "n", "expected"),
    [
        ([3.0, 9.0, 1.0, 9.0, 5.0], 3, [1, 3, 4]),  # ties by index
        ([3.0, 9.0, 1.0], 0, []),
        ([3.0, 9.0, 1.0], 10, [1, 0, 2]),
        ([], 2, []),
        ([2.0, 2.0, 2.0], 2, [0, 1]),
    ],
)
def test_costliest_lists_largest_costs_first(costs: list[float], n: int, expected: list[int]) -> None:
    assert costliest(costs, n) == expected


def test_costliest_rejects_negative_count() -> None:
    with pytest.raises(ValueError, match="n must be"):
        costliest([1.0], -1)
