"""What limits throughput, the last line of `omnifeed stats`: the clients' wait share, then decode, storage,
read-ahead or delivery (the rule is `render_stats`'s docstring)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._stats_format import fmt_bytes, fmt_ms, fmt_pct, remote_latency
from ._stats_interval import Interval, Snap, client_list, num, submap

WAIT_SHARE_LIMITING = 0.10
"""Clients that wait less than this share of the interval are not held back by the service."""
QUEUE_BACKED_UP = 2
"""Decode tasks queued for a modality at which its workers, not its inputs, are the limit."""


def wait_share(snapshot: Snap, previous: Snap | None) -> float | None:
    """The share of the interval the clients waited, averaged over the clients (None if unknown)."""
    iv = Interval(snapshot, previous)
    if not iv.seconds:
        return None
    clients = client_list(snapshot)
    if clients:
        waits = [w for c in clients if (w := iv.client_waited(c)) is not None]
        return min(sum(waits) / (len(waits) * iv.seconds), 1.0) if waits else None
    waited = iv.delta("consumer_wait_s")
    return None if waited is None else min(waited / iv.seconds, 1.0)


def limiting(snapshot: Snap, previous: Snap | None) -> str:
    """The last line of `render_stats`: the clients' wait share and what limits throughput (rule there)."""
    iv = Interval(snapshot, previous)
    clients = num(snapshot, "service", "clients")
    if not client_list(snapshot) and clients == 0:
        return "no clients connected"
    share = wait_share(snapshot, previous)
    if share is None:
        return "clients' wait unknown (the snapshot has no elapsed time or wait counters)"
    if share < WAIT_SHARE_LIMITING:
        return f"clients do not wait ({fmt_pct(share)} {iv.label}): the trainer is the bottleneck"
    return f"clients waited {fmt_pct(share)} {iv.label}; limiting: {_limit(iv)}"


def _limit(iv: Interval) -> str:
    modalities = {str(k): v for k, v in submap(iv.snap, "modalities").items() if isinstance(v, Mapping)}
    remote = submap(submap(iv.snap, "cache"), "remote")
    degraded = bool(iv.snap.get("storage_degraded", remote.get("degraded")))

    def queued(m: Mapping[str, Any]) -> float:
        return num(m, "queued") or 0.0

    def backlog_s(m: Mapping[str, Any]) -> float:
        return queued(m) * max(num(m, "decode_latency_s", "p50") or 0.0, 1e-6)

    backed_up = {
        name: m
        for name, m in modalities.items()
        if queued(m) >= QUEUE_BACKED_UP and (num(m, "buffer_samples") or 0.0) < queued(m)
    }
    starved = sorted(name for name, m in modalities.items() if num(m, "buffer_samples") == 0)
    reads = iv.delta("cache", "remote", "reads")
    _, storage_latency = remote_latency(remote)

    def decode_p50(name: str) -> float:
        return num(modalities[name], "decode_latency_s", "p50") or 0.0

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
            ready = num(m, "buffer_samples")
            buffer = "buffer empty" if not ready else f"buffer {ready:.0f}"
            also = "; storage degraded too" if degraded else ""
            return f"{name} decode (queue {queued(m):.0f}, {buffer}, p50 {fmt_ms(decode_p50(name))}){also}"
        return (
            f"{name} decode (buffer empty, queue {queued(m):.0f}, p50 {fmt_ms(decode_p50(name))} against "
            f"storage {fmt_ms(storage_latency or 0.0)}: give {name} more workers or processes)"
        )
    if degraded or (starved and reads):
        key, latency = remote_latency(remote)
        detail = [f"remote {key} {fmt_ms(latency)}"]
        if (bandwidth := iv.rate("cache", "remote", "bytes")) is not None:
            detail.append(f"{fmt_bytes(bandwidth)}/s")
        if degraded:
            detail.append("degraded")
        if starved:
            detail += [f"{name} buffer empty, queue {queued(modalities[name]):.0f}" for name in starved]
        return f"storage ({', '.join(detail)})"
    if starved:
        empty = ", ".join(f"{name} buffer empty, queue {queued(modalities[name]):.0f}" for name in starved)
        return f"read-ahead ({empty}, no origin reads: raise prefetch_steps or the buffer sizes)"
    return "delivery (buffers hold samples: a slow field at the head of the plan order, or the hand-off to clients)"
