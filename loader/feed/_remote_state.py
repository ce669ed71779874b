"""The remote decoders' bookkeeping: one Ray actor as the controller sees it, a modality's actors and counters, and
the remote slot a pool thread passes down with its task."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ._remote_config import RemoteConfig

_LATENCY_WINDOW = 2048  # round trips kept for the latency percentiles
_RETIRED_KEPT = 16  # actors gone (lost, retired) still listed in the snapshot, per modality


@dataclass
class RemoteActor:
    """One decode actor as the controller sees it: its handle, readiness, load, and answers past the deadline."""

    handle: Any
    ready: Any  # the ref of its ready() call
    usable: bool = False
    lost: bool = False
    busy: int = 0
    where: str = ""  # host:pid, once started
    node: str = ""  # the Ray node id it runs on, once started
    ip: str = ""
    pid: int = 0
    decoded: int = 0  # fields it decoded (answers used)
    overdue: list[Any] = field(default_factory=list)  # refs of answers past the deadline, dropped when they come
    overdue_since: float = 0.0

    def describe(self, state: str) -> dict[str, Any]:
        """Its line in the snapshot: node, ip, pid, state (up, overdue, lost, retired), decoded, lost (0 or 1)."""
        return {
            "node": self.node,
            "ip": self.ip,
            "pid": self.pid,
            "state": "lost" if self.lost else state,
            "decoded": self.decoded,
            "lost": int(self.lost),
        }


@dataclass
class RemoteModality:
    """A modality's remote actors, how many are wanted now, and its counters."""

    config: RemoteConfig
    actors: list[RemoteActor | None]
    target: int  # actors wanted now (elastic between workers and cap)
    starved_since: float | None = None
    idle_since: float | None = None
    decoded: int = 0
    reissued: int = 0
    lost: int = 0
    failed: int = 0
    returned_bytes: int = 0
    actor_read_bytes: int = 0
    resized: int = 0
    round_trip: deque[float] = field(default_factory=lambda: deque(maxlen=_LATENCY_WINDOW))
    retired: deque[RemoteActor] = field(default_factory=lambda: deque(maxlen=_RETIRED_KEPT))  # started, gone since

    def actor_lines(self) -> list[dict[str, Any]]:
        """Each started actor, current ones first, then the last retired or lost ones (`RemoteActor.describe`)."""
        current = [a.describe("overdue" if a.overdue else "up") for a in self.actors if a is not None and a.node]
        return current + [a.describe("retired") for a in self.retired]


@dataclass(frozen=True)
class RemoteSlot:
    """Where a pool thread's task decodes remotely: actor ``actor`` of ``modality`` of ``decoders`` (its slot's)."""

    decoders: object  # the RemoteDecoders that made it (typed loosely: it imports this module)
    modality: str
    actor: int
