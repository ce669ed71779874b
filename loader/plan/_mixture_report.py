"""What a mixture's plan gives each source: its share of the samples and of the cost, and the padding its samples bear.

Behind the ``sources`` of `omnifeed plan --stats` for a mixture. Over the micro-batches of one
epoch added: a source's ``share`` is its samples over all samples, its ``planned_share`` what the
schedule deals it over the whole epoch (equal once the epoch is fully dealt, drop_last aside).
A micro-batch's padded cost (as `PlanReport` counts it) is split among its samples in
proportion to each one's own cost alone; ``cost_share`` adds up a source's part. Padding per
stream is `PlanReport`'s restricted to the source's rows: in a micro-batch of longest ``m``, a
source's ``k`` rows hold ``Σ lengths`` of their ``k × m`` slots; in packing mode a pack's
empty slots are split among its sources by their tokens in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnifeed.bucketing import CostModel, padded_cost, sample_costs

from ..index import MixtureIndex
from ._cursor import Step
from ._micro_batch import MicroBatch
from ._plan import Plan

_DEFAULT_COST = CostModel()


@dataclass
class MixtureReport:
    """Accumulates the micro-batches of one epoch of a mixture's plan into per-source figures."""

    plan: Plan
    index: MixtureIndex
    epoch: int
    cost: CostModel | None = None  # default: the plan's bucketing cost model, else the default one
    _samples: np.ndarray = field(init=False)
    _costs: np.ndarray = field(init=False)
    _used: dict[str, np.ndarray] = field(default_factory=dict)
    _slots: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.plan.mixture is None:
            raise ValueError("MixtureReport reports a mixture's plan; use PlanReport for one index")
        self._samples = np.zeros(len(self.index.names), dtype=np.int64)
        self._costs = np.zeros(len(self.index.names), dtype=np.float64)

    def add(self, step: Step) -> None:
        """Account for the micro-batches of ``step`` that belong to the report's epoch."""
        for mb in step.micro_batches:
            if mb.epoch == self.epoch and mb.positions.size:
                self._add(mb)

    def _add(self, mb: MicroBatch) -> None:
        count = len(self.index.names)
        source = np.searchsorted(self.index.offsets, mb.positions, side="right") - 1
        bucketing = self.plan.bucketing
        if mb.pack is not None and bucketing is not None:  # a sample split across packs counts in its first one
            owner = np.searchsorted(self.index.offsets, mb.pack.positions, side="right") - 1
            firsts = np.array([s.start == 0 for s in mb.pack.segments], dtype=bool)
            self._samples += np.bincount(owner[firsts], minlength=count)
            tokens = np.bincount(owner, weights=[s.length for s in mb.pack.segments], minlength=count)
            stream = bucketing.pack_stream
            self._account(stream, tokens, bucketing.budget * tokens / max(float(tokens.sum()), 1.0))
            self._costs += tokens
            return
        self._samples += np.bincount(source, minlength=count)
        model = self.cost or (bucketing.cost if bucketing else _DEFAULT_COST)
        lengths = self.plan.stream_lengths(mb.positions, model)
        for stream, values in lengths.items():
            if values.size and values.any():
                self._account(
                    stream,
                    np.bincount(source, weights=values.astype(np.float64), minlength=count),
                    np.bincount(source, minlength=count) * float(values.max()),
                )
        own = sample_costs(lengths, model)
        total = padded_cost(lengths, model)
        weights = own if own.sum() > 0 else np.ones(mb.positions.size)
        self._costs += total * np.bincount(source, weights=weights, minlength=count) / float(weights.sum())

    def _account(self, stream: str, used: np.ndarray, slots: np.ndarray) -> None:
        zero = np.zeros(len(self.index.names))
        self._used[stream] = self._used.get(stream, zero) + used
        self._slots[stream] = self._slots.get(stream, zero) + slots

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per source name: ``samples``, ``share``, ``planned_share``, ``cost_share``, ``padding_fraction`` per stream
        (streams its samples hold), ``removed_by_filter``."""
        assert self.plan.mixture is not None
        planned = np.bincount(
            self.plan.mixture.sources(self.epoch, 0, self.plan.num_samples), minlength=len(self.index.names)
        )
        samples, cost = max(int(self._samples.sum()), 1), float(self._costs.sum()) or 1.0
        out: dict[str, dict[str, Any]] = {}
        for s, name in enumerate(self.index.names):
            padding = {
                stream: round(1.0 - float(self._used[stream][s]) / float(slots[s]), 6)
                for stream, slots in sorted(self._slots.items())
                if slots[s] > 0 and self._used[stream][s] > 0
            }
            out[name] = {
                "samples": int(self._samples[s]),
                "share": round(float(self._samples[s]) / samples, 6),
                "planned_share": round(float(planned[s]) / max(int(planned.sum()), 1), 6),
                "cost_share": round(float(self._costs[s]) / cost, 6),
                "padding_fraction": padding,
                "removed_by_filter": self.index.removed[name],
            }
        return out
