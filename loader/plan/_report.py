"""What a plan costs: padding per stream, balance across the ranks of a step, the costliest micro-batches.

Behind `omnifeed plan --stats` and `--worst N`. Padding of a stream in a micro-batch of
``n`` samples is ``n × longest − Σ lengths`` (absent streams pad a whole row); in packing
mode the packed stream pads ``capacity − Σ segment lengths`` per pack.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnifeed.bucketing import CostModel, balance, padded_cost

from ._cursor import Step
from ._plan import MicroBatch, Plan

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

    def add(self, step: Step) -> None:
        """Account for every micro-batch of ``step``."""
        costs = [self._add(mb) for mb in step.micro_batches]
        for a in range(step.grad_accum):  # the ranks of one accumulation micro-step run side by side
            self._step_costs.append(costs[a * step.world_size : (a + 1) * step.world_size])

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
        """``micro_batches``, ``samples``, ``padding_fraction`` per stream, ``balance_max_over_mean``."""
        costs = [c for step in self._step_costs for c in step]
        return {
            "micro_batches": self.micro_batches,
            "samples": self.samples,
            "mean_cost": float(np.mean(costs)) if costs else 0.0,
            "max_cost": float(np.max(costs)) if costs else 0.0,
            "padding_fraction": {
                s: round(1.0 - self._used[s] / self._slots[s], 6) for s in sorted(self._slots) if self._slots[s]
            },
            "balance_max_over_mean": balance(self._step_costs),
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
