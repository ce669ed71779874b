"""A mixture's sample stream: which source each sample of the mixed stream comes from, and which of its samples.

Sources are interleaved by a deterministic schedule, not by random draws. Within a phase of
weights ``w`` (summing to 1), source ``s``'s ``k``-th sample has the *time* ``(k + 0.5) / w_s``;
the mixed stream is every source's samples merged by time (ties: the source listed first).
Over any ``n`` consecutive samples a source then holds ``n·w_s`` of them to within about one
sample (Sainte-Laguë's divisor order), which is what i.i.d. draws cannot promise. Phases
(``until`` a number of mixed samples) change the weights; each source goes on from the count it
had reached.

Each source walks its own epochs: its ``k``-th sample overall is sample ``k mod N_s`` of source
epoch ``k div N_s``, through a keyed permutation of its ``N_s`` samples keyed by (seed, the
source's key, that source epoch). Every sample of a source epoch is so dealt exactly once
before any repeats: a small source repeated three times per pass of the large ones runs three
source epochs, each a new permutation.

Any slice ``[start, stop)`` of the mixed stream is computed on its own, in
O(stop - start + sources): the counts before ``start`` are a closed form (the number of a
source's times below a bound), the slice a merge of the times that follow. Nothing is stored
per sample, so a cursor over the mixture is the mixed stream's offset and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..index import MixtureIndex, SampleIndex, filter_positions
from ._mixture_config import MixtureConfig
from ._permutation import KeyedPermutation
from ._stream import TAG_SAMPLES

TAG_MIXTURE = 5  # keyed permutations of a mixture's sources, apart from a single index's


@dataclass(frozen=True)
class MixturePhase:
    """Weights (one per source; normalised by the schedule) from mixed sample ``start`` on, and each source's count
    at ``start`` (``base``; None: where the phase before left it, or 0 for the first)."""

    start: int
    weights: tuple[float, ...]
    base: tuple[int, ...] | None = None


class MixtureSchedule:
    """The mixed stream over sources of ``sizes`` samples, under ``phases`` (the first starts at 0, or has a base)."""

    def __init__(self, sizes: Sequence[int], phases: Sequence[MixturePhase], seed: int, keys: Sequence[int]) -> None:
        if not phases or (phases[0].start != 0 and phases[0].base is None):
            raise ValueError("a mixture's first phase starts at mixed sample 0 (or says each source's count there)")
        if any(b.start <= a.start for a, b in zip(phases, phases[1:])):
            raise ValueError("a mixture's phases start in increasing order")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        if (self.sizes <= 0).any():
            raise ValueError("every source of a mixture needs at least one sample")
        for phase in phases:
            if len(phase.weights) != self.sizes.size or min(phase.weights) < 0 or not sum(phase.weights) > 0:
                raise ValueError(f"phase at {phase.start}: one weight per source, none negative, some positive")
        self.given = list(phases)  # as given: a saved state names a phase's weights so, never re-normalised
        self.phases = [
            MixturePhase(p.start, tuple(float(w) for w in np.asarray(p.weights) / sum(p.weights))) for p in phases
        ]
        self.seed, self.keys = seed, [int(k) for k in keys]
        self._bases: list[np.ndarray] = []  # per phase: each source's count at its start
        for i, phase in enumerate(phases):
            if phase.base is not None:
                self._bases.append(np.asarray(phase.base, dtype=np.int64))
            elif i == 0:
                self._bases.append(np.zeros(self.sizes.size, dtype=np.int64))
            else:
                before = self.phases[i - 1]
                self._bases.append(self._bases[-1] + _phase_counts(before.weights, phase.start - before.start))
        self._permutations: dict[tuple[int, int], KeyedPermutation] = {}

    def state_at(self, at: int) -> dict[str, Any]:
        """What resumes the schedule from mixed sample ``at`` under other later phases: the phase in force (its weights
        as given, how far into it ``at`` is) and each source's count there. A few numbers per source."""
        p = self._phase_of(at)
        return {
            "since": at - self.phases[p].start,
            "weights": [float(w) for w in self.given[p].weights],
            "counts": self.counts(at).tolist(),
        }

    def resumed(self, state: Mapping[str, Any], at: int, later: Sequence[MixturePhase]) -> MixtureSchedule:
        """The schedule from mixed sample ``at`` on: the phase a `state_at` entry saved, continued, then ``later``
        (phases starting after ``at``, their bases following on). Answers for samples from ``at`` on only."""
        weights = tuple(float(w) for w in state["weights"])
        since, counts = int(state["since"]), np.asarray(state["counts"], dtype=np.int64)
        if len(weights) != self.sizes.size or counts.size != self.sizes.size or since < 0:
            raise ValueError("the saved mixture position does not fit this mixture's sources")
        normalised = tuple(float(w) for w in np.asarray(weights) / sum(weights))
        base = counts - _phase_counts(normalised, since)
        phases = [MixturePhase(at - since, weights, tuple(base.tolist())), *(p for p in later if p.start > at)]
        return MixtureSchedule(self.sizes.tolist(), phases, self.seed, self.keys)

    def counts(self, at: int) -> np.ndarray:
        """Per source, how many of its samples the first ``at`` mixed samples hold (int64)."""
        p = self._phase_of(at)
        return self._bases[p] + _phase_counts(self.phases[p].weights, at - self.phases[p].start)

    def slice(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Mixed samples ``[start, stop)``: each one's source and its sample within the source (both int64)."""
        sources, ranks = [], []
        at = start
        while at < stop:
            p = self._phase_of(at)
            end = stop if p + 1 == len(self.phases) else min(stop, self.phases[p + 1].start)
            phase = self.phases[p]
            source, k = _phase_slice(phase.weights, at - phase.start, end - phase.start)
            sources.append(source)
            ranks.append(k + self._bases[p][source])
            at = end
        if not sources:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        source, k = np.concatenate(sources), np.concatenate(ranks)
        return source, self._samples(source, k)

    def _phase_of(self, at: int) -> int:
        if at < self.phases[0].start:
            raise ValueError(f"mixed sample {at} is before this schedule's first phase ({self.phases[0].start})")
        return int(np.searchsorted([p.start for p in self.phases], at, side="right")) - 1

    def _samples(self, source: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Source ``source``'s ``k``-th sample overall: its source epoch's keyed permutation at ``k mod N``."""
        out = np.empty(k.size, dtype=np.int64)
        size = self.sizes[source]
        epoch, offset = k // size, k % size
        order = np.lexsort([epoch, source])
        pair = np.stack([source[order], epoch[order]], axis=1)
        starts = np.flatnonzero(np.r_[True, np.any(pair[1:] != pair[:-1], axis=1)]) if k.size else order
        for a, b in zip(starts.tolist(), [*starts[1:].tolist(), k.size]):
            where = order[a:b]
            s, e = int(pair[a, 0]), int(pair[a, 1])
            out[where] = offset[where] if self.sizes[s] == 1 else self._permutation(s, e)(offset[where])
        return out

    def _permutation(self, source: int, epoch: int) -> KeyedPermutation:
        key = (source, epoch)
        if key not in self._permutations:
            if len(self._permutations) >= 4 * self.sizes.size:  # a slice touches one or two epochs of a source
                self._permutations.clear()
            self._permutations[key] = KeyedPermutation(
                int(self.sizes[source]), [self.seed, TAG_MIXTURE, TAG_SAMPLES, self.keys[source], epoch]
            )
        return self._permutations[key]


def _before(weights: np.ndarray, bound: float) -> np.ndarray:
    """Per source, how many of its times ``(k + 0.5) / w`` lie below ``bound`` (0 for a weight of 0)."""
    live = weights > 0
    w = np.where(live, weights, 1.0)
    n = np.maximum(np.ceil(bound * w - 0.5), 0).astype(np.int64)
    # the closed form may be one off where bound * w rounds: settle it on the times themselves
    for _ in range(2):
        n = np.where((n > 0) & ((n - 1 + 0.5) / w >= bound), n - 1, n)
        n = np.where((n + 0.5) / w < bound, n + 1, n)
    return np.where(live, n, 0)


def _bracket(weights: np.ndarray, start: int, stop: int) -> tuple[float, float]:
    """Times ``low <= high`` with at most ``start`` samples below ``low`` and at least ``stop`` below ``high``."""
    sources = int(np.count_nonzero(weights))
    low, high = float(max(0, start - sources - 1)), float(stop + sources + 1)
    while int(_before(weights, low).sum()) > start:
        low = max(0.0, low - sources - 1)
    while int(_before(weights, high).sum()) < stop:
        high += sources + 1
    return low, high


def _phase_slice(weights_: tuple[float, ...], start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Within one phase, samples ``[start, stop)``: their sources and each one's count within the phase."""
    weights = np.asarray(weights_, dtype=np.float64)
    low, high = _bracket(weights, start, stop)
    first, last = _before(weights, low), _before(weights, high)
    source = np.repeat(np.arange(weights.size, dtype=np.int64), last - first)
    k = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(first.tolist(), last.tolist())])
    times = (k + 0.5) / np.where(weights > 0, weights, 1.0)[source]
    order = np.lexsort([source, times])
    skip = start - int(first.sum())
    chosen = order[skip : skip + (stop - start)]
    return source[chosen], k[chosen]


