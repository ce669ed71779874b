"""`ServiceCollector`: one scrape turns the service's metrics snapshot into ``omnifeed_*`` metric families.

Every scrape calls the snapshot function once and turns the dict into the families of
`METRICS` (`_metric_specs`). Counters are the snapshot's running totals; gauges are its
instantaneous values and sliding-window percentiles (a gauge with a ``quantile`` label: the
window is not a Prometheus summary).

A scrape never fails on the snapshot's shape: a missing section, key or non-numeric value
only leaves its metric out. When the snapshot function raises, the scrape still answers,
with ``omnifeed_snapshot_ok 0`` and nothing else.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from ._metric_specs import (
    BAD,
    BATCHES,
    BUFFER_BYTES,
    BUFFER_SAMPLES,
    BYTES_READ,
    CACHE_CAPACITY,
    CACHE_DEGRADED,
    CACHE_ENTRIES,
    CACHE_EVICTIONS,
    CACHE_HIT_BYTES,
    CACHE_HIT_RATIO,
    CACHE_HITS,
    CACHE_MISSES,
    CACHE_PUT_BYTES,
    CACHE_REJECTED,
    CACHE_USED,
    CLIENT_BATCHES,
    CLIENT_DP_WORLD,
    CLIENT_LAST_WAIT,
    CLIENT_WAITED,
    CLIENTS,
    CONSUMER_WAIT,
    DECODE_LATENCY,
    DECODED,
    DECODED_PER_S,
    ELAPSED,
    LOCAL_PER_S,
    METRICS,
    PRODUCER_RESTARTS,
    QUEUED,
    READ_AHEAD,
    REMOTE_CONNECTED,
    REMOTE_DECODED,
    REMOTE_LOST,
    REMOTE_OUTAGES,
    REMOTE_OVERDUE,
    REMOTE_PER_S,
    REMOTE_REISSUED,
    REMOTE_RETURNED,
    REMOTE_ROUND_TRIP,
    REMOTE_TARGET,
    REMOTE_WORKERS,
    RESIZE_SECONDS,
    RESIZES,
    SAMPLES,
    SAMPLES_PER_S,
    SEGMENT_BYTES,
    SEGMENTS,
    SERVICE,
    SNAPSHOT_OK,
    SOURCE_REPLACED,
    SOURCE_SAMPLES,
    SOURCE_TOKENS,
    STORAGE_BYTES,
    STORAGE_DEGRADED,
    STORAGE_DEGRADED_CHANGES,
    STORAGE_ERRORS,
    STORAGE_LATENCY,
    STORAGE_READS,
    STORAGE_RETRIES,
    STORAGE_TIMEOUTS,
    STREAMS,
    UPTIME,
    MetricSpec,
)

log = logging.getLogger(__name__)

Snapshot = Callable[[], Mapping[str, Any]]
"""Returns the service's metrics snapshot (the shape of ``FeedService.metrics()``)."""

_TIER_COUNTERS = (
    (CACHE_HITS, "hits"),
    (CACHE_MISSES, "misses"),
    (CACHE_HIT_BYTES, "bytes_hit"),
    (CACHE_PUT_BYTES, "bytes_put"),
    (CACHE_EVICTIONS, "evicted"),
    (CACHE_REJECTED, "rejected"),
    (CACHE_ENTRIES, "entries"),
    (CACHE_USED, "bytes_used"),
    (CACHE_CAPACITY, "capacity_bytes"),
)
_STORAGE_COUNTERS = (
    (STORAGE_READS, "reads"),
    (STORAGE_BYTES, "bytes"),
    (STORAGE_RETRIES, "retries"),
    (STORAGE_TIMEOUTS, "timeouts"),
    (STORAGE_ERRORS, "errors"),
    (STORAGE_DEGRADED_CHANGES, "degraded_changes"),
)


