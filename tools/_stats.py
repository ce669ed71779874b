"""`omnifeed stats`: a service's metrics snapshot as a compact table, ending in what limits throughput.

`render_stats` reads two snapshots of ``FeedService.metrics()`` (the current one and the one
before, if any) and reports rates over the interval between them: with no usable previous
snapshot (none, or one from before a service restart) every rate is since the start.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

WAIT_SHARE_LIMITING = 0.10
"""Clients that wait less than this share of the interval are not held back by the service."""
QUEUE_BACKED_UP = 2
"""Decode tasks queued for a modality at which its workers, not its inputs, are the limit."""

Snap = Mapping[str, Any]


def _num(mapping: Any, *path: str) -> float | None:
    """The number at ``path`` in nested dicts, or None (missing, or not a number)."""
    value = mapping
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return float(value) if isinstance(value, (bool, int, float)) else None


def _dict(mapping: Any, key: str) -> Mapping[str, Any]:
    value = mapping.get(key) if isinstance(mapping, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _clients(snap: Snap) -> list[Mapping[str, Any]]:
    clients = snap.get("clients")
    if not isinstance(clients, Sequence) or isinstance(clients, str):
        return []
    return [c for c in clients if isinstance(c, Mapping)]


class _Interval:
    """Deltas between two snapshots, or totals since the start when there is no usable previous one."""

    def __init__(self, snap: Snap, previous: Snap | None) -> None:
        self.snap = snap
        self.previous = previous if previous is not None and _same_run(snap, previous) else None
        now = _num(snap, "elapsed_s")
        now = _num(snap, "service", "uptime_s") if now is None else now
        before = 0.0 if self.previous is None else _num(self.previous, "elapsed_s")
        if self.previous is not None and before is None:
            before = _num(self.previous, "service", "uptime_s")
        self.seconds = now - before if now is not None and before is not None and now > before else None
        self.label = "of the last interval" if self.previous is not None else "since the start"

    def delta(self, *path: str) -> float | None:
        """How much the counter at ``path`` grew (its value, with no previous snapshot)."""
        now = _num(self.snap, *path)
        if now is None or self.previous is None:
            return now
        before = _num(self.previous, *path)
        return now if before is None else max(now - before, 0.0)

    def rate(self, *path: str) -> float | None:
        """``delta(path)`` per second, or None."""
        grew = self.delta(*path)
        return None if grew is None or not self.seconds else grew / self.seconds

    def client_waited(self, client: Mapping[str, Any]) -> float | None:
        """Seconds ``client`` waited in the interval."""
        now = _num(client, "waited_s")
        if now is None or self.previous is None:
            return now
        for old in _clients(self.previous):
            if old.get("client") == client.get("client") and (before := _num(old, "waited_s")) is not None:
                return max(now - before, 0.0)
        return now  # a client that connected during the interval


def _same_run(snap: Snap, previous: Snap) -> bool:
    """False when ``previous`` comes from before a restart of the service (counters start again)."""
    fingerprints = [_dict(s, "service").get("index_fingerprint") for s in (snap, previous)]
    for path in (("service", "uptime_s"), ("elapsed_s",)):
        now, before = _num(snap, *path), _num(previous, *path)
        if now is not None and before is not None and now < before:
            return False
    return fingerprints[0] == fingerprints[1]


# -- formatting --------------------------------------------------------------------------------


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _storage_latency(remote: Mapping[str, Any]) -> tuple[str, float | None]:
    """The highest percentile below p99 the remote tier reports (p95, else p90, else p50)."""
    for key in ("p95", "p90", "p50"):
        if (value := _num(remote, "latency_s", key)) is not None:
            return key, value
    return "p50", None


# -- the table ---------------------------------------------------------------------------------


def render_stats(snapshot: Snap, previous: Snap | None) -> str:
    """The snapshot as a table (rates over the interval since ``previous``), and a last line naming the limit.

    The last line (`limiting`) follows this rule, over the interval since ``previous`` (since the
    start without one):

    1. The clients' wait share: the seconds each client waited in the interval (``waited_s``
       deltas) over the interval's length, averaged over the clients (``consumer_wait_s`` when
       the snapshot lists none). No clients: "no clients connected". Below 10 %
       (`WAIT_SHARE_LIMITING`): "clients do not wait: the trainer is the bottleneck".
    2. Otherwise the first of these that holds names the limit:

       a. **decode**: a modality has at least 2 (`QUEUE_BACKED_UP`) tasks queued and fewer
          samples ready than queued. Queued tasks already hold their bytes, so its decode
          workers are what is short. Of several, the largest backlog (queued x p50 decode latency).
       b. **storage**: origin storage is flagged degraded, or a modality's buffer is empty with
          (almost) nothing queued while the remote tier read during the interval: the workers
          are idle, waiting for bytes.
       c. **read-ahead**: a buffer is empty, nothing is queued and nothing came from the
          remote tier: too little is admitted ahead (``prefetch_steps``, the buffer sizes).
       d. **delivery**: every buffer holds samples, yet clients wait: a slow field at the
          head of the plan order, or the hand-off of batches to the clients.

    Buffers and queues are the current snapshot's (instantaneous); everything else is a delta.
    """
    interval = _Interval(snapshot, previous)
    lines = [_header(interval), ""]
    lines += _modalities(interval) + [""]
    if _dict(snapshot, "remote"):
        lines += _remote(interval) + [""]
    lines += _cache(interval) + [""]
    if clients := _clients(snapshot):
        lines += _client_table(interval, clients) + [""]
    lines.append(limiting(snapshot, previous))
    return "\n".join(lines)


def _header(iv: _Interval) -> str:
    service, snap = _dict(iv.snap, "service"), iv.snap
    samples_per_s = iv.rate("samples") if iv.previous is not None else _num(snap, "samples_per_s")
    parts = [
        f"omnifeed  up {_duration(_num(service, 'uptime_s'))}",
        f"clients {_count(_num(service, 'clients'))}",
        f"streams {_count(_num(service, 'streams'))}",
        f"segments {_count(_num(service, 'segments'))} ({_bytes(_num(service, 'segment_bytes'))})",
        f"samples/s {_rate(samples_per_s)}",
        f"batches {_count(_num(snap, 'batches'))}",
        f"bad {_count(_num(snap, 'bad_samples'))}",
        f"resizes {_count(_num(snap, 'resizes'))} ({_rate(_num(snap, 'resize_seconds'))} s)",
    ]
    return "  ".join(parts)


def _modalities(iv: _Interval) -> list[str]:
    rows = []
    for name, m in sorted(_dict(iv.snap, "modalities").items()):
        decoded_per_s = iv.rate("modalities", name, "decoded") if iv.previous is not None else _num(m, "decoded_per_s")
        bad = {str(k): v for k, v in _dict(m, "bad").items() if isinstance(v, (int, float)) and v}
        reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(bad.items()))
        rows.append(
            [
                name,
                _count(_num(m, "buffer_samples")),
                _bytes(_num(m, "buffer_bytes")),
                _count(_num(m, "queued")),
                _rate(decoded_per_s),
                _ms(_num(m, "decode_latency_s", "p50")),
                _ms(_num(m, "decode_latency_s", "p99")),
                f"{sum(bad.values()):.0f} ({reasons})" if bad else "0",
            ]
        )
    return _table(["modality", "buffer", "buffer bytes", "queued", "decoded/s", "p50", "p99", "bad"], rows)


def _remote(iv: _Interval) -> list[str]:
    """Remote decode workers (Ray actors): per modality, actors up/wanted/cap, remote and local rates, round trip."""
    remote = _dict(iv.snap, "remote")
    state = "connected" if remote.get("connected") else "UNREACHABLE (local workers only)"
    rows = []
    for name, m in sorted(_dict(remote, "modalities").items()):

        def rate(key: str, total: str) -> float | None:
            return iv.rate("remote", "modalities", name, total) if iv.previous is not None else _num(m, key)

        rows.append(
            [
                name,
                f"{_count(_num(m, 'workers'))}/{_count(_num(m, 'target'))}/{_count(_num(m, 'max_workers'))}",
                _rate(rate("decoded_per_s", "decoded")),
                _rate(rate("local_per_s", "local_decoded")),
                _ms(_num(m, "round_trip_s", "p50")),
                _ms(_num(m, "round_trip_s", "p99")),
                _count(_num(m, "reissued")),
                _count(_num(m, "lost")),
                _bytes(_num(m, "returned_bytes")),
            ]
        )
    header = [
        "remote",
        "actors up/wanted/cap",
        "remote/s",
        "local/s",
        "trip p50",
        "trip p99",
        "reissued",
        "lost",
        "returned",
    ]
    return [
        f"Ray cluster {remote.get('address', '?')}: {state}, outages {_count(_num(remote, 'outages'))}",
        *_table(header, rows),
    ]


def _cache(iv: _Interval) -> list[str]:
    rows = []
    for tier, stats in _dict(iv.snap, "cache").items():
        if tier == "remote" or not isinstance(stats, Mapping):
            continue
        hits, misses = iv.delta("cache", tier, "hits"), iv.delta("cache", tier, "misses")
        lookups = (hits or 0.0) + (misses or 0.0)
        rows.append(
            [
                tier,
                _pct(hits / lookups if hits is not None and lookups else None),
                _bytes(iv.delta("cache", tier, "bytes_hit")),
                f"{_bytes(_num(stats, 'bytes_used'))} / {_bytes(_num(stats, 'capacity_bytes'))}",
                "degraded" if stats.get("degraded") else "",
            ]
        )
    lines = _table(["tier", "hit rate", "bytes hit", "used / capacity", ""], rows)
    remote = _dict(_dict(iv.snap, "cache"), "remote")
    key, latency = _storage_latency(remote)
    degraded = iv.snap.get("storage_degraded", remote.get("degraded"))
    bandwidth = iv.rate("cache", "remote", "bytes")
    lines.append(
        f"storage  reads/s {_rate(iv.rate('cache', 'remote', 'reads'))}  "
        f"{_bytes(bandwidth)}/s  p50 {_ms(_num(remote, 'latency_s', 'p50'))}  {key} {_ms(latency)}  "
        f"p99 {_ms(_num(remote, 'latency_s', 'p99'))}  "
        f"errors {_count(iv.delta('cache', 'remote', 'errors'))}  "
        f"{'DEGRADED' if degraded else 'ok'}  read-ahead x{_count(_num(iv.snap, 'read_ahead'))}"
    )
    return lines


def _client_table(iv: _Interval, clients: list[Mapping[str, Any]]) -> list[str]:
    rows = []
    for c in clients:
        waited = iv.client_waited(c)
        dp = f"{_count(_num(c, 'dp_rank'))}/{_count(_num(c, 'dp_world_size'))}"
        share = waited / iv.seconds if waited is not None and iv.seconds else None
        rows.append(
            [
                str(c.get("client", "?")),
                _count(_num(c, "rank")),
                dp,
                _count(_num(c, "batches")),
                f"{_rate(_num(c, 'waited_s'))} s",
                _pct(share),
                _ms(_num(c, "last_wait_s")),
            ]
        )
    return _table(
        ["client", "rank", "dp", "batches", "waited", f"wait ({'interval' if iv.previous else 'all'})", "last wait"],
        rows,
    )


# -- the verdict -------------------------------------------------------------------------------


def wait_share(snapshot: Snap, previous: Snap | None) -> float | None:
    """The share of the interval the clients waited, averaged over the clients (None if unknown)."""
    iv = _Interval(snapshot, previous)
    if not iv.seconds:
        return None
    clients = _clients(snapshot)
    if clients:
        waits = [w for c in clients if (w := iv.client_waited(c)) is not None]
        return min(sum(waits) / (len(waits) * iv.seconds), 1.0) if waits else None
    waited = iv.delta("consumer_wait_s")
    return None if waited is None else min(waited / iv.seconds, 1.0)


def limiting(snapshot: Snap, previous: Snap | None) -> str:
    """The last line of `render_stats`: the clients' wait share and what limits throughput (rule there)."""
    iv = _Interval(snapshot, previous)
    clients = _num(snapshot, "service", "clients")
    if not _clients(snapshot) and clients == 0:
        return "no clients connected"
    share = wait_share(snapshot, previous)
    if share is None:
        return "clients' wait unknown (the snapshot has no elapsed time or wait counters)"
    if share < WAIT_SHARE_LIMITING:
        return f"clients do not wait ({_pct(share)} {iv.label}): the trainer is the bottleneck"
    return f"clients waited {_pct(share)} {iv.label}; limiting: {_limit(iv)}"