def _phase_counts(weights_: tuple[float, ...], at: int) -> np.ndarray:
    """Within one phase, per source, how many of its samples the first ``at`` hold."""
    weights = np.asarray(weights_, dtype=np.float64)
    if at <= 0:
        return np.zeros(weights.size, dtype=np.int64)
    low, _ = _bracket(weights, at, at)
    counts = _before(weights, low)
    source, _k = _phase_slice(weights_, int(counts.sum()), at)
    return counts + np.bincount(source, minlength=weights.size).astype(np.int64)


class MixtureStream:
    """A mixture's epochs as a sample stream (`SampleStream`'s ``slice``): global positions of a `MixtureIndex`.

    Epoch ``e`` is mixed samples ``[e·L, (e+1)·L)``, ``L`` = ``num_samples`` (the mixture epoch);
    a source's sample ``r`` is global position ``offsets[source] + r``.
    """

    shuffle = "permutation"

    def __init__(
        self, schedule: MixtureSchedule, offsets: np.ndarray, epoch_samples: int, fingerprint: str = ""
    ) -> None:
        self.schedule, self.offsets, self.num_samples = schedule, np.asarray(offsets, dtype=np.int64), epoch_samples
        self.phases = list(schedule.given)  # the config's phases: what a resumed schedule goes on with
        self.fingerprint = fingerprint  # of the config's weights and phases
        self._config_schedule = schedule
        self.change_at: int | None = None  # where a mixture change takes effect, while it is ahead
        self.shard_starts = np.zeros(1, dtype=np.int64)
        self.work = 0

    @property
    def total_samples(self) -> int:
        """The sources' samples added up (the mixture index's positions)."""
        return int(self.schedule.sizes.sum())

    def state(self, epoch: int, start: int) -> dict[str, Any]:
        """The schedule's position at mixed sample ``start`` of ``epoch`` (a window's start), for the cursor's state:
        the phase in force, each source's count, and a mixture change still ahead (``until``)."""
        at = epoch * self.num_samples + start
        until = self.change_at if self.change_at is not None and self.change_at > at else None
        return {"schedule": self.fingerprint, **self.schedule.state_at(at), "until": until}

    def resume(self, state: Mapping[str, Any], epoch: int, start: int) -> None:
        """Go on from a saved `state` at ``start`` of ``epoch`` (of this schedule: `schedule` is this fingerprint):
        its phase, then the config's later ones — after a mixture change still ahead (``until``), the config's
        weights from there. A state an uninterrupted run saved changes nothing."""
        at = epoch * self.num_samples + start
        until = state.get("until")
        if until is None:
            own = self._config_schedule.state_at(at)
            same = all(state.get(k) == own[k] for k in ("since", "weights", "counts"))
            # an uninterrupted history is the config's own schedule (which answers from sample 0 on)
            self.schedule = self._config_schedule if same else self._config_schedule.resumed(state, at, self.phases)
            self.change_at = None
        else:
            self.schedule, self.change_at = self._config_schedule.resumed(state, at, self._from(int(until))), int(until)

    def _from(self, at: int) -> list[MixturePhase]:
        """The config's phases from mixed sample ``at`` on: the one in force there, starting at ``at``, and the
        later."""
        now = self.phases[int(np.searchsorted([p.start for p in self.phases], at, side="right")) - 1]
        return [MixturePhase(at, now.weights), *(p for p in self.phases if p.start > at)]

    def slice(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Global positions of mixed samples ``[start, stop)`` of ``epoch``."""
        base = epoch * self.num_samples
        source, sample = self.schedule.slice(base + start, base + stop)
        self.work += int(source.size)
        return self.offsets[source] + sample

    def interleave(self, batches: Sequence[np.ndarray], order: np.ndarray) -> np.ndarray:
        """``order`` (a window's micro-batches in dealing order, ``batches`` their positions in that order) merged
        across sources by progress, so that every run of micro-batches holds the sources in the window's shares.

        Each micro-batch counts for the source most of its samples come from; a source's micro-batches keep their
        order, and the ``k``-th sits at its source's progress (samples up to its middle over the source's samples
        in the window). A window of one source is returned as it is.
        """
        sizes = np.array([len(b) for b in batches], dtype=np.float64)
        owner = np.array(
            [int(np.bincount(np.searchsorted(self.offsets, b, side="right") - 1).argmax()) for b in batches],
            dtype=np.int64,
        )
        if np.all(owner == owner[0]):
            return order
        progress = np.empty(sizes.size, dtype=np.float64)
        for s in np.unique(owner).tolist():
            mine = np.flatnonzero(owner == s)
            done = np.cumsum(sizes[mine])
            progress[mine] = (done - sizes[mine] / 2) / done[-1]
        return np.asarray(order)[np.lexsort([owner, progress])]

    def sources(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """The source of each of mixed samples ``[start, stop)`` of ``epoch``."""
        return self.schedule.slice(epoch * self.num_samples + start, epoch * self.num_samples + stop)[0]


def source_key(name: str) -> int:
    """A source's permutation key from its name (renaming a source reshuffles it; reordering sources does not)."""
    return xxhash.xxh3_64_intdigest(name.encode("utf-8"))


def mixture_stream(config: MixtureConfig, sizes: Sequence[int], seed: int) -> MixtureStream:
    """The stream of ``config`` over sources of ``sizes`` kept samples (in ``config.sources`` order)."""
    names = list(config.sources)
    sources = list(config.sources.values())
    if sources[0].repeat is not None:
        own = [float(s.repeat or 0.0) * n for s, n in zip(sources, sizes)]
        epoch = config.epoch_samples or max(1, round(sum(own)))
    else:
        own = [float(s.weight or 0.0) for s in sources]
        epoch = config.epoch_samples or int(sum(sizes))
    phases, start = [MixturePhase(0, tuple(own))] if not config.phases else [], 0
    for phase in config.phases:  # a phase's missing sources are paused in it
        phases.append(MixturePhase(start, tuple(float(phase.weights.get(name, 0.0)) for name in names)))
        start = phase.until_samples if phase.until_samples is not None else start
    if config.phases and config.phases[-1].until_samples is not None:  # after the last end: the sources' own weights
        if not sum(own) > 0:
            raise ValueError("mixture phases end, and the sources have no weights of their own to go on with")
        phases.append(MixturePhase(start, tuple(own)))
    schedule = MixtureSchedule(sizes, phases, seed, [source_key(n) for n in names])
    offsets = np.concatenate([[0], np.cumsum(sizes)])[:-1]
    return MixtureStream(schedule, offsets, epoch, config.schedule_fingerprint())


def open_mixture(config: MixtureConfig) -> MixtureIndex:
    """The sources' indexes opened and filtered, as one `MixtureIndex` (paths as the config holds them)."""
    sources = []
    for name, source in config.sources.items():
        index = SampleIndex(source.index)
        sources.append((name, index, filter_positions(index, source.where)))
    return MixtureIndex(sources)
