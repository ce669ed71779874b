"""`RemoteDecoders`: decode workers of some modalities as Ray actors, next to the local ones (``pools.<m>.remote``).

::

    DecodePools ── local threads ───────────────┐  each takes the modality's next task when it is free:
               └─ remote slots (actor × tasks) ─┤  the task goes to whichever side has room
                     │ wait_slot: only while its actor is up
                     ▼ the task runs in this thread, given its RemoteSlot: FieldReader asks `decode` ...
    RemoteDecoders.decode ── (sample, field location[, bytes]) ──▶ DecodeActor (reads, decodes)
                          ◀── decoded arrays (Ray's object store) ── or None: decode here
    RemoteCluster (_remote_cluster), its controller thread: connect (retry while unreachable),
                   start/replace actors, grow/shrink by starvation

A task an actor does not finish — the actor killed, its node removed, the cluster gone, an
answer past ``deadline_s``, or any failure on its side — is decoded by the same thread locally,
so every task ends exactly once in its slot and the batch is the one local decoding makes.
Decoders are deterministic, so which side decoded a field does not change its bytes. A late
answer is dropped when it comes; until then its actor takes no task (replaced after 3 deadlines).
This module is the task side: which slot may submit, the call, its deadline and fallback, metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._modalities import FIELD_MODALITIES
from ..index import FieldLocation, IndexedSample
from ._config import FeedConfig
from ._decoded_codec import tensor_bytes
from ._field_decoders import FieldDecoders, matching_field
from ._field_source import FieldSource
from ._metrics import FeedMetrics
from ._remote_actor import DecodeActor
from ._remote_cluster import RemoteCluster
from ._remote_state import RemoteActor, RemoteModality, RemoteSlot

log = logging.getLogger(__name__)


def _writable(value: Any) -> Any:
    """Arrays from Ray's object store are read-only views of it: copies, so a transform may write and the store
    frees."""
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        return value.copy()
    if isinstance(value, tuple):
        return tuple(_writable(v) for v in value)
    return value


class RemoteDecoders:
    """The Ray actors of the modalities whose pool has ``remote``, and the calls that decode on them.

    Raises OmnifeedError at construction when Ray is not installed; an unreachable cluster is
    not an error: the pools decode locally (one warning per outage) and the controller tries again.
    """

    _actor_type: type[DecodeActor] = DecodeActor  # tests put a slowed subclass here

    def __init__(self, config: FeedConfig, source: FieldSource, decoders: FieldDecoders, metrics: FeedMetrics) -> None:
        self._started = time.perf_counter()
        self._cluster = RemoteCluster(config, source.namespace, self._actor_type)
        self._mods = self._cluster.mods
        self.modalities = frozenset(self._mods)  # the modalities decoded remotely as well
        self.address = self._cluster.address
        self._ray = self._cluster.ray
        self._source, self._decoders, self._metrics = source, decoders, metrics

    @property
    def outages(self) -> int:
        """Times the cluster was found unreachable."""
        return self._cluster.outages

    # -- the pools' side -------------------------------------------------------------------
    def slots(self) -> dict[str, int]:
        """Remote slots per modality (actors at most × tasks per actor): one pool thread each."""
        return {m: mod.config.cap * mod.config.tasks_per_worker for m, mod in self._mods.items()}

    def attach(self, backlog: Callable[[str], int]) -> None:
        """How many tasks of a modality wait in the pools (the starvation signal)."""
        self._cluster.backlog = backlog

    def wait_slot(self, modality: str, slot: int, timeout: float) -> bool:
        """Wait until remote slot ``slot`` of ``modality`` may take a task (its actor is up); False on timeout or
        close."""
        return self._cluster.wait_usable(modality, slot // self._mods[modality].config.tasks_per_worker, timeout)

    def slot(self, modality: str, slot: int) -> RemoteSlot:
        """Where remote slot ``slot`` of ``modality`` decodes: the pool thread passes it down with each task it runs."""
        return RemoteSlot(self, modality, slot // self._mods[modality].config.tasks_per_worker)

    def decode(self, sample: IndexedSample, location: FieldLocation, slot: RemoteSlot | None) -> tuple[Any, int] | None:
        """(decoded value, bytes read here) from ``slot``'s actor; None: decode the field here instead (no slot: a
        local worker's task)."""
        if slot is None or slot.decoders is not self or slot.modality != location.modality or self._custom(location):
            return None
        mod = self._mods[slot.modality]
        with self._cluster.cond:
            actor = self._cluster.usable(slot.modality, slot.actor)
            if actor is None:
                return None
            actor.busy += 1
        try:
            return self._call(mod, actor, sample, location)
        finally:
            with self._cluster.cond:
                actor.busy -= 1
                if not self._cluster.connected:
                    self._cluster.cond.notify_all()  # _down waits for the calls in flight

    def _custom(self, location: FieldLocation) -> bool:
        """A user's decoder decodes this field: it stays in this process (it may not pickle)."""
        fields = self._decoders.fields
        return location.modality in self._decoders.custom or bool(fields and matching_field(location.name, fields))

    def _call(
        self, mod: RemoteModality, actor: RemoteActor, sample: IndexedSample, location: FieldLocation
    ) -> tuple[Any, int] | None:
        data = None
        if mod.config.send_bytes:
            kind, payload = self._source.load(sample, location)
            if kind == "decoded":
                return payload, 0
            data = payload
        started = time.perf_counter()
        try:
            ref = actor.handle.decode.remote(sample, location, data)
            done, _ = self._ray.wait([ref], timeout=mod.config.deadline_s)
            if not done:
                with self._cluster.cond:
                    mod.reissued += 1
                    if not actor.overdue:
                        actor.overdue_since = time.monotonic()
                    actor.overdue.append(ref)
                log.info(
                    "remote %s decode of %r past %.1f s: decoding it here (the first result wins)",
                    location.modality,
                    sample.key,
                    mod.config.deadline_s,
                )
                return None
            status, value, read = self._ray.get(ref)
        except Exception as exc:  # noqa: BLE001  the actor, its node or the cluster is gone: decode here
            self._cluster.lose(mod, actor, exc)
            return None
        if status != "ok":
            with self._cluster.cond:
                mod.failed += 1
            log.debug("remote decode of %r failed (%s): decoding it here", sample.key, value)
            return None
        value = _writable(value)
        with self._cluster.cond:
            mod.decoded += 1
            actor.decoded += 1
            mod.round_trip.append(time.perf_counter() - started)
            mod.returned_bytes += tensor_bytes(value)
            mod.actor_read_bytes += read
        return value, 0 if data is None else len(data)

    # -- metrics and lifecycle ---------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Connection, and per modality: actors (and where each runs), remote/local decodes and rates, round trip,
        re-issued, lost."""
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        with self._cluster.cond:
            modalities = {}
            for modality, mod in self._mods.items():
                local = max(0, self._metrics.decoded_count(modality) - mod.decoded)
                trips = np.asarray(mod.round_trip, dtype=np.float64)
                p50, p90, p99 = np.quantile(trips, [0.5, 0.9, 0.99]) if trips.size else (0.0, 0.0, 0.0)
                modalities[modality] = {
                    "workers": sum(1 for a in mod.actors if a is not None and a.usable),
                    "target": mod.target,
                    "max_workers": mod.config.cap,
                    "resized": mod.resized,
                    "decoded": mod.decoded,
                    "decoded_per_s": mod.decoded / elapsed,
                    "local_decoded": local,
                    "local_per_s": local / elapsed,
                    "round_trip_s": {"p50": float(p50), "p90": float(p90), "p99": float(p99)},
                    "reissued": mod.reissued,
                    "overdue": sum(len(a.overdue) for a in mod.actors if a is not None),
                    "lost": mod.lost,
                    "failed": mod.failed,
                    "returned_bytes": mod.returned_bytes,
                    "actor_read_bytes": mod.actor_read_bytes,
                    "actors": mod.actor_lines(),
                }
            return {
                "address": self.address,
                "connected": self._cluster.connected,
                "outages": self._cluster.outages,
                "modalities": modalities,
            }

    def close(self) -> None:
        """Stop the controller, kill the actors, and disconnect if the connection was made here (idempotent)."""
        self._cluster.close()


def remote_decoders(
    config: FeedConfig, source: FieldSource, decoders: FieldDecoders, metrics: FeedMetrics
) -> RemoteDecoders | None:
    """The remote decode workers ``config`` asks for, or None when no pool has ``remote``."""
    if not any(config.pool(m).remote is not None for m in FIELD_MODALITIES if m != "meta"):
        return None
    return RemoteDecoders(config, source, decoders, metrics)
