"""`RemoteDecoders`: decode workers of some modalities as Ray actors, next to the local ones (``pools.<m>.remote``).

::

    DecodePools ── local threads ───────────────┐  each takes the modality's next task when it is free:
               └─ remote slots (actor × tasks) ─┤  the task goes to whichever side has room
                     │ wait_slot: only while its actor is up
                     ▼ the task runs in this thread, given its RemoteSlot: FieldReader asks `decode` ...
    RemoteDecoders.decode ── (sample, field location[, bytes]) ──▶ DecodeActor (reads, decodes)
                          ◀── decoded arrays (Ray's object store) ── or None: decode here
    controller thread: connect (retry while unreachable), start/replace actors, grow/shrink by starvation

A task an actor does not finish — the actor killed, its node removed, the cluster gone, an
answer past ``deadline_s``, or any failure on its side — is decoded by the same thread locally,
so every task ends exactly once in its slot and the batch is the one local decoding makes.
Decoders are deterministic, so which side decoded a field does not change its bytes. A late
answer is dropped when it comes; until then its actor takes no task (replaced after 3 deadlines).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._modalities import FIELD_MODALITIES
from ..index import FieldLocation, IndexedSample, check_reachable, import_ray
from ._config import FeedConfig
from ._decoded_codec import tensor_bytes
from ._field_decoders import FieldDecoders, matching_field
from ._field_source import FieldSource
from ._metrics import FeedMetrics
from ._remote_actor import DecodeActor
from ._remote_state import RemoteActor as _Actor
from ._remote_state import RemoteModality as _Modality
from ._remote_state import RemoteSlot

log = logging.getLogger(__name__)

_TICK_S = 0.5  # the controller's period
_STUCK_DEADLINES = 3  # an actor that has not answered within this many deadlines is replaced
_BUSY_SHARE = 0.75  # of the remote slots busy, with tasks queued: starved


def _writable(value: Any) -> Any:
    """Arrays from Ray's object store are read-only views of it: copies, so a transform may write and the store frees."""
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
        pools = {m: config.pool(m).remote for m in FIELD_MODALITIES if m != "meta"}
        self._mods = {m: _Modality(r, [None] * r.cap, r.workers) for m, r in pools.items() if r is not None}
        if not self._mods:
            raise ValueError("no pool has remote workers (pools.<modality>.remote)")
        self.modalities = frozenset(self._mods)  # the modalities decoded remotely as well
        self._ray = import_ray()
        self.address = next(iter(self._mods.values())).config.address
        self._retry_s = min(m.config.retry_s for m in self._mods.values())
        self._args = (config.decode.model_dump_json(), config.cache.model_dump_json(), source.namespace)
        self._source, self._decoders, self._metrics = source, decoders, metrics
        self._cond = threading.Condition()
        self._closed = False
        self._connected = False
        self._owns_connection = False
        self._probe = ""  # the GCS address the controller checks every tick
        self._warned = False
        self.outages = 0
        self._next_try = 0.0
        self._actor_class: Any = None
        self._backlog: Callable[[str], int] = lambda modality: 0
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._control, name="omnifeed-remote", daemon=True)
        self._thread.start()

    # -- the pools' side -------------------------------------------------------------------
    def slots(self) -> dict[str, int]:
        """Remote slots per modality (actors at most × tasks per actor): one pool thread each."""
        return {m: mod.config.cap * mod.config.tasks_per_worker for m, mod in self._mods.items()}

    def attach(self, backlog: Callable[[str], int]) -> None:
        """How many tasks of a modality wait in the pools (the starvation signal)."""
        self._backlog = backlog

    def wait_slot(self, modality: str, slot: int, timeout: float) -> bool:
        """Wait until remote slot ``slot`` of ``modality`` may take a task (its actor is up); False on timeout or close."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed:
                if self._usable(modality, slot // self._mods[modality].config.tasks_per_worker) is not None:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return False

    def _usable(self, modality: str, index: int) -> _Actor | None:
        mod = self._mods[modality]
        actor = mod.actors[index]
        ok = self._connected and index < mod.target and actor is not None and actor.usable and not actor.overdue
        return actor if ok else None

    def slot(self, modality: str, slot: int) -> RemoteSlot:
        """Where remote slot ``slot`` of ``modality`` decodes: the pool thread passes it down with each task it runs."""
        return RemoteSlot(self, modality, slot // self._mods[modality].config.tasks_per_worker)

    def decode(self, sample: IndexedSample, location: FieldLocation, slot: RemoteSlot | None) -> tuple[Any, int] | None:
        """(decoded value, bytes read here) from ``slot``'s actor; None: decode the field here instead (no slot: a
        local worker's task)."""
        if slot is None or slot.decoders is not self or slot.modality != location.modality or self._custom(location):
            return None
        mod = self._mods[slot.modality]
        with self._cond:
            actor = self._usable(slot.modality, slot.actor)
            if actor is None:
                return None
            actor.busy += 1
        try:
            return self._call(mod, actor, sample, location)
        finally:
            with self._cond:
                actor.busy -= 1
                if not self._connected:
                    self._cond.notify_all()  # _down waits for the calls in flight

    def _custom(self, location: FieldLocation) -> bool:
        """A user's decoder decodes this field: it stays in this process (it may not pickle)."""
        fields = self._decoders.fields
        return location.modality in self._decoders.custom or bool(fields and matching_field(location.name, fields))

    def _call(
        self, mod: _Modality, actor: _Actor, sample: IndexedSample, location: FieldLocation
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
                with self._cond:
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
            self._lose(mod, actor, exc)
            return None
        if status != "ok":
            with self._cond:
                mod.failed += 1
            log.debug("remote decode of %r failed (%s): decoding it here", sample.key, value)
            return None
        value = _writable(value)
        with self._cond:
            mod.decoded += 1
            mod.round_trip.append(time.perf_counter() - started)
            mod.returned_bytes += tensor_bytes(value)
            mod.actor_read_bytes += read
        return value, 0 if data is None else len(data)

    def _lose(self, mod: _Modality, actor: _Actor, exc: BaseException) -> None:
        with self._cond:
            if actor.lost:
                return
            actor.lost, actor.usable = True, False
            mod.lost += 1
            self._cond.notify_all()
        log.warning(
            "a remote decode worker (%s) was lost (%s: %s): its task is decoded here, another is started",
            actor.where or "starting",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )

    # -- the controller ----------------------------------------------------------------------
    def _control(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                connected = self._connected
            try:
                if not connected and time.monotonic() >= self._next_try:
                    self._connect()
                if self._connected:
                    self._tend()
            except Exception as exc:  # noqa: BLE001  any failure talking to Ray: local workers carry on
                self._down(exc)
            with self._cond:
                if not self._closed:
                    self._cond.wait(_TICK_S)

    def _connect(self) -> None:
        ray = self._ray
        if not ray.is_initialized():
            check_reachable(self.address)
            ray.init(address=self.address, logging_level=logging.WARNING)
            self._owns_connection = True
        elif self._probe:
            check_reachable(self._probe)  # a connection this process holds: is its cluster back?
        self._actor_class = ray.remote(self._actor_type)
        self._probe = self._gcs_address()
        with self._cond:
            self._connected = True
        log.info(
            "decoding on the Ray cluster at %s as well: %s",
            self.address,
            ", ".join(f"{m} {mod.target} actor(s)" for m, mod in self._mods.items()),
        )

    def _gcs_address(self) -> str:
        """HOST:PORT of the cluster's GCS (what the controller probes), or "" when Ray does not say."""
        if self.address.startswith("ray://"):
            return self.address
        try:
            return str(self._ray.get_runtime_context().gcs_address or "")
        except Exception:  # noqa: BLE001  an older Ray or a client connection: no probe
            return ""

    def _down(self, exc: BaseException) -> None:
        with self._cond:
            self._connected = False
            inflight = [a for mod in self._mods.values() for a in mod.actors if a is not None]
            for mod in self._mods.values():
                mod.actors = [None] * len(mod.actors)  # their handles belong to the lost connection
            self._next_try = time.monotonic() + self._retry_s
            warn, self._warned = not self._warned, True
            if warn:
                self.outages += 1
            self._cond.notify_all()
        if warn:
            log.warning(
                "the Ray cluster at %s is unreachable (%s: %s): decoding on the local workers only, "
                "trying again every %g s",
                self.address,
                type(exc).__name__,
                exc,
                self._retry_s,
            )
        if self._owns_connection:
            # Ray ends a driver process whose GCS stays unreachable for a minute: disconnect before
            # that, once no call is in flight (each ends within its deadline), and connect anew later.
            wait_s = max(m.config.deadline_s for m in self._mods.values()) + 1.0
            with self._cond:
                self._cond.wait_for(lambda: not any(a.busy for a in inflight), wait_s)
            self._owns_connection = False
            self._ray.shutdown()

    def _tend(self) -> None:
        """Probe the GCS, scale, retire lost, stuck or surplus actors, start missing ones, mark started ones usable."""
        if self._probe:
            check_reachable(self._probe)  # raises while the cluster is gone: _down
        self._check_overdue()
        doomed: list[_Actor] = []
        with self._cond:
            for modality, mod in self._mods.items():
                self._scale(modality, mod)
                for i, actor in enumerate(mod.actors):
                    if actor is not None and (actor.lost or i >= mod.target) and actor.busy == 0:
                        mod.actors[i] = None
                        doomed.append(actor)
            wanted = [(mod, i) for mod in self._mods.values() for i in range(mod.target) if mod.actors[i] is None]
            starting = [
                a for mod in self._mods.values() for a in mod.actors if a is not None and not a.usable and not a.lost
            ]
        for actor in doomed:
            self._ray.kill(actor.handle, no_restart=True)
        for mod, i in wanted:
            handle = self._actor_class.options(
                num_cpus=mod.config.num_cpus,
                resources=dict(mod.config.resources) or None,
                scheduling_strategy="SPREAD",
                max_restarts=0,
            ).remote(*self._args)
            with self._cond:
                mod.actors[i] = _Actor(handle, handle.ready.remote())
        for actor in starting:
            done, _ = self._ray.wait([actor.ready], timeout=0)
            if done:
                self._started_actor(actor)

    def _check_overdue(self) -> None:
        """Drop the late answers that came; an actor stuck past ``_STUCK_DEADLINES`` deadlines is lost."""
        with self._cond:
            late = [(mod, a) for mod in self._mods.values() for a in mod.actors if a is not None and a.overdue]
        for mod, actor in late:
            refs = list(actor.overdue)
            done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
            stuck = time.monotonic() - actor.overdue_since > _STUCK_DEADLINES * mod.config.deadline_s
            with self._cond:
                actor.overdue = [r for r in actor.overdue if r not in done]
                if not actor.overdue:
                    self._cond.notify_all()
                elif stuck and not actor.lost:
                    actor.lost, actor.usable = True, False
                    mod.lost += 1
                    log.warning(
                        "a remote decode worker (%s) has not answered for %.0f s: replacing it",
                        actor.where,
                        _STUCK_DEADLINES * mod.config.deadline_s,
                    )

    def _started_actor(self, actor: _Actor) -> None:
        try:
            where = self._ray.get(actor.ready)
        except Exception as exc:  # noqa: BLE001  it could not start (or died at once): replaced next tick
            with self._cond:
                actor.lost = True
            log.warning("a remote decode worker did not start (%s: %s)", type(exc).__name__, exc)
            return
        with self._cond:
            actor.usable, actor.where = True, where
            if self._warned and self.outages:
                log.info("the Ray cluster at %s answers again: decoding there as well", self.address)
            self._warned = False
            self._cond.notify_all()

    def _scale(self, modality: str, mod: _Modality) -> None:
        """One actor more after ``grow_after_s`` starved (up to the cap), one fewer after ``shrink_after_s`` idle."""
        now = time.monotonic()
        up = [a for a in mod.actors[: mod.target] if a is not None and a.usable]
        busy = sum(a.busy for a in up)
        capacity = len(up) * mod.config.tasks_per_worker
        starved = capacity > 0 and busy >= _BUSY_SHARE * capacity and self._backlog(modality) > 0
        mod.starved_since = (now if mod.starved_since is None else mod.starved_since) if starved else None
        idle = capacity > 0 and busy == 0
        mod.idle_since = (now if mod.idle_since is None else mod.idle_since) if idle else None
        if (
            mod.starved_since is not None
            and now - mod.starved_since >= mod.config.grow_after_s
            and mod.target < mod.config.cap
            and len(up) == mod.target
        ):
            mod.target += 1
            mod.resized += 1
            mod.starved_since = None
            log.info("remote %s decode workers starved: %d actors now", modality, mod.target)
        elif (
            mod.idle_since is not None
            and now - mod.idle_since >= mod.config.shrink_after_s
            and mod.target > mod.config.workers
        ):
            mod.target -= 1
            mod.resized += 1
            mod.idle_since = None
            log.info("remote %s decode workers idle: %d actors now", modality, mod.target)

    # -- metrics and lifecycle ---------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Connection, and per modality: actors, remote/local decodes and rates, round trip, re-issued, lost."""
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        with self._cond:
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
                }
            return {
                "address": self.address,
                "connected": self._connected,
                "outages": self.outages,
                "modalities": modalities,
            }

    def close(self) -> None:
        """Stop the controller, kill the actors, and disconnect if the connection was made here (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            actors = [a for mod in self._mods.values() for a in mod.actors if a is not None]
            connected, self._connected = self._connected, False
        if connected:
            for actor in actors:
                try:
                    self._ray.kill(actor.handle, no_restart=True)
                except Exception:  # noqa: BLE001  already gone with its node
                    pass
        if self._owns_connection:
            self._ray.shutdown()


def remote_decoders(
    config: FeedConfig, source: FieldSource, decoders: FieldDecoders, metrics: FeedMetrics
) -> RemoteDecoders | None:
    """The remote decode workers ``config`` asks for, or None when no pool has ``remote``."""
    if not any(config.pool(m).remote is not None for m in FIELD_MODALITIES if m != "meta"):
        return None
    return RemoteDecoders(config, source, decoders, metrics)
