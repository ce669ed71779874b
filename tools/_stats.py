"""`omnifeed stats`: a service's metrics snapshot as a compact table, ending in what limits throughput.

`render_stats` reads two snapshots of ``FeedService.metrics()`` (the current one and the one
before, if any) and reports rates over the interval between them: with no usable previous
snapshot (none, or one from before a service restart) every rate is since the start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._stats_actors import actor_table
from ._stats_format import fmt_bytes, fmt_count, fmt_duration, fmt_ms, fmt_pct, fmt_rate, fmt_table, remote_latency
from ._stats_interval import Interval, Snap, client_list, num, submap
from ._stats_limit import limiting


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
    interval = Interval(snapshot, previous)
    lines = [_header(interval), ""]
    lines += _modalities(interval) + [""]
    if submap(snapshot, "sources"):  # a mixture: one rate line per source
        lines += _sources(interval) + [""]
    if submap(snapshot, "remote"):
        lines += _remote(interval) + [""]
    lines += _cache(interval) + [""]
    if clients := client_list(snapshot):
        lines += _client_table(interval, clients) + [""]
    lines.append(limiting(snapshot, previous))
    return "\n".join(lines)


def _header(iv: Interval) -> str:
    service, snap = submap(iv.snap, "service"), iv.snap
    samples_per_s = iv.rate("samples") if iv.previous is not None else num(snap, "samples_per_s")
    parts = [
        f"omnifeed  up {fmt_duration(num(service, 'uptime_s'))}",
        f"clients {fmt_count(num(service, 'clients'))}",
        f"streams {fmt_count(num(service, 'streams'))}",
        f"segments {fmt_count(num(service, 'segments'))} ({fmt_bytes(num(service, 'segment_bytes'))})",
        f"samples/s {fmt_rate(samples_per_s)}",
        f"batches {fmt_count(num(snap, 'batches'))}",
        f"bad {fmt_count(num(snap, 'bad_samples'))}",
        f"resizes {fmt_count(num(snap, 'resizes'))} ({fmt_rate(num(snap, 'resize_seconds'))} s)",
    ]
    return "  ".join(parts)


def _modalities(iv: Interval) -> list[str]:
    rows = []
    for name, m in sorted(submap(iv.snap, "modalities").items()):
        decoded_per_s = iv.rate("modalities", name, "decoded") if iv.previous is not None else num(m, "decoded_per_s")
        bad = {str(k): v for k, v in submap(m, "bad").items() if isinstance(v, (int, float)) and v}
        reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(bad.items()))
        rows.append(
            [
                name,
                fmt_count(num(m, "buffer_samples")),
                fmt_bytes(num(m, "buffer_bytes")),
                fmt_count(num(m, "queued")),
                fmt_rate(decoded_per_s),
                fmt_ms(num(m, "decode_latency_s", "p50")),
                fmt_ms(num(m, "decode_latency_s", "p99")),
                f"{sum(bad.values()):.0f} ({reasons})" if bad else "0",
            ]
        )
    return fmt_table(["modality", "buffer", "buffer bytes", "queued", "decoded/s", "p50", "p99", "bad"], rows)


def _sources(iv: Interval) -> list[str]:
    """A mixture's sources: samples/s, text tokens/s and share of the samples over the interval; replaced, in all."""
    sources = {name: m for name, m in submap(iv.snap, "sources").items() if isinstance(m, Mapping)}
    grew = {name: iv.delta("sources", name, "samples") for name in sources}
    total = sum(n for n in grew.values() if n is not None)
    rows = []
    for name, m in sources.items():

        def rate(key: str, counter: str) -> float | None:
            return iv.rate("sources", name, counter) if iv.previous is not None else num(m, key)

        samples = grew[name]
        rows.append(
            [
                name,
                fmt_rate(rate("samples_per_s", "samples")),
                fmt_rate(rate("tokens_per_s", "tokens")),
                fmt_pct(samples / total if samples is not None and total else None),
                fmt_count(num(m, "replaced")),
            ]
        )
    return fmt_table(["source", "samples/s", "tokens/s", "share", "replaced"], rows)


