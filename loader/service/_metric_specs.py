"""The service's Prometheus metric families: name, type, labels and help of each (`METRICS`, docs/service.md).

A new metric gets its `_m(...)` line here (counters without ``_total``), its place in the
snapshot's translation (`_metrics_collector`) and its line in docs/service.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
PRODUCER_RESTARTS = _m(
    "service_producer_restarts", "gauge", "", "producer processes of the open streams lost and replaced"
)
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
SOURCE_SAMPLES = _m("source_samples", "counter", "source", "samples of the mixture source delivered to clients")
SOURCE_TOKENS = _m(
    "source_tokens", "counter", "source", "text tokens (the index's count) of the source's delivered samples"
)
SOURCE_REPLACED = _m(
    "source_replaced", "counter", "source", "planned samples of the source that failed and were replaced (healing)"
)
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
