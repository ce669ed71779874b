"""Micro-batches of one window: fixed-size chunks, or bucketed and filled to a cost budget.

Both take the window's own samples (in stream order) and a *lookahead*: the samples that
follow the window in the stream. Only the window's last micro-batch may borrow from the
lookahead, a prefix of it, to fill up; the caller starts the next window after what was
borrowed. The caller may also *carry* a window's light micro-batches (`light_to_carry`) into
the next window, where their samples join its own; a window's micro-batches then depend only
on (its start, the stream, the budget, the few ids carried in): resuming needs one window.

Budget mode, per window:

1. samples go to buckets (cells of per-stream length edges); within a bucket, shortest
   first, a micro-batch takes the next sample while its padded cost stays within budget;
2. each bucket's last, partly filled micro-batch is a *leftover*; leftovers are pooled,
   sorted by modality mix, then cost (similar samples meet) and filled the same way;
3. the last of those borrows from the lookahead while it fits;
4. light micro-batches are dissolved into ones of their own modality mix with room, or
   merged pairwise (across mixes) when the merged one fits the budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ._cost import CostModel, sample_costs
from ._layout import mix_masks

_LIGHT = 0.75  # a micro-batch under this fraction of the budget is a leftover worth merging


class OverBudgetError(ValueError):
    """One sample alone costs more than the micro-batch budget."""

    def __init__(self, position: int, cost: float, budget: float) -> None:
        super().__init__(
            f"sample at position {position} costs {cost:g} alone, over the micro-batch budget {budget:g}; "
            "raise the budget, set overlong='alone', or drop the sample from the dataset"
        )
        self.position, self.cost, self.budget = position, cost, budget


@dataclass(frozen=True)
class Assembled:
    """A window's micro-batches (positions), their padded costs, and how much lookahead they took."""

    batches: list[np.ndarray]
    costs: list[float]
    consumed: int


class _Batch:
    """A micro-batch being filled: its members and running per-stream maxima."""

    def __init__(self, streams: int) -> None:
        self.members: list[int] = []
        self.longest = [0.0] * streams

    def cost_with(self, row: list[float], model: _Weights) -> float:
        n = len(self.members) + 1
        return sum(
            w * n * (m + model.quadratic * m * m)
            for w, m in zip(model.weights, (max(a, b) for a, b in zip(self.longest, row)))
        )

    def cost(self, model: _Weights) -> float:
        n = len(self.members)
        return sum(w * n * (m + model.quadratic * m * m) for w, m in zip(model.weights, self.longest))

    def add(self, position: int, row: list[float]) -> None:
        self.members.append(position)
        self.longest = [max(a, b) for a, b in zip(self.longest, row)]


@dataclass(frozen=True)
class _Weights:
    weights: list[float]
    quadratic: float


class _Filler:
    """Greedy filling under (budget, max size); emits closed micro-batches."""

    def __init__(
        self, budget: float, max_size: int | None, weights: _Weights, streams: int, overlong: Literal["reject", "alone"]
    ) -> None:
        self.budget, self.max_size, self.weights, self.streams, self.overlong = (
            budget,
            max_size,
            weights,
            streams,
            overlong,
        )
        self.done: list[tuple[list[int], float]] = []
        self.open = _Batch(streams)

    def fits(self, row: list[float]) -> bool:
        if self.max_size is not None and len(self.open.members) >= self.max_size:
            return False
        return self.open.cost_with(row, self.weights) <= self.budget

    def offer(self, position: int, row: list[float]) -> None:
        """Add to the open micro-batch, closing it first when the sample does not fit."""
        if not self.fits(row) and self.open.members:
            self.close()
        if not self.fits(row):  # alone, it is over budget
            alone = _Batch(self.streams)
            alone.add(position, row)
            if self.overlong == "reject":
                raise OverBudgetError(position, alone.cost(self.weights), self.budget)
            self.done.append((alone.members, alone.cost(self.weights)))
            return
        self.open.add(position, row)

    def close(self) -> None:
        if self.open.members:
            self.done.append((self.open.members, self.open.cost(self.weights)))
        self.open = _Batch(self.streams)


def _rows(lengths: Mapping[str, np.ndarray], streams: list[str]) -> list[list[float]]:
    return np.stack([lengths[s].astype(np.float64) for s in streams], axis=1).tolist() if streams else []


