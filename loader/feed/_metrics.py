"""In-process metrics of the feed: buffers, decode latency, throughput, bytes, bad samples, waiting; per mixture
source, the samples delivered, their text tokens and the samples healing replaced."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

_LATENCY_WINDOW = 2048  # decode latencies kept per modality (a sliding window)
_SOURCE_COUNTS = ("samples", "tokens", "replaced")  # per mixture source


class FeedMetrics:
    """Thread-safe counters and sliding windows behind ``Feed.metrics()``."""

    def __init__(self, sources: Sequence[str] = ()) -> None:
        """``sources``: a mixture's source names (counted per source, in the snapshot's ``sources``); none: one
        index."""
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._latency: dict[str, deque[float]] = {}
        self._decoded: dict[str, int] = {}
        self._cached: dict[str, int] = {}  # of those, served from a decoded cache entry (no decoder ran)
        self._bytes_read = 0
        self._bad: dict[str, dict[str, int]] = {}
        self._batches = 0
        self._samples = 0
        self._wait_s = 0.0
        self._source_names = list(sources)
        self._sources = {name: dict.fromkeys(_SOURCE_COUNTS, 0) for name in sources}

    def decoded(self, modality: str, seconds: float, bytes_read: int) -> None:
        """One field fetched and decoded in ``seconds``."""
        with self._lock:
            self._latency.setdefault(modality, deque(maxlen=_LATENCY_WINDOW)).append(seconds)
            self._decoded[modality] = self._decoded.get(modality, 0) + 1
            self._bytes_read += bytes_read

    def from_cache(self, modality: str) -> None:
        """One field served from a decoded cache entry (counted by `decoded` too)."""
        with self._lock:
            self._cached[modality] = self._cached.get(modality, 0) + 1

    def bad(self, modality: str, reason: str) -> None:
        """One sample that could not be read or decoded."""
        with self._lock:
            per = self._bad.setdefault(modality, {})
            per[reason] = per.get(reason, 0) + 1

    def delivered(self, samples: int, waited_s: float) -> None:
        """One batch handed to the consumer, who waited ``waited_s`` for it."""
        with self._lock:
            self._batches += 1
            self._samples += samples
            self._wait_s += waited_s

    def from_sources(self, delivered: np.ndarray, tokens: Sequence[int], replaced: np.ndarray) -> None:
        """A micro-batch of a mixture: the source (its order in the mixture) and text tokens of each delivered sample,
        the source of each planned sample healing replaced."""
        k = len(self._sources)
        if not k:  # one index: nothing per source
            return
        samples = np.bincount(delivered, minlength=k)
        counted = np.bincount(delivered, weights=np.asarray(tokens, dtype=np.float64), minlength=k)
        failed = np.bincount(replaced, minlength=k)
        with self._lock:
            for s in np.flatnonzero(samples + failed).tolist():
                counts = self._sources[self._source_names[s]]
                counts["samples"] += int(samples[s])
                counts["tokens"] += int(counted[s])
                counts["replaced"] += int(failed[s])

    def decoded_count(self, modality: str) -> int:
        """Fields of ``modality`` decoded so far."""
        with self._lock:
            return self._decoded.get(modality, 0)

    def snapshot(self, buffers: dict[str, dict[str, int]]) -> dict[str, Any]:
        """Everything, as a JSON-ready dict (``buffers`` comes from the pools)."""
        with self._lock:
            elapsed = max(time.perf_counter() - self._started, 1e-9)
            modalities = {}
            for modality in sorted(set(self._decoded) | set(buffers)):
                latency = np.asarray(self._latency.get(modality, ()), dtype=np.float64)
                p50, p90, p99 = np.quantile(latency, [0.5, 0.9, 0.99]) if latency.size else (0.0, 0.0, 0.0)
                modalities[modality] = {
                    **buffers.get(modality, {}),
                    "decoded": self._decoded.get(modality, 0),
                    "decoded_per_s": self._decoded.get(modality, 0) / elapsed,
                    "from_decoded_cache": self._cached.get(modality, 0),
                    "decode_latency_s": {"p50": float(p50), "p90": float(p90), "p99": float(p99)},
                    "bad": dict(self._bad.get(modality, {})),
                }
            snap: dict[str, Any] = {
                "elapsed_s": elapsed,
                "batches": self._batches,
                "samples": self._samples,
                "samples_per_s": self._samples / elapsed,
                "bytes_read": self._bytes_read,
                "consumer_wait_s": self._wait_s,
                "bad_samples": sum(sum(v.values()) for v in self._bad.values()),
                "modalities": modalities,
            }
            if self._sources:  # a mixture: per source, delivered samples and their text tokens, replaced samples
                snap["sources"] = {
                    name: {
                        **counts,
                        "samples_per_s": counts["samples"] / elapsed,
                        "tokens_per_s": counts["tokens"] / elapsed,
                    }
                    for name, counts in self._sources.items()
                }
            return snap
