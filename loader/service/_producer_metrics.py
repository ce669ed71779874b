"""The feed metrics of several engines as one: the service's and its producer processes', live and closed.

With ``producers: processes`` each stream's feed counts in its own process; the service's
snapshot (`FeedService.metrics`) is theirs merged with its own engine's and with what the
producers that closed had counted (`counters_of`: their counts, not their buffers), so a
Prometheus counter never goes back when a stream closes. `ProducerMetrics` keeps a producer
among the live ones until its counts are among the closed ones': no scrape sees neither.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any, Protocol


class CountingProducer(Protocol):
    """A producer whose feed counts in a process of its own."""

    def metrics(self) -> dict[str, Any] | None:
        """Its feed's metrics now (None before its first batch)."""


class ProducerMetrics:
    """A service's producer processes' metrics: the live ones asked all at once, the closed ones' counts kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: weakref.WeakSet[CountingProducer] = weakref.WeakSet()  # one never closed is not kept alive
        self._closed: dict[str, Any] = {}

    def add(self, producer: CountingProducer) -> None:
        """Count ``producer`` in from now on."""
        with self._lock:
            self._live.add(producer)

    def retire(self, producer: CountingProducer, last: dict[str, Any] | None) -> None:
        """``producer`` closed, having counted ``last``: its counts move to the closed ones' in one step."""
        with self._lock:
            self._live.discard(producer)
            if last is not None:
                self._closed = merged_metrics([self._closed, counters_of(last)])

    def merged_with(self, engine: dict[str, Any]) -> dict[str, Any]:
        """``engine``'s snapshot with every producer's counts summed in (a producer that does not answer costs one
        wait for all of them, not one each)."""
        with self._lock:
            live = list(self._live)
        answers: dict[CountingProducer, dict[str, Any] | None] = {}

        def ask(producer: CountingProducer) -> None:
            answers[producer] = producer.metrics()

        asking = [threading.Thread(target=ask, args=(p,), name="omnifeed-metrics-ask", daemon=True) for p in live[1:]]
        for thread in asking:
            thread.start()
        if live:
            ask(live[0])
        for thread in asking:
            thread.join()
        with self._lock:  # one that closed meanwhile is in the closed ones' counts, with at least what it answered
            children = [m for p, m in answers.items() if m is not None and p in self._live]
            closed = self._closed
        parts = [engine, *children, *([closed] if closed else [])]
        return merged_metrics(parts) if len(parts) > 1 else engine


def merged_metrics(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Feed metrics of several engines as one: counts summed and each ``X_per_s`` made again from the summed ``X``
    over the longest ``elapsed_s``; latency percentiles, ``read_ahead`` and a cache tier's occupancy (the node's,
    which each engine reads alike) the largest; a flag set if any is."""
    merged: dict[str, Any] = {}
    for snapshot in snapshots:
        _merge_into(merged, snapshot)
    elapsed = merged.get("elapsed_s")
    if isinstance(elapsed, (int, float)) and elapsed > 0:
        _rates_from_counts(merged, float(elapsed))
    return merged


def counters_of(snapshot: dict[str, Any]) -> dict[str, Any]:
    """``snapshot`` without what a stopped engine no longer holds (its buffers and queues): what it counted."""
    return {
        key: counters_of(value) if isinstance(value, dict) else value
        for key, value in snapshot.items()
        if key not in _HELD
    }


_LARGEST = frozenset(
    {"elapsed_s", "p50", "p90", "p95", "p99", "read_ahead", "entries", "bytes_used", "capacity_bytes", "resets"}
)
_HELD = frozenset({"buffer_samples", "buffer_bytes", "queued"})


def _merge_into(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        mine = into.get(key)
        if key not in into:
            into[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(mine, dict):
            _merge_into(mine, value)
        elif isinstance(value, bool) or isinstance(mine, bool):
            into[key] = bool(mine) or bool(value)
        elif isinstance(value, (int, float)) and isinstance(mine, (int, float)):
            into[key] = max(mine, value) if key in _LARGEST else mine + value


def _rates_from_counts(node: dict[str, Any], elapsed: float) -> None:
    for key, value in node.items():
        if isinstance(value, dict):
            _rates_from_counts(value, elapsed)
        elif key.endswith("_per_s") and isinstance(node.get(key[: -len("_per_s")]), (int, float)):
            node[key] = node[key[: -len("_per_s")]] / elapsed