def _fill_buckets(
    filler: _Filler, rows: list[list[float]], buckets: np.ndarray, costs: np.ndarray, streams: int
) -> tuple[_Filler, list[int]]:
    """Fill each bucket shortest first; each bucket's partly filled last micro-batch becomes leftovers."""
    leftovers: list[int] = []
    for bucket in np.unique(buckets).tolist():
        members = np.flatnonzero(buckets == bucket)
        for i in members[np.argsort(costs[members], kind="stable")].tolist():
            filler.offer(i, rows[i])
        leftovers.extend(filler.open.members)
        filler.open = _Batch(streams)
    return filler, leftovers


def _padded(sizes: np.ndarray, longest: np.ndarray, weights: _Weights) -> np.ndarray:
    """Padded cost of micro-batches of ``sizes`` samples whose streams' longest are the rows of ``longest``."""
    return sizes * ((longest + weights.quadratic * longest * longest) @ np.asarray(weights.weights, dtype=np.float64))


def _absorb_light(
    done: list[tuple[list[int], float]],
    rows: list[list[float]],
    present: np.ndarray,
    weights: _Weights,
    budget: float,
    max_size: int | None,
) -> list[tuple[list[int], float]]:
    """Spread each light micro-batch's samples over micro-batches of their own modality mix that have room.

    A sample goes where it leaves the fullest micro-batch within budget; a light micro-batch is
    dissolved only when all its samples find room (otherwise it stays whole).
    """
    if len(done) < 2 or not rows:
        return done
    table = np.asarray(rows, dtype=np.float64)
    members = [list(batch) for batch, _ in done]
    sizes = np.array([len(m) for m in members], dtype=np.float64)
    longest = np.stack([table[m].max(axis=0) for m in members])
    kinds = np.array([present[m[0]] if np.all(present[m] == present[m[0]]) else -1 for m in members])  # -1: mixed
    costs = np.array([cost for _, cost in done])
    alive = np.ones(len(done), dtype=bool)
    for k in np.argsort(costs, kind="stable").tolist():
        if costs[k] >= _LIGHT * budget:
            continue
        alive[k] = False
        trial_sizes, trial_longest, trial_costs, moves = sizes.copy(), longest.copy(), costs.copy(), []
        for sample in members[k]:
            top = np.maximum(trial_longest, table[sample])
            with_it = _padded(trial_sizes + 1, top, weights)
            fits = alive & (kinds == present[sample]) & (with_it <= budget)
            if max_size is not None:
                fits &= trial_sizes < max_size
            if not fits.any():
                break
            j = int(np.argmax(np.where(fits, with_it, -1.0)))
            trial_sizes[j], trial_longest[j], trial_costs[j] = trial_sizes[j] + 1, top[j], with_it[j]
            moves.append((sample, j))
        if len(moves) < len(members[k]):
            alive[k] = True
            continue
        for sample, j in moves:
            members[j].append(sample)
        sizes, longest, costs = trial_sizes, trial_longest, trial_costs
    return [(members[i], float(costs[i])) for i in np.flatnonzero(alive).tolist()]


def _merge_light(
    done: list[tuple[list[int], float]], rows: list[list[float]], weights: _Weights, budget: float, max_size: int | None
) -> list[tuple[list[int], float]]:
    """Merge light micro-batches (leftovers of rare modality mixes) pairwise while the merged one fits the budget.

    Lightest first, each into the light partner that leaves the fullest micro-batch: a step that
    deals a leftover of 0.3 budgets beside full micro-batches is what unbalances ranks, and the
    padding a mixed micro-batch adds (rows of absent streams) is bounded by the leftovers' size.
    """
    light = [i for i, (_, cost) in enumerate(done) if cost < _LIGHT * budget]
    if len(light) < 2:
        return done
    sizes = np.array([len(done[i][0]) for i in light], dtype=np.float64)
    longest = np.array([np.max([rows[m] for m in done[i][0]], axis=0) for i in light], dtype=np.float64).reshape(
        len(light), -1
    )
    costs = np.array([done[i][1] for i in light])
    alive = np.ones(len(light), dtype=bool)
    members = {i: list(done[i][0]) for i in light}
    for k in np.argsort(costs, kind="stable").tolist():
        if not alive[k] or costs[k] > budget / 2:  # two costing more than half a budget never fit together
            continue
        top = np.maximum(longest, longest[k])
        merged = _padded(sizes + sizes[k], top, weights)
        fits = alive & (merged <= budget) & (np.arange(len(light)) != k)
        if max_size is not None:
            fits &= sizes + sizes[k] <= max_size
        if not fits.any():
            continue
        j = int(np.argmax(np.where(fits, merged, -1.0)))
        members[light[j]].extend(members[light[k]])
        sizes[j], longest[j], costs[j] = sizes[j] + sizes[k], top[j], merged[j]
        alive[k] = False
    kept = {light[k]: (members[light[k]], float(costs[k])) for k in np.flatnonzero(alive).tolist()}
    return [kept[i] if i in kept else batch for i, batch in enumerate(done) if i in kept or i not in members]


