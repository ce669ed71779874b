"""Self-healing: a sample that cannot be read or decoded is replaced, counted, logged once, and budgeted.

Replacement is deterministic, so a replay of the same plan over the same data delivers the
same batch: the failed slot takes the decoded sample of the next healthy slot of the same
micro-batch (wrapping around). Batch-mates share the micro-batch's bucket — with bucketing on,
the same modality mix and similar lengths — so the batch keeps its size, structure and cost.
When every slot of a micro-batch failed, the feed falls back to ``fallback_positions``:
positions at a fixed stride from the failed one, the first with the same modalities that
decodes.

The error budget turns a broken dataset into a clear error: once at least
``min_samples`` samples were read, more than ``budget`` of them failing stops the feed,
naming the files with the most failures.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from .._errors import OmnifeedError

log = logging.getLogger(__name__)

_FALLBACK_STRIDE = 1_000_003  # a prime: successive candidates spread over the whole index
_FALLBACK_TRIES = 16
_WORST_FILES = 5


class FeedError(OmnifeedError):
    """The feed cannot go on: the error budget is spent, or a worker failed unexpectedly."""


@dataclass(frozen=True)
class SampleFailure:
    """Why one sample could not be delivered: its key, file, modality and a short reason."""

    key: str
    url: str
    modality: str
    reason: str
    message: str


def replacement_slot(slot: int, healthy: list[bool]) -> int | None:
    """The next healthy slot after ``slot`` (wrapping), or None when no slot is healthy."""
    n = len(healthy)
    for step in range(1, n + 1):
        candidate = (slot + step) % n
        if healthy[candidate]:
            return candidate
    return None


def fallback_positions(position: int, num_samples: int) -> Iterator[int]:
    """Deterministic candidates to stand in for a failed sample when its whole micro-batch failed."""
    for attempt in range(1, _FALLBACK_TRIES + 1):
        candidate = (position + attempt * _FALLBACK_STRIDE) % num_samples
        if candidate != position:
            yield candidate


class ErrorBudget:
    """Counts samples read and failed; raises ``FeedError`` once failures exceed the budget."""

    def __init__(self, budget: float, min_samples: int) -> None:
        self.budget, self.min_samples = budget, min_samples
        self._lock = threading.Lock()
        self.read = 0
        self.failed = 0
        self._files: Counter[str] = Counter()
        self._logged: set[str] = set()

    def record(self, samples: int, failures: list[SampleFailure]) -> None:
        """Account for one micro-batch: ``samples`` read, ``failures`` among them."""
        with self._lock:
            self.read += samples
            self.failed += len(failures)
            for failure in failures:
                self._files[failure.url] += 1
                if failure.key not in self._logged:
                    self._logged.add(failure.key)
                    log.warning("replaced sample %r (%s, %s): %s", failure.key, failure.modality, failure.reason, failure.message)
            if self.read >= self.min_samples and self.failed > self.budget * self.read:
                worst = ", ".join(f"{url} ({count})" for url, count in self._files.most_common(_WORST_FILES))
                raise FeedError(
                    f"{self.failed} of {self.read} samples could not be read or decoded "
                    f"({self.failed / self.read:.1%}, over the error budget of {self.budget:.1%}); "
                    f"files with the most failures: {worst}. Fix or remove them and re-index, or raise "
                    "FeedConfig.error_budget if the data is known to be this noisy"
                )
