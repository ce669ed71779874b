"""What every phase of the resume benchmark shares: the seed, the limits, timing and peak memory of a resume,
the resume position, and the expected first batch on disk (the save phase writes it, the resume phase checks it)."""

from __future__ import annotations

import argparse
import json
import resource
import threading
import time
from pathlib import Path
from typing import Any

SEED = 0
ITERATE_LIMIT = 2_000  # batches a save phase iterates for real; deeper states are shifted copies of a real one
WRITE_LIMIT_S = 180.0  # the longest the MDS writer may run; the row's samples say how many it wrote
_MIB = 2**20


class Missing(Exception):
    """A loader's library does not import in this interpreter."""


class PeakRss:
    """Resident memory of this process while the block runs: before, peak, and how it was measured."""

    def __init__(self) -> None:
        self.before_mib = self.peak_mib = 0.0
        self.how = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        try:
            import psutil
        except ImportError:
            self.how = "ru_maxrss high-water mark of the process (includes anything before the resume)"
            self.before_mib = _maxrss_mib()
            return self
        process = psutil.Process()
        self.how = "psutil RSS of the resuming process, sampled every 2 ms (workers not included)"
        self.before_mib = self.peak_mib = process.memory_info().rss / _MIB
        self._thread = threading.Thread(target=self._sample, args=(process,), daemon=True)
        self._thread.start()
        return self

    def _sample(self, process: Any) -> None:
        while not self._stop.wait(0.002):
            self.peak_mib = max(self.peak_mib, process.memory_info().rss / _MIB)

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            self.peak_mib = _maxrss_mib()
            return
        self._stop.set()
        self._thread.join()
        import psutil

        self.peak_mib = max(self.peak_mib, psutil.Process().memory_info().rss / _MIB)

    def figures(self) -> dict[str, Any]:
        """The row's memory fields."""
        return {
            "peak_rss_mib": round(self.peak_mib, 1),
            "rss_before_resume_mib": round(self.before_mib, 1),
            "rss_how": self.how,
        }


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def timed_resume(resume: Any) -> tuple[Any, float, PeakRss]:
    """``resume()``'s result, its wall time in s and its memory."""
    with PeakRss() as memory:
        started = time.perf_counter()
        result = resume()
        seconds = time.perf_counter() - started
    return result, seconds, memory


def position_of(options: argparse.Namespace) -> tuple[int, int]:
    """The resume position in samples and in batches: ``fraction × samples``, whole batches."""
    batches = int(options.fraction * options.samples) // options.batch_size
    return batches * options.batch_size, batches


def write_expected(work: Path, expected: list[Any]) -> None:
    """The first batch an uninterrupted run yields after the saved position."""
    (work / "expected.json").write_text(json.dumps(expected), encoding="utf-8")


def read_expected(work: Path) -> list[Any]:
    """What ``write_expected`` wrote."""
    expected: list[Any] = json.loads((work / "expected.json").read_text(encoding="utf-8"))
    return expected
