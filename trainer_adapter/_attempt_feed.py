"""`AttemptFeed`: the in-process client's feed, with the service's attempt semantics in its audit log.

An **attempt** is a run of the job since it loaded a checkpoint (or since it started from scratch).
Every delivery record is tagged ``"since": ATTEMPT``, and the attempt's first delivery is preceded
by a **resume marker** (``{"resume": ATTEMPT, "epoch", "step", "accum_done", "topology_version",
"keys": []}``), the service's own (`omnifeed.loader.service.resume_marker`): `omnifeed verify` then
rolls back what earlier attempts delivered from that step on and never committed, instead of counting
it twice after a restart.

The ranks of one attempt must name it alike, without talking to each other: the attempt is the digest
of the checkpoint loaded (``"start"`` without one) and a round token that every rank of one
(re)start shares and a later restart does not (`torchrun_round`). The marker is written at the first
delivery, not at construction, so a checkpoint loaded right after construction is the one it names.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import xxhash

from omnifeed.loader import Feed, SampleIndex
from omnifeed.loader.feed import FeedConfig, FeedPosition, Taken
from omnifeed.loader.plan import open_audit_log
from omnifeed.loader.service import resume_marker

_ROUND_VARIABLES = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")


def torchrun_round(environ: Mapping[str, str]) -> str:
    """A token every worker of one torchrun rendezvous round shares: its run id, master address/port and world size.

    torchrun restarts all workers on any failure or membership change, and each round's master port is
    a fresh free port picked by the agent of group rank 0 (its restart count differs between agents:
    it does not count joins), so a later round names its attempt differently.
    """
    return "/".join(environ.get(name, "") for name in _ROUND_VARIABLES)


def checkpoint_digest(state: Mapping[str, Any]) -> str:
    """The digest that names a loaded checkpoint (the client's hello carries it to the service as ``resume``)."""
    return xxhash.xxh64_hexdigest(json.dumps(state, sort_keys=True).encode())


class AttemptFeed(Feed):
    """A `Feed` whose delivery records carry the attempt (``since``) after a resume marker.

    ``audit_log``: where records go (None: nowhere); ``round_token``: the token the ranks of this (re)start
    share. None: a feed of one data-parallel rank is the whole job, each (re)start its own attempt; with
    several ranks nothing tells which of them form one start, so records are written as a plain
    `Feed` writes them (no attempts). Other arguments are `Feed`'s.
    """

    def __init__(
        self,
        index: SampleIndex | str | Path,
        config: FeedConfig | None = None,
        *,
        world_size: int = 1,
        rank: int = 0,
        grad_accum: int = 1,
        audit_log: str | Path | None = None,
        round_token: str | None = None,
    ) -> None:
        super().__init__(index, config, world_size=world_size, rank=rank, grad_accum=grad_accum)
        self._log: IO[str] | None = open_audit_log(audit_log) if audit_log else None
        if round_token is None and world_size == 1:
            round_token = f"{os.getpid()}-{uuid.uuid4().hex}"
        self._round = round_token
        self._checkpoint = "start"
        self.attempt: str | None = None  # named at the first delivery since construction or a load
        # a batch made ahead of the trainer is logged when the trainer gets it: one dropped (a resize, a load,
        # closing) was never delivered, and the feed rewound past it delivers its samples again
        self.defer_records = False
        self._deferred: list[tuple[FeedPosition, dict[str, Any]]] = []

    def load_state_dict(self, state: Mapping[str, Any], *, allow_mixture_change: bool = False) -> None:
        """`Feed.load_state_dict`; the next delivery opens the attempt that resumed from ``state``."""
        super().load_state_dict(state, allow_mixture_change=allow_mixture_change)
        self._checkpoint = checkpoint_digest(state)
        self.attempt = None

    def take(self) -> Taken:
        """`Feed.take`, its delivery record logged with the attempt (after the attempt's marker); with
        ``defer_records`` set, kept for `log_delivery` instead (`take_deferred` hands them over)."""
        if self._log is None:
            return super().take()
        before = self.position
        taken = super().take()
        if self.defer_records:
            self._deferred.append((before, taken.record))
        else:
            self.log_delivery(before, taken.record)
        return taken

    def take_deferred(self) -> list[tuple[FeedPosition, dict[str, Any]]]:
        """The delivery records kept since the last call (with ``defer_records``), each with the position before it."""
        deferred, self._deferred = self._deferred, []
        return deferred

    def log_delivery(self, before: FeedPosition, record: dict[str, Any]) -> None:
        """Write a delivery record taken at ``before``: the attempt's marker first if it is the attempt's first."""
        if self._log is None:
            return
        if self._round is None:
            self._write(record)
            return
        if self.attempt is None:
            self.attempt = f"{self._checkpoint}-{xxhash.xxh64_hexdigest(self._round.encode())[:12]}"
            self._write(resume_marker(self.attempt, before))
        self._write({**record, "since": self.attempt})

    def _write(self, record: dict[str, Any]) -> None:
        assert self._log is not None
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def close(self) -> None:
        """`Feed.close`, and the audit log (idempotent)."""
        super().close()
        if self._log is not None:
            self._log.close()
            self._log = None
