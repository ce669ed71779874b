"""Bucket edges from data, the bucket grid, and which streams to bucket by."""

from __future__ import annotations

import itertools
from typing import Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from omnifeed.bucketing import assign_buckets, choose_bucket_streams, estimate_boundaries, num_cells

distinct_lengths = st.lists(st.integers(1, 1000), min_size=1, max_size=80, unique=True)
any_lengths = st.lists(st.integers(0, 60), max_size=80)
Method = Literal["equal_cost", "quantile"]


def _bucket_totals(values: np.ndarray, costs: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Total cost per bucket (len(edges) + 1 of them) of positive ``values``."""
    ids = np.searchsorted(edges, values, side="left")
    return np.bincount(ids, weights=costs, minlength=edges.size + 1)


@pytest.mark.parametrize("num_buckets", [0, -1, -10])
@pytest.mark.parametrize("method", ["equal_cost", "quantile"])
def test_fewer_than_one_bucket_is_rejected(num_buckets: int, method: Method) -> None:
    with pytest.raises(ValueError, match="num_buckets"):
        estimate_boundaries(np.arange(1, 10), num_buckets, method)


@pytest.mark.parametrize("method", ["equal_cost", "quantile"])
@pytest.mark.parametrize(
    ("lengths", "num_buckets", "expected"),
    [
        ([], 4, []),  # nothing at all
        ([0, 0, 0], 4, []),  # nothing present
        ([7], 4, []),  # one sample
        ([5, 5, 5, 5, 5, 5], 3, []),  # all equal
        ([0, 5, 0, 5, 5], 3, []),  # all present ones equal
        ([1, 2, 3], 1, []),  # one bucket needs no edge
        ([1, 2], 4, [1]),  # fewer samples than buckets: one per bucket
        ([3, 1, 2], 8, [1, 2]),
        ([0, 0, 2, 1, 0], 8, [1]),  # zeros are not samples of the stream
    ],
)
def test_degenerate_inputs_give_fewer_edges(
    method: Method, lengths: list[int], num_buckets: int, expected: list[int]
) -> None:
    edges = estimate_boundaries(np.array(lengths, dtype=np.int64), num_buckets, method)
    assert edges.dtype == np.float64
    assert edges.tolist() == expected


def test_quantile_and_equal_cost_split_a_ramp_differently() -> None:
    lengths = np.arange(1, 11)
    assert estimate_boundaries(lengths, 3, "quantile").tolist() == [3, 7]  # 3, 4, 3 samples
    assert estimate_boundaries(lengths, 3, "equal_cost").tolist() == [6, 8]  # costs 21, 15, 19


def test_given_costs_replace_lengths_as_the_cost() -> None:
    lengths = np.array([1, 2, 3, 4, 0])
    costs = np.array([1.0, 1.0, 1.0, 9.0, 100.0])  # the absent sample's cost is ignored
    assert estimate_boundaries(lengths, 2, costs=costs).tolist() == [3]
    assert estimate_boundaries(lengths, 2, "quantile", costs=costs).tolist() == [2]  # quantile ignores costs


@pytest.mark.parametrize("costs", [np.ones(3), np.array([1.0, -1.0, 1.0, 1.0])])
def test_malformed_costs_are_rejected(costs: np.ndarray) -> None:
    with pytest.raises(ValueError, match="costs"):
        estimate_boundaries(np.array([1, 2, 3, 4]), 2, costs=costs)


@settings(max_examples=150, deadline=None)
@given(any_lengths, st.integers(1, 12), st.sampled_from(["equal_cost", "quantile"]))
def test_edges_are_sorted_unique_present_lengths_below_the_max(
    lengths: list[int], num_buckets: int, method: Method
) -> None:
    values = np.array(lengths, dtype=np.int64)
    edges = estimate_boundaries(values, num_buckets, method)
    present = values[values > 0]
    assert edges.size <= num_buckets - 1
    assert np.all(np.diff(edges) > 0)
    assert set(edges.tolist()) <= set(present.tolist())
    assert all(edge < present.max() for edge in edges)  # no empty last bucket
    with_absent = np.concatenate([values, [0, 0]])
    assert np.array_equal(edges, estimate_boundaries(with_absent, num_buckets, method))


@settings(max_examples=150, deadline=None)
@given(distinct_lengths, st.integers(1, 12))
def test_quantile_buckets_on_distinct_lengths_differ_by_at_most_one_sample(
    lengths: list[int], num_buckets: int
) -> None:
    values = np.array(lengths, dtype=np.int64)
    edges = estimate_boundaries(values, num_buckets, "quantile")
    counts = _bucket_totals(values, np.ones(values.size), edges)
    assert edges.size == min(num_buckets, values.size) - 1
    assert counts.sum() == values.size
    low, high = values.size // num_buckets, -(-values.size // num_buckets)
    assert set(counts.tolist()) <= ({low, high} if values.size >= num_buckets else {1})


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 8), st.integers(0, 100), st.integers(0, 2**32 - 1))
def test_equal_cost_buckets_are_within_one_sample_cost_of_their_share(num_buckets: int, extra: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.choice(np.arange(1, 10_001), size=12 * num_buckets + extra, replace=False)
    costs = rng.integers(1, 11, size=values.size).astype(float)
    share = costs.sum() / num_buckets  # >= 12 > any one cost: no bucket can be skipped
    edges = estimate_boundaries(values, num_buckets, costs=costs)
    totals = _bucket_totals(values, costs, edges)
    assert edges.size == num_buckets - 1
    assert np.all(np.abs(totals - share) <= costs.max())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.lists(st.integers(1, 1000), min_size=12, max_size=80, unique=True), st.integers(2, 6))
def test_equal_cost_by_length_is_within_one_length_of_the_share(lengths: list[int], num_buckets: int) -> None:
    values = np.array(lengths, dtype=np.int64)
    assume(values.max() < values.sum() / num_buckets)
    totals = _bucket_totals(values, values.astype(float), estimate_boundaries(values, num_buckets))
    assert totals.size == num_buckets
    assert np.all(np.abs(totals - values.sum() / num_buckets) <= values.max())


@pytest.mark.parametrize(
    ("length", "bucket"), [(0, 0), (-3, 0), (1, 1), (10, 1), (11, 2), (20, 2), (21, 3), (10_000, 3)]
)
def test_one_stream_cells_are_absent_then_inclusive_upper_edges(length: int, bucket: int) -> None:
    ids = assign_buckets({"text": np.array([length])}, {"text": np.array([10.0, 20.0])})
    assert ids.dtype == np.int64
    assert ids.tolist() == [bucket]


def test_grid_ids_are_row_major_over_the_edges_order() -> None:
    lengths = {"image": np.array([0, 5, 50, 5]), "text": np.array([3, 0, 30, 30]), "audio": np.array([9, 9, 9, 9])}
    edges = {"text": np.array([10.0]), "image": np.array([1.0, 10.0])}  # cells: text 3, image 4
    assert num_cells(edges) == 12
    # (text cell, image cell): (1, 0), (0, 2), (2, 3), (2, 2)
    assert assign_buckets(lengths, edges).tolist() == [1 * 4 + 0, 0 * 4 + 2, 2 * 4 + 3, 2 * 4 + 2]


def test_grid_ids_number_every_cell_exactly_once() -> None:
    edges = {"a": np.array([2.0, 4.0]), "b": np.array([], dtype=float), "c": np.array([1.0])}
    reps = {"a": [0, 1, 3, 5], "b": [0, 7], "c": [0, 1, 2]}  # one length per cell
    combos = list(itertools.product(*reps.values()))
    lengths = {name: np.array([combo[i] for combo in combos]) for i, name in enumerate(reps)}
    ids = assign_buckets(lengths, edges)
    assert sorted(ids.tolist()) == list(range(num_cells(edges)))


def test_grid_works_on_two_dimensional_length_arrays() -> None:
    lengths = {"text": np.array([[0, 5], [15, 25]])}
    assert assign_buckets(lengths, {"text": np.array([10.0, 20.0])}).tolist() == [[0, 1], [2, 3]]


def test_no_bucketed_stream_puts_everything_in_bucket_zero() -> None:
    assert num_cells({}) == 1
    assert assign_buckets({"text": np.array([1, 2, 3])}, {}).tolist() == [0, 0, 0]
    assert assign_buckets({}, {}).shape == (0,)


@pytest.mark.parametrize(
    ("lengths", "edges"),
    [
        ({"text": np.array([1, 2])}, {"image": np.array([1.0])}),  # no lengths for a bucketed stream
        ({"text": np.array([1, 2]), "image": np.array([1])}, {"text": np.array([1.0]), "image": np.array([1.0])}),
    ],
)
def test_malformed_grid_inputs_are_rejected(lengths: dict[str, np.ndarray], edges: dict[str, np.ndarray]) -> None:
    with pytest.raises(ValueError):
        assign_buckets(lengths, edges)


@pytest.mark.parametrize(
    ("max_streams", "expected"),
    [(0, []), (1, ["video"]), (2, ["video", "text"]), (3, ["video", "text", "image"]), (9, ["video", "text", "image"])],
)
def test_bucket_streams_are_the_heaviest_by_weighted_total(max_streams: int, expected: list[str]) -> None:
    lengths = {
        "text": np.array([100, 200]),  # 300
        "image": np.array([256, 0]),  # 256 * 0.5 = 128
        "video": np.array([0, 4096]),  # 4096 * 0.25 = 1024
        "audio": np.array([0, 0]),  # 0: never chosen
    }
    weights = {"text": 1.0, "image": 0.5, "video": 0.25, "audio": 1.0}
    assert choose_bucket_streams(lengths, weights, max_streams) == expected


def test_unweighted_streams_are_never_chosen_and_ties_keep_order() -> None:
    lengths = {"b": np.array([5]), "a": np.array([5]), "c": np.array([1000])}
    assert choose_bucket_streams(lengths, {"a": 1.0, "b": 1.0}) == ["b", "a"]
    with pytest.raises(ValueError, match="max_streams"):
        choose_bucket_streams(lengths, {}, -1)
