"""The order a window's micro-batches are dealt in, so that any run of consecutive ones costs about the same.

A step at world size ``W`` deals the next ``W`` micro-batches of the plan's sequence to its
ranks, wherever the step happens to start: the sequence cannot know ``W`` (it is the same at
every world size), so it must make *every* run of consecutive micro-batches even. A shuffled
window does not: a micro-batch of two long clips (0.9 of the budget) lands beside one of
short captions (0.99), a lone leftover (0.3) beside full ones.

`even_order` sorts a window's micro-batches into *cost tiers*, each ``tolerance`` wide (a
ratio: with 0.02 every tier's costs lie within 2 % of each other), and shuffles within each
tier with the ranks it is given, so lengths and modality mixes still interleave. Any ``W``
consecutive micro-batches then lie in one tier or two adjacent ones. The tiers run costliest
first in one window and cheapest first in the next (``descending`` alternates), so the light
tail of one window meets the light head of the next instead of its heaviest micro-batches;
over-budget singles (``overlong: alone``) are the top tiers and meet each other.
"""

from __future__ import annotations

import numpy as np


def cost_tiers(costs: np.ndarray, budget: float, tolerance: float) -> np.ndarray:
    """Tier of each cost (int64): ``floor(log(cost / budget) / log(1 + tolerance))``; cost 0 is the lowest tier.

    Raises ValueError for a budget or tolerance that is not positive.
    """
    if budget <= 0 or tolerance <= 0:
        raise ValueError(f"budget and tolerance must be positive, got {budget} and {tolerance}")
    values = np.asarray(costs, dtype=np.float64)
    with np.errstate(divide="ignore"):
        ratio = np.log(np.maximum(values, 0.0) / budget) / np.log1p(tolerance)
    floor = np.floor(np.where(np.isfinite(ratio), ratio, 0.0)).astype(np.int64)
    lowest = int(floor.min()) - 1 if floor.size else 0
    return np.where(np.isfinite(ratio), floor, lowest)


def even_order(
    costs: np.ndarray, budget: float, tolerance: float, shuffle: np.ndarray, *, descending: bool
) -> np.ndarray:
    """Indices of ``costs`` grouped by cost tier (costliest tier first if ``descending``), by ``shuffle`` within a tier.

    ``shuffle`` is a random rank per micro-batch (a permutation of ``range(len(costs))``, say);
    the result is a permutation of ``range(len(costs))``, a pure function of the arguments.
    Raises ValueError when ``shuffle`` has another length.
    """
    values = np.asarray(costs, dtype=np.float64)
    ranks = np.asarray(shuffle)
    if ranks.shape != values.shape:
        raise ValueError(f"shuffle has {ranks.size} ranks for {values.size} costs")
    tiers = cost_tiers(values, budget, tolerance)
    return np.lexsort([ranks, -tiers if descending else tiers]).astype(np.int64)
