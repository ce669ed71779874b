"""How `omnifeed stats` reads ``FeedService.metrics()`` snapshots: numbers at a path, the clients, and the
interval between two snapshots (deltas and rates; totals since the start when the previous one is from
before a restart, or there is none)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Snap = Mapping[str, Any]


def num(mapping: Any, *path: str) -> float | None:
    """The number at ``path`` in nested dicts, or None (missing, or not a number)."""
    value = mapping
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return float(value) if isinstance(value, (bool, int, float)) else None


def submap(mapping: Any, key: str) -> Mapping[str, Any]:
    """The mapping under ``key``, or an empty one (missing, or not a mapping)."""
    value = mapping.get(key) if isinstance(mapping, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def client_list(snap: Snap) -> list[Mapping[str, Any]]:
    """The snapshot's per-client entries (none when it lists none)."""
    clients = snap.get("clients")
    if not isinstance(clients, Sequence) or isinstance(clients, str):
        return []
    return [c for c in clients if isinstance(c, Mapping)]


class Interval:
    """Deltas between two snapshots, or totals since the start when there is no usable previous one."""

    def __init__(self, snap: Snap, previous: Snap | None) -> None:
        self.snap = snap
        self.previous = previous if previous is not None and same_run(snap, previous) else None
        now = num(snap, "elapsed_s")
        now = num(snap, "service", "uptime_s") if now is None else now
        before = 0.0 if self.previous is None else num(self.previous, "elapsed_s")
        if self.previous is not None and before is None:
            before = num(self.previous, "service", "uptime_s")
        self.seconds = now - before if now is not None and before is not None and now > before else None
        self.label = "of the last interval" if self.previous is not None else "since the start"

    def delta(self, *path: str) -> float | None:
        """How much the counter at ``path`` grew (its value, with no previous snapshot)."""
        now = num(self.snap, *path)
        if now is None or self.previous is None:
            return now
        before = num(self.previous, *path)
        return now if before is None else max(now - before, 0.0)

    def rate(self, *path: str) -> float | None:
        """``delta(path)`` per second, or None."""
        grew = self.delta(*path)
        return None if grew is None or not self.seconds else grew / self.seconds

    def client_waited(self, client: Mapping[str, Any]) -> float | None:
        """Seconds ``client`` waited in the interval."""
        now = num(client, "waited_s")
        if now is None or self.previous is None:
            return now
        for old in client_list(self.previous):
            if old.get("client") == client.get("client") and (before := num(old, "waited_s")) is not None:
                return max(now - before, 0.0)
        return now  # a client that connected during the interval


def same_run(snap: Snap, previous: Snap) -> bool:
    """False when ``previous`` comes from before a restart of the service (counters start again)."""
    fingerprints = [submap(s, "service").get("index_fingerprint") for s in (snap, previous)]
    for path in (("service", "uptime_s"), ("elapsed_s",)):
        now, before = num(snap, *path), num(previous, *path)
        if now is not None and before is not None and now < before:
            return False
    return fingerprints[0] == fingerprints[1]
