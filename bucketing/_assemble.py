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
2. each bucket's last, partly filled micro-batch is a *leftover*; leftovers are pooled by
   modality mix, sorted by cost (similar samples meet) and filled the same way, a mix at a time;
3. the last of those borrows from the lookahead while it fits and the next sample is of its mix;
4. light micro-batches are dissolved into ones of their own modality mix with room (each
   sample where it adds the least padding);
5. with ``carry``, the light ones left that have room are carried (`light_to_carry`): they meet
   a window's worth of their own mix in the next window, instead of another mix here;
6. a light one left is evened out with micro-batches of its own bucket and mix (`_even_light`);
7. jumps in the window's costs are bridged with pieces of fluid micro-batches (`_bridge`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ._bridge import bridge_gaps
from ._cost import CostModel, sample_costs
from ._layout import mix_masks
from ._leftovers import _absorb_light, _even_light, _padded, _scalar_padded, _Weights, light_to_carry


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
    carry: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # positions for the next window


class _Batch:
    """A micro-batch being filled: its members and running per-stream maxima."""

    def __init__(self, streams: int) -> None:
        self.members: list[int] = []
        self.longest = [0.0] * streams

    def cost_with(self, row: list[float], model: _Weights) -> float:
        return _scalar_padded(len(self.members) + 1, [max(a, b) for a, b in zip(self.longest, row)], model)

    def cost(self, model: _Weights) -> float:
        return _scalar_padded(len(self.members), self.longest, model)

    def add(self, position: int, row: list[float]) -> None:
        self.members.append(position)
        self.longest = [max(a, b) for a, b in zip(self.longest, row)]


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

    def offer_run(self, order: list[int], table: np.ndarray) -> None:
        """`offer` each of ``order`` in turn, into an empty open micro-batch, whole micro-batches at a time.

        The same micro-batches and costs, bit for bit, as offering one by one (`_padded` sums in the
        scalar cost's order): the running maxima of a stretch of rows give every prefix's cost at once.
        """
        rows, n, a, guess = table[order], len(order), 0, 16
        counts = np.arange(1, n + 1, dtype=np.float64)  # a micro-batch's size after each of its samples
        while a < n:
            span = n - a if self.max_size is None else min(n - a, self.max_size)
            while True:  # a stretch long enough to hold the first sample over the budget, or the whole span
                stretch = min(span, guess)
                longest = np.maximum.accumulate(rows[a : a + stretch], axis=0)
                # the first prefix over the budget (a prefix's cost grows with each sample it takes)
                taken = int(_padded(counts[:stretch], longest, self.weights).searchsorted(self.budget, side="right"))
                if taken < stretch or stretch == span:
                    break
                guess *= 2
            if taken == 0:  # alone, it is over budget
                self.offer(order[a], rows[a].tolist())
                a += 1
                continue
            members = order[a : a + taken]
            if a + taken == n:  # the run's last: it stays open, as `offer` leaves it
                self.open = _Batch(self.streams)
                for i, position in enumerate(members):
                    self.open.add(position, rows[a + i].tolist())
            else:
                self.done.append((list(members), self.open_cost(longest[taken - 1], taken)))
            guess = max(16, 2 * taken)
            a += taken

    def open_cost(self, longest: np.ndarray, size: int) -> float:
        """The scalar cost of ``size`` samples whose streams' longest are ``longest``."""
        return _scalar_padded(size, longest.tolist(), self.weights)


def _table(lengths: Mapping[str, np.ndarray], streams: list[str]) -> np.ndarray:
    """Per sample (row), its length in each of ``streams`` (column), float64; no rows without streams."""
    return np.stack([lengths[s].astype(np.float64) for s in streams], axis=1) if streams else np.zeros((0, 0))


