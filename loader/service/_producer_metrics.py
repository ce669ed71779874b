"""The feed metrics of several engines as one: the service's and its producer processes', live and closed.

With ``producers: processes`` each stream's feed counts in its own process; the service's
snapshot (`FeedService.metrics`) is theirs merged with its own engine's and with what the
producers that closed had counted (`counters_of`: their counts, not their buffers), so a
Prometheus counter never goes back when a stream closes.
"""

from __future__ import annotations

from typing import Any


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
            into[key] = _copied(value)
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


def _copied(value: Any) -> Any:
    return {k: _copied(v) for k, v in value.items()} if isinstance(value, dict) else value
