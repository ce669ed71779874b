"""The exactly-once check of a mixture epoch, per source: what the schedule planned, as often as it planned it.

A mixture epoch holds each source's samples as the schedule deals them: a small source
repeated three times per epoch holds each of its samples three times (three source epochs),
a large one part of a source epoch. So the check is against the plan, not against "each
sample once": the records of mixture epoch ``e`` must deliver the multiset the mixed stream
holds in ``[e·L, (e+1)·L)`` — every planned sample as many times as planned, nothing else.
Since the schedule walks each source epoch's permutation in order, that is exactly once per
source epoch. The report says, per source, what was planned and delivered, the realised share
against the weight, the source epochs the mixture epoch spans, and what the filter removed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..index import MixtureIndex
from ._audit import delivered_keys
from ._plan import Plan

_EXAMPLES = 5


@dataclass(frozen=True)
class SourceCoverage:
    """One source's part of a mixture epoch."""

    planned: int
    delivered: int
    duplicates: int
    missing: int
    share: float  # of the epoch's delivered samples
    planned_share: float
    source_epochs: tuple[int, int]  # [first, last] source epoch the mixture epoch touches
    removed_by_filter: int
    examples: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class MixtureCoverageReport:
    """A mixture epoch's delivery against its plan: ok only when every source got exactly what was planned."""

    epoch: int
    samples: int
    delivered: int
    unknown: int
    partial: int
    sources: dict[str, SourceCoverage]
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when each source delivered exactly its planned samples and nothing else was delivered."""
        return (
            self.unknown == 0
            and self.partial == 0
            and all(s.duplicates == 0 and s.missing == 0 for s in self.sources.values())
        )

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict, with ``ok``."""
        return {**asdict(self), "ok": self.ok}


def verify_mixture(
    index: MixtureIndex, plan: Plan, epoch: int, records: Iterable[dict[str, Any]]
) -> MixtureCoverageReport:
    """Check that the records deliver mixture epoch ``epoch`` of ``plan`` exactly as planned, source by source.

    Raises ValueError for a plan that is not a mixture's.
    """
    if plan.mixture is None:
        raise ValueError("verify_mixture checks a mixture's plan; use verify_coverage for one index")
    planned = plan.mixture.slice(epoch, 0, plan.num_samples)
    keys, partial = delivered_keys(epoch, records)
    positions = index.positions_of(keys) if keys else np.empty(0, dtype=np.int64)
    known = positions >= 0
    expected = np.bincount(planned, minlength=index.num_samples)
    got = np.bincount(positions[known], minlength=index.num_samples)
    schedule = plan.mixture.schedule
    first = schedule.counts(epoch * plan.num_samples) // schedule.sizes
    last = np.maximum(schedule.counts((epoch + 1) * plan.num_samples) - 1, 0) // schedule.sizes
    sources = {}
    for s, name in enumerate(index.names):
        span = slice(int(index.offsets[s]), int(index.offsets[s + 1]))
        want, have = expected[span], got[span]
        over, under = np.flatnonzero(have > want), np.flatnonzero(have < want)
        sources[name] = SourceCoverage(
            planned=int(want.sum()),
            delivered=int(have.sum()),
            duplicates=int((have[over] - want[over]).sum()),
            missing=int((want[under] - have[under]).sum()),
            share=float(have.sum() / max(1, int(known.sum()))),
            planned_share=float(want.sum() / max(1, planned.size)),
            source_epochs=(int(first[s]), int(last[s])),
            removed_by_filter=index.removed[name],
            examples={
                "duplicated": index.keys(over[:_EXAMPLES] + span.start),
                "missing": index.keys(under[:_EXAMPLES] + span.start),
            },
        )
    unknown_keys = [k for k, ok in zip(keys, known.tolist()) if not ok]
    return MixtureCoverageReport(
        epoch=epoch,
        samples=int(planned.size),
        delivered=len(keys),
        unknown=len(unknown_keys),
        partial=partial,
        sources=sources,
        examples={"unknown": unknown_keys[:_EXAMPLES]},
    )
