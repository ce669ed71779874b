"""What `omnifeed chaos` injects when: the fault schedule, and the audit log as it grows.

The schedule is seeded (``numpy.random.SeedSequence([seed, ...])``): the first faults are one of
each kind in a shuffled order, so that even a short run injects every kind; after that kinds
are drawn by weight, a few seconds apart. A kind that cannot fire yet (no decode worker alive,
the job still starting) stays due while other kinds go first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

KINDS = ("service_kill", "worker_kill", "trainer_kill", "resize", "latency_spike")
"""The faults fired at random moments (storage 5xx errors are injected all along)."""
_WEIGHTS = {"service_kill": 1.0, "worker_kill": 1.5, "trainer_kill": 1.5, "resize": 1.5, "latency_spike": 1.0}


class Schedule:
    """Which fault comes next and when: one of each kind first (shuffled), then weighted draws; seeded."""

    def __init__(self, seed: int, interval_s: tuple[float, float], world_sizes: tuple[int, ...]) -> None:
        self.interval_s, self.world_sizes = interval_s, world_sizes
        self._rng = np.random.default_rng(np.random.SeedSequence([seed, 0xC4A05]))
        self._due = [KINDS[i] for i in self._rng.permutation(len(KINDS))]
        self._deferred: str | None = None
        weights = np.array([_WEIGHTS[k] for k in KINDS])
        self._p = weights / weights.sum()

    def kind(self) -> str:
        """The next kind of fault: the first still due (not the one just deferred), else a weighted draw."""
        deferred, self._deferred = self._deferred, None
        if self._due and self._due[0] != deferred:
            return self._due.pop(0)
        return KINDS[int(self._rng.choice(len(KINDS), p=self._p))]

    def defer(self, kind: str) -> None:
        """``kind`` could not fire now: it stays due, after the other due kinds, and the next draw is another."""
        if kind not in self._due:
            self._due.append(kind)
        self._due.sort(key=lambda k: k == kind)
        self._deferred = kind

    def interval(self) -> float:
        """Seconds until the next fault."""
        return float(self._rng.uniform(*self.interval_s))

    def pick(self, n: int) -> int:
        """A uniform choice among ``n`` (which rank, which worker)."""
        return int(self._rng.integers(n))

    def world_size(self, other_than: int | None = None) -> int:
        """A world size from the configured ones (not ``other_than``: a resize changes it)."""
        sizes = [w for w in self.world_sizes if w != other_than] or list(self.world_sizes)
        return sizes[self.pick(len(sizes))]

    def uniform(self, low: float, high: float) -> float:
        """A uniform draw (spike lengths, restart delays)."""
        return float(self._rng.uniform(low, high))


class AuditWatch:
    """Follows the service's audit log as it grows: deliveries so far, epochs begun, time since the last one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records = 0  # delivery records read so far (resume markers not counted)
        self.epoch = -1
        self._offset = 0
        self.changed = time.monotonic()

    def poll(self) -> list[int]:
        """Read what was appended since the last call; the epochs that began in it."""
        try:
            with open(self.path, "rb") as log:
                log.seek(self._offset)
                data = log.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        begun = []
        for line in complete.splitlines():
            record = json.loads(line)
            if "resume" in record or "returned" in record:
                continue
            self.records += 1
            self.changed = time.monotonic()
            if int(record["epoch"]) > self.epoch:
                self.epoch = int(record["epoch"])
                begun.append(self.epoch)
        return begun