def number(value: Any) -> float | None:
    """``value`` as a float if it is a number (a bool counts as 0/1), else None."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


def quantile_label(key: str) -> str | None:
    """The quantile of a percentile key (``p50`` → ``0.5``, ``p99`` → ``0.99``, ``p999`` → ``0.999``), or None."""
    match = re.fullmatch(r"p(\d{1,2})|p(\d{3,})", key)
    if match is None:
        return None
    q = int(match[1]) / 100 if match[1] else float(f"0.{match[2]}")
    return f"{q:g}"


def _section(mapping: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = mapping.get(key)
    return value if isinstance(value, Mapping) else {}


class _Families:
    """Metric families filled from a snapshot; a value that is not a number is left out."""

    def __init__(self) -> None:
        self._families: dict[str, CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily] = {}
        self._seen: set[tuple[str, tuple[str, ...]]] = set()

    def add(self, spec: MetricSpec, value: Any, *labels: Any) -> None:
        value = number(value)
        key = (spec.name, tuple(str(label) for label in labels))
        if value is None or key in self._seen:  # a duplicate series would make Prometheus reject the scrape
            return
        assert len(labels) == len(spec.labels), spec.name
        self._seen.add(key)
        family = self._families.get(spec.name)
        if family is None:
            cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            family = self._families[spec.name] = cls(spec.name, spec.help, labels=spec.labels)
        assert not isinstance(family, InfoMetricFamily), spec.name
        family.add_metric(key[1], value)

    def info(self, spec: MetricSpec, values: Mapping[str, Any]) -> None:
        present = {k: str(values[k]) for k in spec.labels if values.get(k) is not None}
        if present:
            family = InfoMetricFamily(spec.name, spec.help, labels=())
            family.add_metric((), present)
            self._families[spec.name] = family

    def __iter__(self) -> Iterator[Metric]:
        order = {spec.name: i for i, spec in enumerate(METRICS)}
        return iter(sorted(self._families.values(), key=lambda f: order.get(f.name, len(order))))


class ServiceCollector:
    """A prometheus_client collector: each ``collect()`` (one per scrape) calls ``snapshot()`` once."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        """Nothing: registering the collector must not call the snapshot."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The snapshot as ``omnifeed_*`` families; ``omnifeed_snapshot_ok 0`` alone if the snapshot failed."""
        families = _Families()
        try:
            snap = self._snapshot()
            if not isinstance(snap, Mapping):
                raise TypeError(f"the metrics snapshot is a {type(snap).__name__}, not a dict")
            _fill(families, snap)
        except Exception:  # noqa: BLE001  a scrape answers even when the service cannot
            log.warning("metrics snapshot failed; this scrape reports omnifeed_snapshot_ok 0", exc_info=True)
            families = _Families()
            families.add(SNAPSHOT_OK, 0)
        else:
            families.add(SNAPSHOT_OK, 1)
        yield from families