def _remote(iv: Interval) -> list[str]:
    """Remote decode workers (Ray actors): per modality, actors up/wanted/cap, remote and local rates, round trip;
    then where each actor runs."""
    remote = submap(iv.snap, "remote")
    state = "connected" if remote.get("connected") else "UNREACHABLE (local workers only)"
    rows = []
    for name, m in sorted(submap(remote, "modalities").items()):

        def rate(key: str, total: str) -> float | None:
            return iv.rate("remote", "modalities", name, total) if iv.previous is not None else num(m, key)

        rows.append(
            [
                name,
                f"{fmt_count(num(m, 'workers'))}/{fmt_count(num(m, 'target'))}/{fmt_count(num(m, 'max_workers'))}",
                fmt_rate(rate("decoded_per_s", "decoded")),
                fmt_rate(rate("local_per_s", "local_decoded")),
                fmt_ms(num(m, "round_trip_s", "p50")),
                fmt_ms(num(m, "round_trip_s", "p99")),
                fmt_count(num(m, "reissued")),
                fmt_count(num(m, "lost")),
                fmt_bytes(num(m, "returned_bytes")),
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
        f"Ray cluster {remote.get('address', '?')}: {state}, outages {fmt_count(num(remote, 'outages'))}",
        *fmt_table(header, rows),
        *actor_table(remote),
    ]


def _cache(iv: Interval) -> list[str]:
    rows = []
    for tier, stats in submap(iv.snap, "cache").items():
        if tier == "remote" or not isinstance(stats, Mapping):
            continue
        hits, misses = iv.delta("cache", tier, "hits"), iv.delta("cache", tier, "misses")
        lookups = (hits or 0.0) + (misses or 0.0)
        rows.append(
            [
                tier,
                fmt_pct(hits / lookups if hits is not None and lookups else None),
                fmt_bytes(iv.delta("cache", tier, "bytes_hit")),
                f"{fmt_bytes(num(stats, 'bytes_used'))} / {fmt_bytes(num(stats, 'capacity_bytes'))}",
                "degraded" if stats.get("degraded") else "",
            ]
        )
    lines = fmt_table(["tier", "hit rate", "bytes hit", "used / capacity", ""], rows)
    remote = submap(submap(iv.snap, "cache"), "remote")
    key, latency = remote_latency(remote)
    degraded = iv.snap.get("storage_degraded", remote.get("degraded"))
    bandwidth = iv.rate("cache", "remote", "bytes")
    lines.append(
        f"storage  reads/s {fmt_rate(iv.rate('cache', 'remote', 'reads'))}  "
        f"{fmt_bytes(bandwidth)}/s  p50 {fmt_ms(num(remote, 'latency_s', 'p50'))}  {key} {fmt_ms(latency)}  "
        f"p99 {fmt_ms(num(remote, 'latency_s', 'p99'))}  "
        f"errors {fmt_count(iv.delta('cache', 'remote', 'errors'))}  "
        f"{'DEGRADED' if degraded else 'ok'}  read-ahead x{fmt_count(num(iv.snap, 'read_ahead'))}"
    )
    return lines


def _client_table(iv: Interval, clients: list[Mapping[str, Any]]) -> list[str]:
    rows = []
    for c in clients:
        waited = iv.client_waited(c)
        dp = f"{fmt_count(num(c, 'dp_rank'))}/{fmt_count(num(c, 'dp_world_size'))}"
        share = waited / iv.seconds if waited is not None and iv.seconds else None
        rows.append(
            [
                str(c.get("client", "?")),
                fmt_count(num(c, "rank")),
                dp,
                fmt_count(num(c, "batches")),
                f"{fmt_rate(num(c, 'waited_s'))} s",
                fmt_pct(share),
                fmt_ms(num(c, "last_wait_s")),
            ]
        )
    return fmt_table(
        ["client", "rank", "dp", "batches", "waited", f"wait ({'interval' if iv.previous else 'all'})", "last wait"],
        rows,
    )
