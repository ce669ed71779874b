"""What becomes of a window's light micro-batches (under 0.75 of the budget): the leftovers of its buckets.

A step deals ``W`` consecutive micro-batches; one light micro-batch beside full ones is what
unbalances it. In the order `assemble_budget` applies them:

- `_absorb_light`: a light micro-batch's samples spread over micro-batches of their own
  modality mix that have room, each where it adds the least padding;
- `light_to_carry`: the light ones with room go to the next window (bounded), where they meet a
  window's worth of their own mix;
- `_even_light`: a light one left is evened out with the micro-batches of its own mix nearest in
  length: their samples re-cut into as many micro-batches of about equal cost (no sample moves
  far in length, so padding does not grow; none is light).

Light micro-batches of different mixes are never merged: a merged one pads every stream of each
mix with rows of the other (a rare stream's padding is made of such rows). What stays light is
bridged instead (`_bridge`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

_LIGHT = 0.75  # a micro-batch under this fraction of the budget is light: a leftover that unbalances a step
_EVEN = 0.85  # evening out aims for micro-batches of at least this fraction of the budget
_EVEN_MAX = 16  # most micro-batches one light one is evened out with


@dataclass(frozen=True)
class _Weights:
    weights: list[float]
    quadratic: float
    vector: np.ndarray = field(init=False, repr=False, compare=False)  # ``weights`` as float64, for `_padded`

    def __post_init__(self) -> None:
        object.__setattr__(self, "vector", np.asarray(self.weights, dtype=np.float64))


def _padded(sizes: np.ndarray, longest: np.ndarray, weights: _Weights) -> np.ndarray:
    """Padded cost of micro-batches of ``sizes`` samples whose streams' longest are the rows of ``longest``.

    Summed stream by stream in the order and grouping of the filler's scalar cost, element-wise: no
    BLAS product, whose rounding may differ between CPUs, so every node plans the same micro-batches.
    (The first stream's term is what adding it to zeros gives: costs are never -0.)
    """
    sizes = np.asarray(sizes, dtype=np.float64)
    if not weights.weights:
        return np.zeros(np.broadcast_shapes(sizes.shape, longest.shape[:-1]), dtype=np.float64)
    # every stream's term at once (element-wise, as the scalar cost), then summed stream after stream; without a
    # quadratic term ``m + 0 * m * m`` is ``m`` exactly (lengths are finite and not negative)
    shape = longest if weights.quadratic == 0.0 else longest + weights.quadratic * longest * longest
    terms = (weights.vector * sizes[..., None]) * shape
    total = terms[..., 0]
    for s in range(1, len(weights.weights)):
        total = total + terms[..., s]
    return total


def _scalar_padded(size: int, longest: list[float], weights: _Weights) -> float:
    """`_padded` of one micro-batch, in Python floats: the same operations in the same order, so the same bits."""
    total, n = 0.0, float(size)
    for w, m in zip(weights.weights, longest):
        total = total + (w * n) * (m + weights.quadratic * m * m)
    return total


def _segments(batches: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The members of non-empty ``batches`` end to end, and where each batch starts."""
    sizes = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
    flat = np.fromiter(chain.from_iterable(batches), dtype=np.int64, count=int(sizes.sum()))
    return flat, np.r_[0, np.cumsum(sizes)[:-1]].astype(np.int64)


def _uniform(values: np.ndarray, starts: np.ndarray, mixed: int) -> np.ndarray:
    """Per segment, its value when all its members share one, else ``mixed``."""
    low, high = np.minimum.reduceat(values, starts), np.maximum.reduceat(values, starts)
    return np.where(low == high, low, mixed)


def _medians(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per segment, the median of its values (as `np.median`: the middle one, or the mean of the middle two)."""
    counts = np.diff(np.r_[starts, values.size])
    segment = np.repeat(np.arange(starts.size), counts)
    ordered = values[np.lexsort([values, segment])]
    low, high = starts + (counts - 1) // 2, starts + counts // 2
    return (ordered[low] + ordered[high]) / 2


def _absorb_light(
    done: list[tuple[list[int], float]],
    rows: np.ndarray | list[list[float]],
    present: np.ndarray,
    weights: _Weights,
    budget: float,
    max_size: int | None,
    cells: np.ndarray | None = None,
) -> list[tuple[list[int], float]]:
    """Spread each light micro-batch's samples over micro-batches of their own modality mix that have room.

    A sample goes to a micro-batch of its own bucket (``cells``, when given) before another of its
    mix, and there where it adds the least padding (cost with it, minus the cost without it and
    its own), the fullest such micro-batch on a tie; a light micro-batch is dissolved only when
    all its samples find room (otherwise it stays whole).
    """
    if len(done) < 2 or not len(rows):
        return done
    table = np.asarray(rows, dtype=np.float64)  # no copy: the window's table
    members = [list(batch) for batch, _ in done]
    flat, starts = _segments(members)
    sizes = np.diff(np.r_[starts, flat.size]).astype(np.float64)
    longest = np.maximum.reduceat(table[flat], starts, axis=0)
    kinds = _uniform(np.asarray(present)[flat], starts, -1)  # -1: a mixed micro-batch
    cell = np.zeros(len(rows), dtype=np.int64) if cells is None else np.asarray(cells)
    bucket = _uniform(cell[flat], starts, np.iinfo(np.int64).min)
    costs = np.array([cost for _, cost in done])
    own = _padded(np.ones(len(rows)), table, weights)  # each sample's cost alone
    groups = {int(kind): np.flatnonzero(kinds == kind) for kind in np.unique(kinds).tolist()}  # by modality mix
    alive = np.ones(len(done), dtype=bool)
    for k in np.argsort(costs, kind="stable").tolist():
        if costs[k] >= _LIGHT * budget:
            continue
        alive[k] = False
        moves, undo = [], []  # tried in place; undone unless every sample finds room
        for sample in members[k]:
            group = groups.get(int(present[sample]))
            if group is None:
                break
            # only micro-batches with room for one more like their longest can fit it (a superset of those that do)
            group = group[costs[group] * (sizes[group] + 1) <= sizes[group] * budget * (1 + 1e-9)]
            top = np.maximum(longest[group], table[sample])
            with_it = _padded(sizes[group] + 1, top, weights)
            fits = alive[group] & (with_it <= budget)
            if max_size is not None:
                fits &= sizes[group] < max_size
            if not fits.any():
                break
            added = with_it - costs[group] - own[sample]
            off_cell = bucket[group] != cell[sample]
            best = int(np.lexsort([-with_it, np.where(fits, added, np.inf), np.where(fits, off_cell, 2)])[0])
            j = int(group[best])
            undo.append((j, sizes[j], longest[j].copy(), costs[j]))
            sizes[j], longest[j], costs[j] = sizes[j] + 1, top[best], with_it[best]
            moves.append((sample, j))
        if len(moves) < len(members[k]):
            for j, size, top_before, cost in reversed(undo):
                sizes[j], longest[j], costs[j] = size, top_before, cost
            alive[k] = True
            continue
        for sample, j in moves:
            members[j].append(sample)
    return [(members[i], float(costs[i])) for i in np.flatnonzero(alive).tolist()]


def _even_light(
    done: list[tuple[list[int], float]],
    rows: np.ndarray | list[list[float]],
    present: np.ndarray,
    weights: _Weights,
    budget: float,
    max_size: int | None,
    cells: np.ndarray | None = None,
) -> list[tuple[list[int], float]]:
    """Even each light micro-batch out with the micro-batches of its own mix nearest in length (module docstring).

    For a light one of cost ``f`` budgets, the ``m - 1`` others of its mix — of its own bucket
    (``cells``) first — whose median sample cost is nearest to its own join it, ``m`` the fewest
    for which ``(m - 1 + f) / m`` reaches 0.85; their samples, sorted by bucket and cost, are cut
    into ``m`` micro-batches of about equal cost (`_even_cut`). Kept only when every new
    micro-batch is within the budget and the lightest is heavier than the light one was.
    """
    if len(done) < 2 or not len(rows):
        return done
    table = np.asarray(rows, dtype=np.float64)  # no copy: the window's table
    own = _padded(np.ones(len(rows)), table, weights)  # each sample's cost alone
    batches = [list(members) for members, _ in done]
    costs = [cost for _, cost in done]
    cell = np.zeros(len(rows), dtype=np.int64) if cells is None else np.asarray(cells)
    mixed_cells = np.iinfo(np.int64).min
    # per micro-batch, kept up to date as groups are re-cut: its median sample cost, and its cell (if it has one)
    flat, starts = _segments(batches)
    kind = _uniform(np.asarray(present)[flat], starts, -1)  # its modality mix, -1 for a mixed one
    median = _medians(own[flat], starts)
    home_cell = _uniform(cell[flat], starts, mixed_cells)
    by_kind = {int(c): np.flatnonzero(kind == c) for c in np.unique(kind).tolist()}
    for k in sorted(range(len(batches)), key=lambda i: costs[i]):
        f = costs[k] / budget
        if not batches[k] or f >= _LIGHT or kind[k] < 0 or costs[k] * (len(batches[k]) + 1) / len(batches[k]) > budget:
            continue  # emptied, not light, mixed, or no room for another sample like its longest
        m = min(_EVEN_MAX, int(np.ceil((1.0 - f) / (1.0 - _EVEN))) + 1)
        centre, home = float(np.median(own[batches[k]])), int(np.median(cell[batches[k]]))
        peers = np.array([i for i in by_kind[int(kind[k])].tolist() if i != k and batches[i]], dtype=np.int64)
        if peers.size:
            distance = np.abs(np.log(np.maximum(median[peers], 1e-9) / max(centre, 1e-9)))
            peers = peers[np.lexsort([distance, home_cell[peers] != home])]  # own cell first, then nearest
        group = [k, *peers[: m - 1].tolist()]
        if len(group) < 2:
            continue
        samples = sorted((s for i in group for s in batches[i]), key=lambda s: (own[s], s))
        cut = _even_cut(samples, table, weights, len(group), budget, max_size)
        if cut is None or min(c for _, c in cut) <= costs[k]:
            continue
        for place, i in enumerate(group):  # a cut into fewer parts than the group empties the rest
            batches[i], costs[i] = cut[place] if place < len(cut) else ([], 0.0)
            if batches[i]:
                median[i] = float(np.median(own[batches[i]]))
                home_cell[i] = (
                    int(cell[batches[i][0]]) if np.all(cell[batches[i]] == cell[batches[i][0]]) else mixed_cells
                )
    return [(m, c) for m, c in zip(batches, costs) if m]


def _even_cut(
    samples: list[int], table: np.ndarray, weights: _Weights, parts: int, budget: float, max_size: int | None
) -> list[tuple[list[int], float]] | None:
    """``samples`` (sorted by cost) cut in order into at most ``parts`` micro-batches of about equal cost, or None.

    The smallest cap whose greedy cut needs no more than ``parts`` (bisection), then each boundary
    moved to where its two neighbours cost most alike; None when the budget cannot hold them in
    ``parts``.
    """
    rows, n = table[samples], len(samples)
    if parts < 1 or n == 0:
        return None
    # The bisection asks for the same start's prefix costs many times: each start's are computed once; a
    # boundary move takes its neighbours' prefix and suffix costs as two arrays. `_padded` does the operations of
    # `_scalar_padded` in the same order, so the cut is the same, bit for bit, as computing every cost afresh.
    prefixes: dict[int, np.ndarray] = {}

    def cost(a: int, b: int) -> float:
        return _scalar_padded(b - a, rows[a:b].max(axis=0).tolist(), weights)

    def prefix(a: int) -> np.ndarray:
        costs = prefixes.get(a)
        if costs is None:
            stop = n if max_size is None else min(n, a + max_size)
            costs = prefixes[a] = _padded(
                np.arange(1, stop - a + 1), np.maximum.accumulate(rows[a:stop], axis=0), weights
            )
        return costs

    def greedy(cap: float) -> list[int] | None:
        bounds, a = [0], 0
        while a < n:
            costs = prefix(a)
            taken = int(costs.searchsorted(cap, side="right"))  # the first over ``cap``: costs grow with each sample
            if taken == 0:
                return None
            a += taken
            bounds.append(a)
        return bounds

    found = greedy(budget)
    if found is None or len(found) - 1 > parts:
        return None
    low, high = float(_padded(np.ones(n), rows, weights).max()), budget  # the costliest sample alone
    for _ in range(20):  # the smallest cap that still cuts into `parts`
        middle = (low + high) / 2
        trial = greedy(middle)
        if trial is not None and len(trial) - 1 <= parts:
            found, high = trial, middle
        else:
            low = middle
    bounds = found
    for _ in range(3):  # move each boundary to where its neighbours cost most alike, both within the budget
        for k in range(1, len(bounds) - 1):
            first, last = bounds[k - 1], bounds[k + 1]
            span = rows[first:last]
            # left[x - first - 1]: cost(first, x); right[x - first]: cost(x, last)
            left = _padded(np.arange(1, last - first + 1), np.maximum.accumulate(span, axis=0), weights).tolist()
            right = _padded(
                np.arange(last - first, 0, -1), np.maximum.accumulate(span[::-1], axis=0)[::-1], weights
            ).tolist()
            lo, hi = first + 1, last - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if left[mid - first - 1] <= right[mid - first]:
                    lo = mid
                else:
                    hi = mid - 1
            best = max(
                (
                    b
                    for b in (lo, lo + 1)
                    if first < b < last
                    and left[b - first - 1] <= budget
                    and right[b - first] <= budget
                    and (max_size is None or (b - first <= max_size and last - b <= max_size))
                ),
                key=lambda b: min(left[b - first - 1], right[b - first]),
                default=bounds[k],
            )
            bounds[k] = best
    return [([samples[i] for i in range(a, b)], cost(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]


def light_to_carry(costs: Sequence[float], sizes: Sequence[int], budget: float, limit: int) -> list[int]:
    """Indices of the light micro-batches (under 0.75 of ``budget``) to carry to the next window, at most ``limit``
    samples.

    Only leftovers with room for one more sample like their longest (cost × (n + 1) / n within
    budget): a lone sample costing 0.6 of the budget is as light in any window, so it stays.
    Lightest first; one that would take the total over ``limit`` is skipped (stays in its window).
    """
    chosen, total = [], 0
    for i in sorted(range(len(costs)), key=lambda k: (costs[k], k)):
        if costs[i] >= _LIGHT * budget:
            break
        if costs[i] * (sizes[i] + 1) / sizes[i] <= budget and total + sizes[i] <= limit:
            chosen.append(i)
            total += sizes[i]
    return sorted(chosen)