def assemble_budget(
    positions: np.ndarray,
    lengths: Mapping[str, np.ndarray],
    buckets: np.ndarray,
    budget: float,
    model: CostModel,
    *,
    max_batch_size: int | None = None,
    overlong: Literal["reject", "alone"] = "reject",
    lookahead_positions: np.ndarray | None = None,
    lookahead_lengths: Mapping[str, np.ndarray] | None = None,
) -> Assembled:
    """Bucket, fill to ``budget`` and borrow from the lookahead; ``lengths``/``buckets`` align with ``positions``."""
    streams = [s for s in lengths if model.weight(s) > 0]
    weights = _Weights([model.weight(s) for s in streams], model.quadratic)
    rows = _rows(lengths, streams)
    filler = _Filler(budget, max_batch_size, weights, len(streams), overlong)
    costs = sample_costs({s: lengths[s] for s in streams}, model)
    try:
        filler, leftovers = _fill_buckets(filler, rows, buckets, costs, len(streams))
    except OverBudgetError as exc:  # name the sample by its position, not its place in the window
        raise OverBudgetError(int(positions[exc.position]), exc.cost, exc.budget) from None
    # leftovers meet by modality mix first (no rows of pure padding), then by cost
    present = mix_masks(lengths, tuple(streams))
    by_cost = np.lexsort([costs[leftovers], present[leftovers]]) if leftovers else np.zeros(0, dtype=np.int64)
    for k in by_cost.tolist():
        filler.offer(leftovers[k], rows[leftovers[k]])
    consumed = 0
    if lookahead_positions is not None and lookahead_lengths is not None and filler.open.members:
        extra = _rows(lookahead_lengths, streams)
        while consumed < len(extra) and filler.fits(extra[consumed]):
            filler.open.add(len(rows) + consumed, extra[consumed])
            consumed += 1
        rows = rows + extra[:consumed]
        present = np.concatenate([present, mix_masks(lookahead_lengths, tuple(streams))[:consumed]])
    filler.close()
    filler.done = _absorb_light(filler.done, rows, present, weights, budget, max_batch_size)
    filler.done = _merge_light(filler.done, rows, weights, budget, max_batch_size)
    pool = np.concatenate([positions, lookahead_positions[:consumed]]) if lookahead_positions is not None else positions
    return Assembled(
        batches=[pool[np.asarray(members, dtype=np.int64)] for members, _ in filler.done],
        costs=[cost for _, cost in filler.done],
        consumed=consumed,
    )


def light_to_carry(costs: Sequence[float], sizes: Sequence[int], budget: float, limit: int) -> list[int]:
    """Indices of the light micro-batches (under 0.75 of ``budget``) to carry to the next window, at most ``limit`` samples.

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


def assemble_fixed(positions: np.ndarray, batch_size: int, lookahead_positions: np.ndarray | None = None) -> Assembled:
    """Consecutive chunks of ``batch_size``; a short last chunk is topped up from the lookahead."""
    short = len(positions) % batch_size
    consumed = 0
    if short and lookahead_positions is not None:
        consumed = min(batch_size - short, len(lookahead_positions))
        positions = np.concatenate([positions, lookahead_positions[:consumed]])
    batches = [positions[i : i + batch_size] for i in range(0, len(positions), batch_size)]
    return Assembled(batches=batches, costs=[float(len(b)) for b in batches], consumed=consumed)