def _limit(iv: _Interval) -> str:
    modalities = {str(k): v for k, v in _dict(iv.snap, "modalities").items() if isinstance(v, Mapping)}
    remote = _dict(_dict(iv.snap, "cache"), "remote")
    degraded = bool(iv.snap.get("storage_degraded", remote.get("degraded")))

    def queued(m: Mapping[str, Any]) -> float:
        return _num(m, "queued") or 0.0

    def backlog_s(m: Mapping[str, Any]) -> float:
        return queued(m) * max(_num(m, "decode_latency_s", "p50") or 0.0, 1e-6)

    backed_up = {
        name: m
        for name, m in modalities.items()
        if queued(m) >= QUEUE_BACKED_UP and (_num(m, "buffer_samples") or 0.0) < queued(m)
    }
    starved = sorted(name for name, m in modalities.items() if _num(m, "buffer_samples") == 0)
    reads = iv.delta("cache", "remote", "reads")
    _, storage_latency = _storage_latency(remote)

    def decode_p50(name: str) -> float:
        return _num(modalities[name], "decode_latency_s", "p50") or 0.0

    # A starved modality whose reads are fast next to its decoding is decode-bound too: its workers are all
    # busy (local files are read inside the decode task, so nothing shows as queued).
    busy = {
        name: modalities[name]
        for name in starved
        if reads and not degraded and decode_p50(name) > (storage_latency or 0.0)
    }
    candidates = {**busy, **backed_up}
    if candidates:  # the one with the most decoding pending: (queued + the one in hand) × its decode time
        name = max(candidates, key=lambda n: (queued(candidates[n]) + 1) * max(decode_p50(n), 1e-6))
        m = candidates[name]
        if name in backed_up:
            ready = _num(m, "buffer_samples")
            buffer = "buffer empty" if not ready else f"buffer {ready:.0f}"
            also = "; storage degraded too" if degraded else ""
            return f"{name} decode (queue {queued(m):.0f}, {buffer}, p50 {_ms(decode_p50(name))}){also}"
        return (
            f"{name} decode (buffer empty, queue {queued(m):.0f}, p50 {_ms(decode_p50(name))} against "
            f"storage {_ms(storage_latency or 0.0)}: give {name} more workers or processes)"
        )
    if degraded or (starved and reads):
        key, latency = _storage_latency(remote)
        detail = [f"remote {key} {_ms(latency)}"]
        if (bandwidth := iv.rate("cache", "remote", "bytes")) is not None:
            detail.append(f"{_bytes(bandwidth)}/s")
        if degraded:
            detail.append("degraded")
        if starved:
            detail += [f"{name} buffer empty, queue {queued(modalities[name]):.0f}" for name in starved]
        return f"storage ({', '.join(detail)})"
    if starved:
        empty = ", ".join(f"{name} buffer empty, queue {queued(modalities[name]):.0f}" for name in starved)
        return f"read-ahead ({empty}, no origin reads: raise prefetch_steps or the buffer sizes)"
    return "delivery (buffers hold samples: a slow field at the head of the plan order, or the hand-off to clients)"