def _fill_buckets(
    filler: _Filler, table: np.ndarray, buckets: np.ndarray, costs: np.ndarray, streams: int
) -> tuple[_Filler, list[int]]:
    """Fill each bucket shortest first; each bucket's partly filled last micro-batch becomes leftovers."""
    leftovers: list[int] = []
    order = np.argsort(buckets, kind="stable")
    sorted_buckets = buckets[order]
    starts = np.flatnonzero(np.r_[True, sorted_buckets[1:] != sorted_buckets[:-1]]) if order.size else order
    for a, b in zip(starts.tolist(), [*starts[1:].tolist(), order.size]):
        members = order[a:b]
        filler.offer_run(members[np.argsort(costs[members], kind="stable")].tolist(), table)
        leftovers.extend(filler.open.members)
        filler.open = _Batch(streams)
    return filler, leftovers


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
    carry: int = 0,
    lookahead_ends_epoch: bool = False,
) -> Assembled:
    """Bucket, fill to ``budget``, borrow from the lookahead and carry light leftovers; ``lengths``/``buckets`` align
    with ``positions``.

    ``carry``: at most this many samples of light micro-batches go to `Assembled.carry` (0 for
    a window that ends its epoch); ``lookahead_ends_epoch``: the lookahead runs to the epoch's
    end, so a window that borrows all of it ends the epoch and carries nothing.
    """
    streams = [s for s in lengths if model.weight(s) > 0]
    weights = _Weights([model.weight(s) for s in streams], model.quadratic)
    table = _table(lengths, streams)  # the per-sample steps take a row as a list (`table[k].tolist()`)
    filler = _Filler(budget, max_batch_size, weights, len(streams), overlong)
    costs = sample_costs({s: lengths[s] for s in streams}, model)
    try:
        filler, leftovers = _fill_buckets(filler, table, buckets, costs, len(streams))
    except OverBudgetError as exc:  # name the sample by its position, not its place in the window
        raise OverBudgetError(int(positions[exc.position]), exc.cost, exc.budget) from None
    # leftovers meet by modality mix (no rows of pure padding), a mix at a time, then by cost
    present = mix_masks(lengths, tuple(streams))
    by_cost = np.lexsort([costs[leftovers], present[leftovers]]) if leftovers else np.zeros(0, dtype=np.int64)
    for k in by_cost.tolist():
        if filler.open.members and present[filler.open.members[0]] != present[leftovers[k]]:
            filler.close()
        filler.offer(leftovers[k], table[leftovers[k]].tolist())
    consumed = 0
    cells = np.asarray(buckets, dtype=np.int64)
    if lookahead_positions is not None and lookahead_lengths is not None and filler.open.members:
        extra_table = _table(lookahead_lengths, streams)
        extra_mix = mix_masks(lookahead_lengths, tuple(streams))
        mix = present[filler.open.members[0]]
        while consumed < len(extra_table) and extra_mix[consumed] == mix:
            row = extra_table[consumed].tolist()
            if not filler.fits(row):
                break
            filler.open.add(len(table) + consumed, row)
            consumed += 1
        table = np.concatenate([table, extra_table[:consumed]]) if streams else table
        present = np.concatenate([present, extra_mix[:consumed]])
        cells = np.concatenate(
            [cells, np.full(consumed, cells[filler.open.members[0]], dtype=np.int64)]
        )  # borrowed: its bucket
    filler.close()
    filler.done = _absorb_light(filler.done, table, present, weights, budget, max_batch_size, cells)
    pool = np.concatenate([positions, lookahead_positions[:consumed]]) if lookahead_positions is not None else positions
    carried = np.empty(0, dtype=np.int64)
    if carry and not (
        lookahead_ends_epoch and lookahead_positions is not None and consumed == len(lookahead_positions)
    ):
        moved = light_to_carry([c for _, c in filler.done], [len(m) for m, _ in filler.done], budget, carry)
        if moved:
            carried = pool[np.asarray([i for k in moved for i in filler.done[k][0]], dtype=np.int64)]
            filler.done = [batch for k, batch in enumerate(filler.done) if k not in set(moved)]
    filler.done = _even_light(filler.done, table, present, weights, budget, max_batch_size, cells)
    filler.done = bridge_gaps(filler.done, table, cells, weights, budget, max_batch_size, present)
    return Assembled(
        batches=[pool[np.asarray(members, dtype=np.int64)] for members, _ in filler.done],
        costs=[cost for _, cost in filler.done],
        consumed=consumed,
        carry=carried,
    )


def assemble_fixed(positions: np.ndarray, batch_size: int, lookahead_positions: np.ndarray | None = None) -> Assembled:
    """Consecutive chunks of ``batch_size``; a short last chunk is topped up from the lookahead."""
    short = len(positions) % batch_size
    consumed = 0
    if short and lookahead_positions is not None:
        consumed = min(batch_size - short, len(lookahead_positions))
        positions = np.concatenate([positions, lookahead_positions[:consumed]])
    batches = [positions[i : i + batch_size] for i in range(0, len(positions), batch_size)]
    return Assembled(batches=batches, costs=[float(len(b)) for b in batches], consumed=consumed)
