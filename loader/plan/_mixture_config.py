"""`MixtureConfig`: a weighted blend of indexes, filtered on the fly, with a schedule of phases
(docs/index-and-plan.md).

::

    plan:
      mixture:
        sources:
          photos: {index: photos-index, weight: 0.6}
          docs:   {index: docs-index, weight: 0.4, where: {text_tokens: [16, 4096]}}
        phases:                                  # optional: weights from a number of mixed samples on
          - {until_samples: 200000, weights: {photos: 0.6, docs: 0.4}}
          - {weights: {photos: 0.2, docs: 0.8}}  # annealing, to the end
        plans: mixture-plans                     # optional: its epochs written ahead (`plan --write-epochs`)

A source's ``weight`` is its share of the mixed stream; ``repeat`` (instead of weights, on every
source) is MosaicML Streaming's: passes over the source per mixture epoch, the shares following
from ``repeat × samples``. A mixture epoch is ``epoch_samples`` mixed samples (default: one pass's
worth, the sources' samples after their filters, or with ``repeat`` the sum of ``repeat × samples``).
"""

from __future__ import annotations

import json

import xxhash
from pydantic import Field, model_validator

from .._config import StrictModel


class MixtureSource(StrictModel):
    """One source of a mixture: an index (or the part of it a filter keeps) and its share."""

    index: str = Field(description="The source's omnifeed index (a directory; relative to the config file).")
    weight: float | None = Field(default=None, ge=0, description="Share of the mixed stream (normalised over sources).")
    repeat: float | None = Field(
        default=None,
        gt=0,
        description="Passes over this source per mixture epoch (instead of weights, on every source).",
    )
    where: dict[str, tuple[float | None, float | None]] = Field(
        default_factory=dict,
        description="Keep only samples whose index column lies in [low, high] (null: unbounded), per length "
        "column of the index (text_tokens, image_width, image_height, video_frames, audio_seconds, ...).",
    )


class MixturePhaseConfig(StrictModel):
    """The weights of a phase, until a number of mixed samples (the last phase: open-ended)."""

    until_samples: int | None = Field(default=None, gt=0, description="Mixed samples (all epochs) at which it ends.")
    weights: dict[str, float] = Field(description="Per source name, its share in this phase (0: paused).")


class MixtureConfig(StrictModel):
    """Named sources with weights (or repeats), and optional phases of other weights."""

    sources: dict[str, MixtureSource] = Field(min_length=1, description="Per source name (used in keys and reports).")
    phases: list[MixturePhaseConfig] = Field(
        default_factory=list, description="Weights by mixed samples delivered; none: the sources' own throughout."
    )
    epoch_samples: int | None = Field(default=None, gt=0, description="Mixed samples per mixture epoch.")
    interleave: bool = Field(
        default=True,
        description="Deal a window's micro-batches interleaved across sources by progress: every run of 1,000 "
        "micro-batches holds each source at its weight (measured within 0.3 points), at some cost to step balance "
        "at a window's end. False: in cost tiers only (steps as even as one index's; shares hold per window).",
    )
    plans: str | None = Field(
        default=None,
        description="Folder for this mixture's epochs written ahead (`omnifeed plan --config FILE --budget B "
        "--write-epochs N`), as an index keeps its own in INDEX/plans/; relative to the config file. None: a budgeted "
        "mixture is planned live, every node planning the world's windows.",
    )

    @model_validator(mode="after")
    def _shares_are_given_one_way(self) -> MixtureConfig:
        names = list(self.sources)
        if any("/" in name or not name for name in names):
            raise ValueError(f"mixture source names are keys' prefixes: no '/' and not empty, got {names}")
        repeats = [s.repeat is not None for s in self.sources.values()]
        weights = [s.weight is not None for s in self.sources.values()]
        if any(repeats) and (not all(repeats) or any(weights)):
            raise ValueError("give every mixture source a repeat, or give them weights, not both")
        if not any(repeats) and not self.phases and not all(weights):
            missing = [n for n, s in self.sources.items() if s.weight is None]
            raise ValueError(f"mixture sources {missing} have no weight: give each a weight (or a repeat)")
        if not any(repeats) and not self.phases and not sum(s.weight or 0.0 for s in self.sources.values()) > 0:
            raise ValueError("mixture weights are all 0: give some source a positive weight")
        for i, phase in enumerate(self.phases):
            unknown = sorted(set(phase.weights) - set(names))
            if unknown:
                raise ValueError(f"mixture phase {i} weighs {unknown}, not sources of the mixture ({names})")
            if not sum(phase.weights.values()) > 0 or min(phase.weights.values(), default=0) < 0:
                raise ValueError(f"mixture phase {i}: weights must be non-negative and not all 0")
            if phase.until_samples is None and i != len(self.phases) - 1:
                raise ValueError(f"mixture phase {i} has no until_samples: only the last phase is open-ended")
        ends = [p.until_samples for p in self.phases if p.until_samples is not None]
        if any(b <= a for a, b in zip(ends, ends[1:])):
            raise ValueError(f"mixture phases end in increasing order of until_samples, got {ends}")
        return self

    def plan_fingerprint_values(self) -> dict[str, object]:
        """What of this config fixes the plan besides the schedule: the sources (names, repeats, filters; not their
        paths, their data is in the index fingerprint), the epoch and the dealing. Not the weights nor the phases."""
        return {
            "sources": {
                name: {"repeat": s.repeat, "where": {k: list(v) for k, v in sorted(s.where.items())}}
                for name, s in self.sources.items()
            },
            "epoch_samples": self.epoch_samples,
            "interleave": self.interleave,
        }

    def schedule_fingerprint(self) -> str:
        """A hash of the weights and phases: a state saved under others is a mixture change (refused unless allowed)."""
        values = {
            "weights": {n: s.weight for n, s in self.sources.items()},
            "phases": [p.model_dump() for p in self.phases],
        }
        return xxhash.xxh3_64_hexdigest(json.dumps(values, sort_keys=True).encode())
