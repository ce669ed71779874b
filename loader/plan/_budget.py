"""Guidance for the cost budget: is it too small for the data, and which budget gives N samples per micro-batch.

Behind `omnifeed plan --stats` (``budget_guidance``) and `omnifeed plan --suggest-budget N`
(``suggest_budget``). A sample *alone* costs its own stream lengths under the cost model (no
padding); a budget below that is over budget for it (``overlong``: refused, or a micro-batch
of its own that unbalances the step it is dealt in).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from omnifeed.bucketing import BucketingConfig, sample_costs

from ._config import PlanConfig
from ._plan import Plan

_CHUNK = 1 << 20  # positions costed at a time
_SEARCH_STEPS = 24  # bisection steps on log(budget): well under 1 % apart
_SEARCH_SAMPLES = 65536  # samples of the stream a candidate budget is tried on


def alone_costs(plan: Plan) -> np.ndarray:
    """Every sample's cost alone (float64, by position) under the plan's cost model."""
    if plan.bucketing is None:
        raise ValueError("alone costs need a cost model: the plan has no bucketing")
    cost = plan.bucketing.cost
    parts = []
    for start in range(0, plan.num_samples, _CHUNK):
        positions = np.arange(start, min(start + _CHUNK, plan.num_samples), dtype=np.int64)
        parts.append(sample_costs(plan.stream_lengths(positions), cost))  # a stream of weight 0 adds 0
    return np.concatenate(parts)


def budget_guidance(plan: Plan) -> dict[str, Any]:
    """``samples_over_budget`` (count and fraction) at the plan's budget, and the budgets holding 99 % / 100 % of
    samples alone."""
    values = alone_costs(plan)
    budget = plan.budget
    assert budget is not None
    over = int(np.count_nonzero(values > budget))
    return {
        "budget": budget,
        "samples_over_budget": over,
        "over_budget_fraction": round(over / max(values.size, 1), 6),
        "budget_holding_99": float(np.ceil(np.quantile(values, 0.99))) if values.size else 0.0,
        "budget_holding_100": float(np.ceil(values.max())) if values.size else 0.0,
    }


def _with_budget(config: PlanConfig, budget: float) -> PlanConfig:
    """``config`` at ``budget`` (budget mode, over-budget samples alone, default feedback bounds, searched windows)."""
    base = config.bucketing.model_dump() if config.bucketing is not None else {}
    bucketing = base | {"mode": "budget", "budget": budget, "overlong": "alone", "min_budget": None, "max_budget": None}
    # windows of the searched size: the default window grows with the data's spread (up to 524,288 samples),
    # and only samples per micro-batch are measured here
    window = config.window_size or _SEARCH_SAMPLES
    return config.model_copy(update={"bucketing": BucketingConfig(**bucketing), "window_size": window})


def samples_per_micro_batch(plan: Plan, samples: int = _SEARCH_SAMPLES) -> float:
    """Mean samples per micro-batch over the first ``samples`` of epoch 0's stream, planned at the plan's budget."""
    start, taken, batches = 0, 0, 0
    window, carried = 0, np.empty(0, dtype=np.int64)
    while taken < min(samples, plan.num_samples):
        planned = plan.window(0, window, start, carried=carried)
        taken += sum(int(mb.positions.size) for mb in planned.micro_batches)
        batches += len(planned.micro_batches)
        if planned.last:
            break
        start, window, carried = planned.next_start, window + 1, planned.carry
    return taken / max(batches, 1)


def suggest_budget(plan: Plan, target: float) -> dict[str, Any]:
    """The budget whose micro-batches hold ``target`` samples on average (bisection on a plan of a window's worth).

    Raises ValueError for a target below 1.
    """
    if target < 1:
        raise ValueError(f"--suggest-budget {target}: give the samples per micro-batch wanted, 1 or more")
    values = alone_costs(plan)
    mean = float(values.mean()) if values.size else 1.0
    low, high = max(mean * target / 4, 1.0), max(mean * target * 4, float(values.max(initial=1.0)))

    def planned(budget: float) -> float:
        return samples_per_micro_batch(plan.with_config(_with_budget(plan.config, budget)))

    for _ in range(_SEARCH_STEPS):
        if high / low < 1.005:
            break
        middle = math.sqrt(low * high)
        low, high = (middle, high) if planned(middle) < target else (low, middle)
    budget = float(math.ceil(high))
    per_batch = planned(budget)
    over = int(np.count_nonzero(values > budget))
    return {
        "suggested_budget": budget,
        "target_samples_per_micro_batch": target,
        "samples_per_micro_batch": round(per_batch, 3),
        "samples_over_budget": over,
        "budget_holding_100": float(np.ceil(values.max())) if values.size else 0.0,
    }
