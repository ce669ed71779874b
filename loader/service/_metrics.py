"""Prometheus metrics of the sidecar service: a collector over ``FeedService.metrics()``, and its HTTP endpoint.

Every scrape calls the snapshot function once and turns the dict into ``omnifeed_*`` metric
families (the names, types and labels are `METRICS`, documented in docs/service.md). Counters
are the snapshot's running totals; gauges are its instantaneous values and sliding-window
percentiles (a gauge with a ``quantile`` label: the window is not a Prometheus summary).

A scrape never fails on the snapshot's shape: a missing section, key or non-numeric value
only leaves its metric out. When the snapshot function raises, the scrape still answers,
with ``omnifeed_snapshot_ok 0`` and nothing else.

The snapshot function runs on the HTTP server's threads, concurrently with the service: it
must be thread-safe (``FeedService.metrics()`` takes its own locks).
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

log = logging.getLogger(__name__)

Snapshot = Callable[[], Mapping[str, Any]]
"""Returns the service's metrics snapshot (the shape of ``FeedService.metrics()``)."""


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family: its name (counters without ``_total``), type, labels and help text."""

    name: str
    kind: Literal["counter", "gauge", "info"]
    labels: tuple[str, ...]
    help: str


def _m(name: str, kind: Literal["counter", "gauge", "info"], labels: str, help: str) -> MetricSpec:
    return MetricSpec(f"omnifeed_{name}", kind, tuple(labels.split()), help)


SNAPSHOT_OK = _m("snapshot_ok", "gauge", "", "1 if this scrape read the service's snapshot, 0 if it failed")
SERVICE = _m(
    "service", "info", "protocol index_fingerprint", "wire protocol version and index fingerprint of the service"
)
UPTIME = _m("service_uptime_seconds", "gauge", "", "seconds since the service started")
CLIENTS = _m("service_clients", "gauge", "", "trainer clients connected")
STREAMS = _m("service_streams", "gauge", "", "batch streams open (one per rank)")
SEGMENTS = _m("service_segments", "gauge", "", "shared-memory batch segments held")
SEGMENT_BYTES = _m("service_segment_bytes", "gauge", "", "bytes of shared-memory batch segments held")
ELAPSED = _m(
    "feed_elapsed_seconds", "gauge", "", "seconds the feed engine has run (the base of the *_per_second gauges)"
)
BATCHES = _m("batches", "counter", "", "batches delivered to clients")
SAMPLES = _m("samples", "counter", "", "samples delivered to clients")
SAMPLES_PER_S = _m("samples_per_second", "gauge", "", "samples delivered per second, averaged since the feed started")
BYTES_READ = _m("read_bytes", "counter", "", "encoded bytes read for decoding (any tier or the origin)")
CONSUMER_WAIT = _m("consumer_wait_seconds", "counter", "", "seconds consumers waited for batches, all clients together")
BUFFER_SAMPLES = _m("buffer_samples", "gauge", "modality", "decoded samples waiting for the consumer")
BUFFER_BYTES = _m("buffer_bytes", "gauge", "modality", "bytes of decoded samples waiting for the consumer")
QUEUED = _m("queued_tasks", "gauge", "modality", "decode tasks queued for the modality's workers")
DECODED = _m("decoded", "counter", "modality", "fields fetched and decoded")
DECODED_PER_S = _m(
    "decoded_per_second", "gauge", "modality", "fields decoded per second, averaged since the feed started"
)
DECODE_LATENCY = _m(
    "decode_latency_seconds",
    "gauge",
    "modality quantile",
    "time a decode worker spent on one field (read and decode), percentile over a sliding window",
)
BAD = _m("bad_samples", "counter", "modality reason", "samples that could not be read or decoded")
CACHE_HITS = _m("cache_hits", "counter", "tier", "lookups the tier answered")
CACHE_MISSES = _m("cache_misses", "counter", "tier", "lookups the tier did not hold")
CACHE_HIT_RATIO = _m("cache_hit_ratio", "gauge", "tier", "hits / (hits + misses) since the service started")
CACHE_HIT_BYTES = _m("cache_hit_bytes", "counter", "tier", "bytes served from the tier")
CACHE_PUT_BYTES = _m("cache_put_bytes", "counter", "tier", "bytes written into the tier")
CACHE_EVICTIONS = _m("cache_evictions", "counter", "tier", "entries evicted from the tier")
CACHE_REJECTED = _m("cache_rejected", "counter", "tier", "entries the tier's admission turned away")
CACHE_ENTRIES = _m("cache_entries", "gauge", "tier", "entries held (node-wide)")
CACHE_USED = _m("cache_used_bytes", "gauge", "tier", "bytes held (node-wide)")
CACHE_CAPACITY = _m("cache_capacity_bytes", "gauge", "tier", "the tier's byte bound")
CACHE_DEGRADED = _m("cache_degraded", "gauge", "tier", "1 if the tier stopped storing (pass-through, e.g. a full disk)")
STORAGE_READS = _m("storage_reads", "counter", "", "reads from origin storage (the remote tier)")
STORAGE_BYTES = _m("storage_read_bytes", "counter", "", "bytes read from origin storage (rate() is the bandwidth)")
STORAGE_RETRIES = _m("storage_retries", "counter", "", "origin reads retried")
STORAGE_TIMEOUTS = _m("storage_timeouts", "counter", "", "origin read attempts that timed out")
STORAGE_ERRORS = _m("storage_errors", "counter", "", "origin read attempts that failed")
STORAGE_LATENCY = _m(
    "storage_latency_seconds", "gauge", "quantile", "origin read latency, percentile over a sliding window"
)
STORAGE_DEGRADED = _m(
    "storage_degraded", "gauge", "", "1 while origin storage is degraded (slow reads: reading further ahead)"
)
STORAGE_DEGRADED_CHANGES = _m("storage_degraded_changes", "counter", "", "times the degraded flag turned on or off")
READ_AHEAD = _m(
    "read_ahead", "gauge", "", "read-ahead multiplier of the decode buffers (above 1 while storage is degraded)"
)
CLIENT_WAITED = _m("client_waited_seconds", "counter", "client rank dp_rank", "seconds the client waited for batches")
CLIENT_LAST_WAIT = _m(
    "client_last_wait_seconds", "gauge", "client rank dp_rank", "the client's wait for its last batch"
)
CLIENT_BATCHES = _m("client_batches", "counter", "client rank dp_rank", "batches delivered to the client")
CLIENT_DP_WORLD = _m(
    "client_dp_world_size", "gauge", "client rank dp_rank", "the data-parallel world size the client runs in"
)
REMOTE_CONNECTED = _m("remote_connected", "gauge", "", "1 while the Ray cluster of the remote decode workers answers")
REMOTE_OUTAGES = _m(
    "remote_outages",
    "counter",
    "",
    "times the Ray cluster was found unreachable (decoding went on with local workers only)",
)
REMOTE_WORKERS = _m("remote_workers", "gauge", "modality", "remote decode workers (Ray actors) up")
REMOTE_TARGET = _m(
    "remote_workers_target",
    "gauge",
    "modality",
    "remote decode workers wanted now (grows while the modality starves, up to its cap)",
)
REMOTE_DECODED = _m("remote_decoded", "counter", "modality", "fields decoded by remote workers")
REMOTE_PER_S = _m(
    "remote_decoded_per_second",
    "gauge",
    "modality",
    "fields decoded per second by remote workers, averaged since the feed started",
)
LOCAL_PER_S = _m(
    "local_decoded_per_second",
    "gauge",
    "modality",
    "fields decoded per second by the service's own workers, averaged since the feed started",
)
REMOTE_ROUND_TRIP = _m(
    "remote_round_trip_seconds",
    "gauge",
    "modality quantile",
    "a remote decode task from sending to its result, percentile over a sliding window",
)
REMOTE_REISSUED = _m("remote_reissued", "counter", "modality", "remote tasks past their deadline, decoded locally")
REMOTE_LOST = _m("remote_lost", "counter", "modality", "remote workers lost (actor or node gone) mid-task")
REMOTE_OVERDUE = _m(
    "remote_overdue",
    "gauge",
    "modality",
    "answers of remote tasks past their deadline not come yet (their actors get no new task)",
)
REMOTE_RETURNED = _m("remote_returned_bytes", "counter", "modality", "bytes of decoded arrays remote workers sent back")
RESIZES = _m("resizes", "counter", "", "resizes (changes of the data-parallel world size) performed")
RESIZE_SECONDS = _m("resize_seconds", "counter", "", "seconds spent in resizes, all together")

METRICS: tuple[MetricSpec, ...] = tuple(v for v in list(globals().values()) if isinstance(v, MetricSpec))
"""Every family the collector can export, in exposition order."""

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


class MetricsServer:
    """The running metrics endpoint: ``port``, ``url``; ``shutdown()`` (idempotent) stops it and frees the port."""

    def __init__(self, httpd: Any, thread: threading.Thread, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.host: str = httpd.server_address[0]
        self.port: int = int(httpd.server_port)
        self._finalizer = weakref.finalize(self, MetricsServer._stop, httpd, thread)

    @property
    def url(self) -> str:
        """The scrape URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @staticmethod
    def _stop(httpd: Any, thread: threading.Thread) -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5.0)

    def shutdown(self) -> None:
        """Stop serving, close the socket and join the server thread (idempotent)."""
        self._finalizer()

    close = shutdown

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def start_metrics_server(snapshot: Snapshot, port: int, host: str = "127.0.0.1") -> tuple[MetricsServer, int]:
    """Serve ``snapshot()`` as Prometheus metrics on ``http://host:port/metrics`` from a daemon thread.

    Uses its own `CollectorRegistry` (never the global one, so several services or tests in one
    process do not clash). ``port`` 0 picks a free port. Returns the server and the bound port.
    Raises OSError when the address cannot be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(snapshot))
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    server = MetricsServer(httpd, thread, registry)
    log.info("metrics on %s", server.url)
    return server, server.port
