"""What a plan costs: padding per stream, balance across the ranks of a step, the costliest micro-batches.

Behind `omnifeed plan --stats` and `--worst N`. Padding of a stream in a micro-batch of
``n`` samples is ``n × longest − Σ lengths`` (absent streams pad a whole row); in packing
mode the packed stream pads ``capacity − Σ segment lengths`` per pack. A step's balance is
max/mean of the costs its ranks receive, per accumulation micro-step; the *final step* of an
epoch is the one holding its last micro-batch (it runs on into the next epoch and deals the
light micro-batches the epoch's last window could not carry), reported apart.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnifeed.bucketing import CostModel, balance, padded_cost

from ._limits import BALANCE_LIMIT, PADDING_LIMIT, balance_limits, padding_limits
from ._plan import MicroBatch, Plan
from ._step import Step

_DEFAULT_COST = CostModel()


@dataclass
class PlanReport:
    """Accumulates steps of one plan into the figures of ``--stats`` and ``--worst``."""

    plan: Plan
    worst: int = 0
    cost: CostModel | None = None  # default: the plan's bucketing cost model, else the default one
    micro_batches: int = 0
    samples: int = 0
    _used: dict[str, float] = field(default_factory=dict)
    _slots: dict[str, float] = field(default_factory=dict)
    _step_costs: list[list[float]] = field(default_factory=list)
    _heap: list[tuple[float, int, MicroBatch]] = field(default_factory=list)
    _worst: tuple[float, tuple[MicroBatch, ...]] = (
        1.0,
        (),
    )  # the worst step but an epoch's final one, its micro-batches
    _final: list[float] = field(default_factory=list)  # balance of each epoch's final step

    def add(self, step: Step) -> None:
        """Account for every micro-batch of ``step``."""
        costs = [self._add(mb) for mb in step.micro_batches]
        for a in range(step.grad_accum):  # the ranks of one accumulation micro-step run side by side
            group = slice(a * step.world_size, (a + 1) * step.world_size)
            self._step_costs.append(costs[group])
            ratio = balance([costs[group]])["worst"]
            if any(mb.ends_epoch for mb in step.micro_batches[group]):
                self._final.append(ratio)
            elif ratio > self._worst[0]:
                self._worst = (ratio, step.micro_batches[group])

    def _add(self, mb: MicroBatch) -> float:
        lengths = self.plan.stream_lengths(mb.positions, self._cost)
        bucketing = self.plan.bucketing
        if mb.pack is not None and bucketing is not None:
            stream = bucketing.pack_stream
            self._used[stream] = self._used.get(stream, 0.0) + mb.pack.length
            self._slots[stream] = self._slots.get(stream, 0.0) + bucketing.budget
            cost = float(mb.pack.length)
        else:
            for stream, values in lengths.items():
                if values.any():
                    self._used[stream] = self._used.get(stream, 0.0) + float(values.sum())
                    self._slots[stream] = self._slots.get(stream, 0.0) + float(values.size * values.max())
            cost = padded_cost(lengths, self._cost)
        self.micro_batches += 1
        self.samples += int(mb.positions.size)
        if self.worst:
            entry = (cost, -self.micro_batches, mb)
            (heapq.heappush if len(self._heap) < self.worst else heapq.heappushpop)(self._heap, entry)
        return cost

    @property
    def _cost(self) -> CostModel:
        return self.cost or (self.plan.bucketing.cost if self.plan.bucketing else _DEFAULT_COST)

    def stats(self) -> dict[str, Any]:
        """``micro_batches``, ``samples``, ``padding_fraction`` per stream, ``balance_max_over_mean`` (every step).

        Also ``balance_worst_before_final_step`` (the worst step but each epoch's final one),
        ``final_step_balance`` (the worst final step seen; null when the report holds none),
        ``worst_step`` (that worst step's micro-batch costs, in budgets when there is one),
        ``padding_estimate`` (per stream, what the plan's layout expected; budget mode without
        explicit edges), ``window_size``, ``targets`` and ``limits``: one line per mechanism
        keeping padding or balance over its target (`_limits`), empty when both are met.
        """
        costs = [c for step in self._step_costs for c in step]
        padding = {s: round(1.0 - self._used[s] / self._slots[s], 6) for s in sorted(self._slots) if self._slots[s]}
        worst, step = self._worst
        unit = self.plan.budget or 1.0
        return {
            "micro_batches": self.micro_batches,
            "samples": self.samples,
            "mean_cost": float(np.mean(costs)) if costs else 0.0,
            "max_cost": float(np.max(costs)) if costs else 0.0,
            "padding_fraction": padding,
            "balance_max_over_mean": balance(self._step_costs),
            "balance_worst_before_final_step": round(worst, 6),
            "final_step_balance": round(max(self._final), 6) if self._final else None,
            "worst_step": [round(mb.cost / unit, 4) for mb in step],
            "padding_estimate": dict(self.plan.layout.estimate) if self.plan.layout is not None else None,
            "window_size": self.plan.window_size,
            "targets": {"padding_fraction": PADDING_LIMIT, "balance_worst_before_final_step": BALANCE_LIMIT},
            "limits": padding_limits(self.plan, padding) + balance_limits(self.plan, worst, step),
        }

    def costliest(self) -> list[dict[str, Any]]:
        """The ``worst`` costliest micro-batches seen, costliest first, with their longest streams."""
        rows = []
        for cost, _, mb in sorted(self._heap, key=lambda e: (-e[0], -e[1])):
            lengths = self.plan.stream_lengths(mb.positions, self._cost)
            rows.append(
                {
                    "cost": cost,
                    "epoch": mb.epoch,
                    "micro_batch": mb.index,
                    "window": mb.window,
                    "samples": int(mb.positions.size),
                    "longest": {s: int(v.max()) for s, v in lengths.items() if v.size and v.any()},
                    "positions": mb.positions.tolist(),
                }
            )
        return rows
