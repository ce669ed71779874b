"""Window assembly: budgets hold, every sample lands once, borrowing takes a prefix of the lookahead."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.bucketing import (
    CostModel,
    OverBudgetError,
    assemble_budget,
    assemble_fixed,
    assign_buckets,
    light_to_carry,
    padded_cost,
)

MODEL = CostModel(quadratic=0.001)


def _lengths(text: list[int], image: list[int]) -> dict[str, np.ndarray]:
    return {"text": np.asarray(text, dtype=np.int64), "image": np.asarray(image, dtype=np.int64)}


samples = st.lists(st.tuples(st.integers(0, 400), st.integers(0, 300)), min_size=0, max_size=120)


@settings(max_examples=200, deadline=None)
@given(own=samples, look=samples, budget=st.floats(800, 20000), max_size=st.one_of(st.none(), st.integers(1, 40)))
def test_budgets_hold_and_every_sample_lands_once(own, look, budget, max_size) -> None:
    own = [(t, i) for t, i in own if t + i > 0] or [(1, 0)]
    lengths = _lengths([t for t, _ in own], [i for _, i in own])
    look_lengths = _lengths([t for t, _ in look], [i for _, i in look])
    positions, look_positions = np.arange(len(own)) * 10, 10_000 + np.arange(len(look))
    edges = {"text": np.array([20.0, 100.0]), "image": np.array([50.0])}
    result = assemble_budget(
        positions,
        lengths,
        assign_buckets(lengths, edges),
        budget,
        MODEL,
        max_batch_size=max_size,
        overlong="alone",
        lookahead_positions=look_positions,
        lookahead_lengths=look_lengths,
    )
    delivered = np.concatenate(result.batches)
    assert sorted(delivered.tolist()) == sorted(positions.tolist() + look_positions[: result.consumed].tolist())
    by_position = {p: (t, i) for p, (t, i) in zip(positions.tolist() + look_positions.tolist(), own + look)}
    for batch, cost in zip(result.batches, result.costs):
        rows = [by_position[p] for p in batch.tolist()]
        expected = padded_cost(_lengths([t for t, _ in rows], [i for _, i in rows]), MODEL)
        assert cost == pytest.approx(expected)
        assert cost <= budget * (1 + 1e-9) or len(batch) == 1, "only a sample over budget alone may exceed it"
        assert max_size is None or len(batch) <= max_size


def test_an_over_budget_sample_is_rejected_naming_its_position() -> None:
    lengths = _lengths([10, 5000, 10], [0, 0, 0])
    with pytest.raises(OverBudgetError) as err:
        assemble_budget(np.array([7, 8, 9]), lengths, np.zeros(3, dtype=np.int64), 1000, MODEL)
    assert err.value.position == 8 and "8" in str(err.value)


def test_similar_lengths_share_micro_batches() -> None:
    rng = np.random.default_rng(0)
    text = np.concatenate([rng.integers(10, 20, 200), rng.integers(900, 1000, 20)])
    lengths = {"text": rng.permutation(text)}
    edges = {"text": np.array([100.0])}
    result = assemble_budget(np.arange(len(text)), lengths, assign_buckets(lengths, edges), 4000, CostModel())
    for batch in result.batches:
        values = lengths["text"][batch]
        assert values.max() < 100 or values.min() >= 900, "short and long samples are not padded together"


def test_fixed_chunks_top_up_only_the_last_from_the_lookahead() -> None:
    result = assemble_fixed(np.arange(10), 4, lookahead_positions=np.arange(100, 110))
    assert [b.tolist() for b in result.batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 100, 101]]
    assert result.consumed == 2
    assert assemble_fixed(np.arange(8), 4, np.arange(100, 110)).consumed == 0


def test_only_light_leftovers_with_room_are_carried_lightest_first_within_the_limit() -> None:
    costs, sizes = [90.0, 10.0, 60.0, 30.0, 40.0], [9, 1, 1, 3, 4]
    # 90 is not light; 60 alone has no room for another like it (120 > 100); then 10, 30, 40 within 8 samples
    assert light_to_carry(costs, sizes, 100.0, limit=8) == [1, 3, 4]
    assert light_to_carry(costs, sizes, 100.0, limit=4) == [1, 3]
    assert light_to_carry(costs, sizes, 100.0, limit=0) == []


def test_a_light_micro_batch_is_absorbed_by_one_of_its_own_mix_with_room() -> None:
    from omnifeed.bucketing._leftovers import _absorb_light, _Weights

    weights = _Weights([1.0, 1.0], 0.0)
    rows = [[20.0, 0.0]] * 4 + [[10.0, 0.0], [0.0, 10.0], [20.0, 10.0]]  # text x 5, an image, a captioned image
    present = np.array([1, 1, 1, 1, 1, 2, 3])
    done = [([0, 1, 2, 3], 80.0), ([4], 10.0), ([5], 10.0), ([6], 30.0)]
    absorbed = _absorb_light(done, rows, present, weights, 100.0, None)
    assert absorbed == [([0, 1, 2, 3, 4], 100.0), ([5], 10.0), ([6], 30.0)], "text joins text; other mixes stay"
    assert _absorb_light(done, rows, present, weights, 100.0, 4) == done, "max size leaves no room"


def test_a_sample_is_absorbed_where_it_adds_the_least_padding_in_its_own_bucket_first() -> None:
    from omnifeed.bucketing._leftovers import _absorb_light, _Weights

    weights = _Weights([1.0], 0.0)
    rows = [[10.0]] * 15 + [[40.0]] * 4 + [[10.0]]  # short ones, long ones, and a light leftover of one short sample
    done = [(list(range(15)), 150.0), ([15, 16, 17, 18], 160.0), ([19], 10.0)]
    present = np.ones(20, dtype=np.int64)
    absorbed = _absorb_light(done, rows, present, weights, 200.0, None)
    assert ([*range(15), 19], 160.0) in absorbed, "among the short ones, not padded to 40 among the long ones"
    cells = np.array([0] * 15 + [1] * 5)  # its own bucket is the long ones'
    assert ([15, 16, 17, 18, 19], 200.0) in _absorb_light(done, rows, present, weights, 200.0, None, cells)


def test_a_light_leftover_is_evened_out_with_its_own_mix_and_none_is_light_after() -> None:
    from omnifeed.bucketing._leftovers import _even_light, _Weights

    weights = _Weights([1.0], 0.0)
    rows = [[10.0]] * 23  # 23 samples of 10: two full micro-batches of 10 and a leftover of 3
    done = [(list(range(0, 10)), 100.0), (list(range(10, 20)), 100.0), ([20, 21, 22], 30.0)]
    evened = _even_light(done, rows, np.ones(23, dtype=np.int64), weights, 100.0, None)
    assert sorted(s for members, _ in evened for s in members) == list(range(23))
    assert sorted(cost for _, cost in evened) == [70.0, 80.0, 80.0], "three of about equal cost, none light"


def test_bridges_step_across_a_jump_in_costs_with_pieces_of_a_fluid_bucket() -> None:
    from omnifeed.bucketing._bridge import bridge_gaps
    from omnifeed.bucketing._leftovers import _Weights

    weights = _Weights([1.0], 0.0)
    rows = [[1.0]] * 40000 + [[50.0]] * 20  # fluid: 400 micro-batches of 100 ones; coarse: 20 singles costing 50
    done = [(list(range(i * 100, (i + 1) * 100)), 100.0) for i in range(400)] + [([40000 + i], 50.0) for i in range(20)]
    cells = np.array([0] * 40000 + [1] * 20)
    bridged = bridge_gaps(done, rows, cells, weights, 100.0, None)
    assert sorted(s for members, _ in bridged for s in members) == list(range(40020))
    costs = np.sort([cost for _, cost in bridged])
    assert costs[0] == 50.0 and costs[-1] <= 100.0
    assert np.all(costs[1:] / costs[:-1] <= 1.05), "no jump wider than a bridge step"


def _even_cut_afresh(samples, table, weights, parts, budget, max_size):  # type: ignore[no-untyped-def]
    """`_even_cut` as first written, every cost computed afresh: the reference the memoised one must equal."""

    def _padded(sizes, longest, weights):  # type: ignore[no-untyped-def]
        sizes = np.asarray(sizes, dtype=np.float64)
        total = np.zeros(np.broadcast_shapes(sizes.shape, longest.shape[:-1]), dtype=np.float64)
        for s, w in enumerate(weights.weights):
            m = longest[..., s]
            total = total + (w * sizes) * (m + weights.quadratic * m * m)
        return total

    rows, n = table[samples], len(samples)

    def cost(a: int, b: int) -> float:
        return float(_padded(np.array([b - a]), rows[a:b].max(axis=0)[None, :], weights)[0])

    def greedy(cap: float) -> list[int] | None:
        bounds, a = [0], 0
        while a < n:
            stop = n if max_size is None else min(n, a + max_size)
            costs = _padded(np.arange(1, stop - a + 1), np.maximum.accumulate(rows[a:stop], axis=0), weights)
            over = np.flatnonzero(costs > cap)
            taken = int(over[0]) if over.size else stop - a
            if taken == 0:
                return None
            a += taken
            bounds.append(a)
        return bounds

    found = greedy(budget)
    if found is None or len(found) - 1 > parts:
        return None
    low, high = max(cost(i, i + 1) for i in range(n)), budget
    for _ in range(20):
        middle = (low + high) / 2
        trial = greedy(middle)
        if trial is not None and len(trial) - 1 <= parts:
            found, high = trial, middle
        else:
            low = middle
    bounds = found
    for _ in range(3):
        for k in range(1, len(bounds) - 1):
            lo, hi = bounds[k - 1] + 1, bounds[k + 1] - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if cost(bounds[k - 1], mid) <= cost(mid, bounds[k + 1]):
                    lo = mid
                else:
                    hi = mid - 1
            bounds[k] = max(
                (
                    b
                    for b in (lo, lo + 1)
                    if bounds[k - 1] < b < bounds[k + 1]
                    and cost(bounds[k - 1], b) <= budget
                    and cost(b, bounds[k + 1]) <= budget
                    and (max_size is None or (b - bounds[k - 1] <= max_size and bounds[k + 1] - b <= max_size))
                ),
                key=lambda b: min(cost(bounds[k - 1], b), cost(b, bounds[k + 1])),
                default=bounds[k],
            )
    return [([samples[i] for i in range(a, b)], cost(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.lists(st.integers(0, 3000), min_size=3, max_size=3), min_size=1, max_size=120),
    weights=st.lists(st.floats(0.01, 4.0), min_size=3, max_size=3),
    quadratic=st.sampled_from([0.0, 1e-4, 0.01]),
    parts=st.integers(1, 16),
    budget_factor=st.floats(0.2, 3.0),
    max_size=st.sampled_from([None, 1, 4, 16]),
)
def test_evening_out_cuts_exactly_where_computing_every_cost_afresh_cuts(
    lengths: list[list[int]],
    weights: list[float],
    quadratic: float,
    parts: int,
    budget_factor: float,
    max_size: int | None,
) -> None:
    """Every node must form the same micro-batches: the memoised cut equals its definition, bit for bit."""
    from omnifeed.bucketing._leftovers import _even_cut, _padded, _Weights

    model = _Weights(weights, quadratic)
    table = np.asarray(lengths, dtype=np.float64)
    own = _padded(np.ones(len(table)), table, model)
    samples = sorted(range(len(table)), key=lambda s: (own[s], s))
    budget = float(own.max()) * max(1.0, budget_factor * len(table) / parts)
    assert _even_cut(samples, table, model, parts, budget, max_size) == _even_cut_afresh(
        samples, table, model, parts, budget, max_size
    )
