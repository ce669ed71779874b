"""Self-healing: a sample that cannot be read or decoded is replaced, counted, logged once, and budgeted.

Replacement is deterministic, so a replay of the same plan over the same data delivers the
same batch: the failed slot takes the decoded sample of the next healthy slot of the same
micro-batch (wrapping around). Batch-mates share the micro-batch's bucket — with bucketing on,
the same modality mix and similar lengths — so the batch keeps its size, structure and cost.
When every slot of a micro-batch failed, the feed falls back to ``fallback_positions``:
positions at a fixed stride from the failed one, the first with the same modalities that
decodes. In a mixture both stay within the failed sample's source (a batch-mate of the same
source, a stand-in from the source's positions), so replacements never shift the shares.

The error budget turns a broken dataset into a clear error: once at least
``min_samples`` samples were read, more than ``budget`` of them failing stops the feed,
naming the files with the most failures. Failures of the user's own code (reason ``user``: a
decoder, tokenizer or transform of theirs raised) cost a sample each the same way, but the
messages blame the function, not the dataset.

Each failure is logged once, as a warning naming the sample key, the field, the file (URL and
member), the reason and the error's message.
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


_DATASET_ADVICE = "the dataset looks broken: check its files and re-index"
_USER_ADVICE = "a function of yours fails (named above): fix it; the dataset may be fine"


@dataclass(frozen=True)
class SampleFailure:
    """Why one sample could not be delivered: its key, file (URL), modality, a short reason, the message, and the
    field and member (tar member, folder file or Parquet column) that failed."""

    key: str
    url: str
    modality: str
    reason: str
    message: str
    field: str = "?"
    member: str = "?"

    @staticmethod
    def advice_for(failure: SampleFailure | None) -> str:
        """What to do when ``failure`` leaves no stand-in: fix the user's function, or the dataset."""
        return _USER_ADVICE if failure is not None and failure.reason == "user" else _DATASET_ADVICE


def replacement_slot(slot: int, healthy: list[bool], sources: list[int] | None = None) -> int | None:
    """The next healthy slot after ``slot`` (wrapping) of the same source (``sources``: per slot; None: one source),
    or None when there is none: a replacement never shifts a mixture's shares."""
    n = len(healthy)
    for step in range(1, n + 1):
        candidate = (slot + step) % n
        if healthy[candidate] and (sources is None or sources[candidate] == sources[slot]):
            return candidate
    return None


def fallback_positions(position: int, num_samples: int, start: int = 0) -> Iterator[int]:
    """Deterministic candidates to stand in for a failed sample: positions of ``[start, start + num_samples)`` (its
    source's range in a mixture; the whole index otherwise) at a fixed stride from it."""
    for attempt in range(1, _FALLBACK_TRIES + 1):
        candidate = start + (position - start + attempt * _FALLBACK_STRIDE) % num_samples
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
        self._user = 0
        self._logged: set[str] = set()

    def record(self, samples: int, failures: list[SampleFailure]) -> None:
        """Account for one micro-batch: ``samples`` read, ``failures`` among them."""
        with self._lock:
            self.read += samples
            self.failed += len(failures)
            for failure in failures:
                if failure.reason == "user":
                    self._user += 1
                else:
                    self._files[failure.url] += 1
                if failure.key not in self._logged:
                    self._logged.add(failure.key)
                    log.warning(
                        "replaced sample %r: field %r of %s (member %r) failed (%s, %s): %s",
                        failure.key,
                        failure.field,
                        failure.url,
                        failure.member,
                        failure.modality,
                        failure.reason,
                        failure.message,
                    )
            if self.read >= self.min_samples and self.failed > self.budget * self.read:
                raise FeedError(
                    f"{self.failed} of {self.read} samples could not be read or decoded "
                    f"({self.failed / self.read:.1%}, over the error budget of {self.budget:.1%}); {self._blame()}"
                )

    def _blame(self) -> str:
        """Whose the failures are: the user's functions, the files, or both."""
        parts = []
        if self._user:
            parts.append(f"{self._user} failed in a function of yours (reason 'user', logged with its name): fix it")
        if self._files:
            worst = ", ".join(f"{url} ({count})" for url, count in self._files.most_common(_WORST_FILES))
            parts.append(
                f"files with the most failures: {worst}. Fix or remove them and re-index, or raise "
                "FeedConfig.error_budget if the data is known to be this noisy"
            )
        return "; ".join(parts)