def _fill(families: _Families, snap: Mapping[str, Any]) -> None:
    service = _section(snap, "service")
    families.info(SERVICE, service)
    for spec, key in (
        (UPTIME, "uptime_s"),
        (CLIENTS, "clients"),
        (STREAMS, "streams"),
        (SEGMENTS, "segments"),
        (SEGMENT_BYTES, "segment_bytes"),
        (PRODUCER_RESTARTS, "producer_restarts"),
    ):
        families.add(spec, service.get(key))
    for spec, key in (
        (ELAPSED, "elapsed_s"),
        (BATCHES, "batches"),
        (SAMPLES, "samples"),
        (SAMPLES_PER_S, "samples_per_s"),
        (BYTES_READ, "bytes_read"),
        (CONSUMER_WAIT, "consumer_wait_s"),
        (READ_AHEAD, "read_ahead"),
        (RESIZES, "resizes"),
        (RESIZE_SECONDS, "resize_seconds"),
    ):
        families.add(spec, snap.get(key))
    for modality, stats in _section(snap, "modalities").items():
        if not isinstance(stats, Mapping):
            continue
        for spec, key in (
            (BUFFER_SAMPLES, "buffer_samples"),
            (BUFFER_BYTES, "buffer_bytes"),
            (QUEUED, "queued"),
            (DECODED, "decoded"),
            (DECODED_PER_S, "decoded_per_s"),
        ):
            families.add(spec, stats.get(key), modality)
        for key, value in _section(stats, "decode_latency_s").items():
            if (q := quantile_label(key)) is not None:
                families.add(DECODE_LATENCY, value, modality, q)
        for reason, count in _section(stats, "bad").items():
            families.add(BAD, count, modality, reason)
    for source, stats in _section(snap, "sources").items():  # a mixture's sources (none for one index)
        if isinstance(stats, Mapping):
            for spec, key in ((SOURCE_SAMPLES, "samples"), (SOURCE_TOKENS, "tokens"), (SOURCE_REPLACED, "replaced")):
                families.add(spec, stats.get(key), source)
    cache = _section(snap, "cache")
    for tier, stats in cache.items():
        if tier != "remote" and isinstance(stats, Mapping):
            _tier(families, str(tier), stats)
    remote = _section(cache, "remote")
    for spec, key in _STORAGE_COUNTERS:
        families.add(spec, remote.get(key))
    for key, value in _section(remote, "latency_s").items():
        if (q := quantile_label(key)) is not None:
            families.add(STORAGE_LATENCY, value, q)
    degraded = snap.get("storage_degraded", remote.get("degraded"))
    families.add(STORAGE_DEGRADED, degraded)
    _remote(families, _section(snap, "remote"))
    clients = snap.get("clients")
    for client in clients if isinstance(clients, Sequence) and not isinstance(clients, str) else ():
        if isinstance(client, Mapping):
            labels = [client.get(k, "") for k in ("client", "rank", "dp_rank")]
            for spec, key in (
                (CLIENT_WAITED, "waited_s"),
                (CLIENT_LAST_WAIT, "last_wait_s"),
                (CLIENT_BATCHES, "batches"),
                (CLIENT_DP_WORLD, "dp_world_size"),
            ):
                families.add(spec, client.get(key), *labels)


def _remote(families: _Families, remote: Mapping[str, Any]) -> None:
    if not remote:
        return
    families.add(REMOTE_CONNECTED, remote.get("connected"))
    families.add(REMOTE_OUTAGES, remote.get("outages"))
    for modality, stats in _section(remote, "modalities").items():
        if not isinstance(stats, Mapping):
            continue
        for spec, key in (
            (REMOTE_WORKERS, "workers"),
            (REMOTE_TARGET, "target"),
            (REMOTE_DECODED, "decoded"),
            (REMOTE_PER_S, "decoded_per_s"),
            (LOCAL_PER_S, "local_per_s"),
            (REMOTE_REISSUED, "reissued"),
            (REMOTE_LOST, "lost"),
            (REMOTE_OVERDUE, "overdue"),
            (REMOTE_RETURNED, "returned_bytes"),
        ):
            families.add(spec, stats.get(key), modality)
        for key, value in _section(stats, "round_trip_s").items():
            if (q := quantile_label(key)) is not None:
                families.add(REMOTE_ROUND_TRIP, value, modality, q)


def _tier(families: _Families, tier: str, stats: Mapping[str, Any]) -> None:
    for spec, key in _TIER_COUNTERS:
        families.add(spec, stats.get(key), tier)
    hits, misses = number(stats.get("hits")), number(stats.get("misses"))
    if hits is not None and misses is not None and hits + misses > 0:
        families.add(CACHE_HIT_RATIO, hits / (hits + misses), tier)
    if "degraded" in stats:  # the NVMe tier's reason string, or None
        families.add(CACHE_DEGRADED, bool(stats["degraded"]), tier)
