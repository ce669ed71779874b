"""Dealing order: cost tiers make any run of consecutive micro-batches cost about the same."""

from __future__ import annotations

import numpy as np
import pytest

from omnifeed.bucketing import cost_tiers, even_order


def _costs(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.uniform(0.8, 1.0, n) * 1000, [2500.0, 2600.0, 120.0, 0.0]])


@pytest.mark.parametrize("descending", [True, False])
def test_even_order_is_a_permutation_grouped_by_tier(descending: bool) -> None:
    costs = _costs(200)
    order = even_order(costs, 1000, 0.02, np.random.default_rng(1).permutation(len(costs)), descending=descending)
    assert sorted(order.tolist()) == list(range(len(costs)))
    tiers = cost_tiers(costs[order], 1000, 0.02)
    assert np.all(np.diff(tiers) <= 0) if descending else np.all(np.diff(tiers) >= 0)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 16])
def test_any_window_of_consecutive_micro_batches_is_even_within_two_tiers(world_size: int) -> None:
    costs = _costs(500)[:500]  # the full micro-batches only: 0.8-1.0 of the budget
    ordered = costs[even_order(costs, 1000, 0.02, np.arange(500), descending=True)]
    ratios = [ordered[i : i + world_size].max() / ordered[i : i + world_size].mean() for i in range(500 - world_size)]
    assert max(ratios) <= 1.02**2


def test_within_a_tier_the_given_shuffle_decides_and_the_result_is_pure() -> None:
    costs = np.full(50, 1000.0)
    shuffle = np.random.default_rng(3).permutation(50)
    assert even_order(costs, 1000, 0.02, shuffle, descending=True).tolist() == np.argsort(shuffle).tolist()
    assert np.array_equal(
        even_order(costs, 1000, 0.02, shuffle, descending=True), even_order(costs, 1000, 0.02, shuffle, descending=True)
    )


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="ranks for"):
        even_order(np.ones(3), 1.0, 0.02, np.arange(2), descending=True)
    with pytest.raises(ValueError, match="positive"):
        cost_tiers(np.ones(3), 0.0, 0.02)
