"""`RemoteCluster`: the Ray session of the remote decoders and their actors, tended by a controller thread.

The controller (one thread, every ``_TICK_S``) connects to the cluster, retrying every
``retry_s`` while it is unreachable (one warning per outage); probes its GCS and, when it is
gone, drops the actors' handles and disconnects a connection made here before Ray ends the
process; starts missing actors and marks started ones usable; retires lost, stuck (no answer
for ``_STUCK_DEADLINES`` deadlines) or surplus ones; and grows or shrinks a modality's actors
by starvation. The task submission and its local fallback are `RemoteDecoders`' (`_remote`).
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .._modalities import FIELD_MODALITIES
from ..index import check_reachable, import_ray
from ._config import FeedConfig
from ._remote_actor import DecodeActor
from ._remote_state import RemoteActor, RemoteModality

log = logging.getLogger(__name__)

_TICK_S = 0.5  # the controller's period
_STUCK_DEADLINES = 3  # an actor that has not answered within this many deadlines is replaced
_BUSY_SHARE = 0.75  # of the remote slots busy, with tasks queued: starved


class _NoMainThreadNotice(logging.Filter):
    """Drops Ray's notice that ``ray.init`` off the main thread set no SIGTERM handler: the service keeps its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SIGTERM handler is not set")


def _connect_quietly(ray: Any, address: str) -> None:
    """``ray.init`` as the service's driver, leaving its signals alone: without Ray's failure signal handler.

    Ray's driver installs abseil's failure signal handler, which writes what looks like a crash
    dump (``*** SIGTERM received at time=...``, a stack) on every SIGTERM, a clean stop of
    `omnifeed serve` included, before calling the service's own handler. Ray reads its switch
    (``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``) from ``ray_constants`` when the driver connects:
    set here for this call only, never in the environment the actors inherit.
    """
    try:
        ray_constants: Any = importlib.import_module("ray._private.ray_constants")
    except ImportError:  # another layout of Ray: connect with its handler
        ray_constants = None
    saved = getattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
    notice = _NoMainThreadNotice()
    worker_log = logging.getLogger("ray._private.worker")
    worker_log.addFilter(notice)
    try:
        if saved is not None:
            ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
        ray.init(address=address, logging_level=logging.WARNING)
    finally:
        if saved is not None:
            ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = saved
        worker_log.removeFilter(notice)


class RemoteCluster:
    """The Ray connection and the actors of the modalities whose pool has ``remote``; ``cond`` guards them all.

    Raises OmnifeedError when Ray is not installed, ValueError when no pool has ``remote``; an
    unreachable cluster is not an error: the controller tries again.
    """

    def __init__(self, config: FeedConfig, namespace: str, actor_type: type[DecodeActor]) -> None:
        pools = {m: config.pool(m).remote for m in FIELD_MODALITIES if m != "meta"}
        self.mods = {m: RemoteModality(r, [None] * r.cap, r.workers) for m, r in pools.items() if r is not None}
        if not self.mods:
            raise ValueError("no pool has remote workers (pools.<modality>.remote)")
        self.ray = import_ray()
        self.address = next(iter(self.mods.values())).config.address
        self._retry_s = min(m.config.retry_s for m in self.mods.values())
        self._args = (config.decode.model_dump_json(), config.cache.model_dump_json(), namespace)
        self._actor_type = actor_type
        self.cond = threading.Condition()
        self._closed = False
        self.connected = False
        self._owns_connection = False
        self._probe = ""  # the GCS address the controller checks every tick
        self._warned = False
        self.outages = 0
        self._next_try = 0.0
        self._actor_class: Any = None
        self.backlog: Callable[[str], int] = lambda modality: 0  # tasks of a modality queued (starvation)
        self._thread = threading.Thread(target=self._control, name="omnifeed-remote", daemon=True)
        self._thread.start()

    def wait_usable(self, modality: str, index: int, timeout: float) -> bool:
        """Wait until actor ``index`` of ``modality`` may take a task; False on timeout or close."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self._closed:
                if self.usable(modality, index) is not None:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return False

    def usable(self, modality: str, index: int) -> RemoteActor | None:
        """Actor ``index`` of ``modality`` if it is up, wanted and owes no answer, else None (hold ``cond``)."""
        mod = self.mods[modality]
        actor = mod.actors[index]
        ok = self.connected and index < mod.target and actor is not None and actor.usable and not actor.overdue
        return actor if ok else None

    def lose(self, mod: RemoteModality, actor: RemoteActor, exc: BaseException) -> None:
        """A call to ``actor`` failed (it, its node or the cluster is gone): the controller replaces it."""
        with self.cond:
            if actor.lost:
                return
            actor.lost, actor.usable = True, False
            mod.lost += 1
            self.cond.notify_all()
        log.warning(
            "a remote decode worker (%s) was lost (%s: %s): its task is decoded here, another is started",
            actor.where or "starting",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )

    # -- the controller ----------------------------------------------------------------------
    def _control(self) -> None:
        while True:
            with self.cond:
                if self._closed:
                    return
                connected = self.connected
            try:
                if not connected and time.monotonic() >= self._next_try:
                    self._connect()
                if self.connected:
                    self._tend()
            except Exception as exc:  # noqa: BLE001  any failure talking to Ray: local workers carry on
                self._down(exc)
            with self.cond:
                if not self._closed:
                    self.cond.wait(_TICK_S)

    def _connect(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            check_reachable(self.address)
            _connect_quietly(ray, self.address)
            self._owns_connection = True
        elif self._probe:
            check_reachable(self._probe)  # a connection this process holds: is its cluster back?
        self._actor_class = ray.remote(self._actor_type)
        self._probe = self._gcs_address()
        with self.cond:
            self.connected = True
        log.info(
            "decoding on the Ray cluster at %s as well: %s",
            self.address,
            ", ".join(f"{m} {mod.target} actor(s)" for m, mod in self.mods.items()),
        )

    def _gcs_address(self) -> str:
        """HOST:PORT of the cluster's GCS (what the controller probes), or "" when Ray does not say."""
        if self.address.startswith("ray://"):
            return self.address
        try:
            return str(self.ray.get_runtime_context().gcs_address or "")
        except Exception:  # noqa: BLE001  an older Ray or a client connection: no probe
            return ""

    def _down(self, exc: BaseException) -> None:
        with self.cond:
            self.connected = False
            inflight = [a for mod in self.mods.values() for a in mod.actors if a is not None]
            for mod in self.mods.values():
                mod.retired.extend(a for a in mod.actors if a is not None and a.node)
                mod.actors = [None] * len(mod.actors)  # their handles belong to the lost connection
            self._next_try = time.monotonic() + self._retry_s
            warn, self._warned = not self._warned, True
            if warn:
                self.outages += 1
            self.cond.notify_all()
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
            wait_s = max(m.config.deadline_s for m in self.mods.values()) + 1.0
            with self.cond:
                self.cond.wait_for(lambda: not any(a.busy for a in inflight), wait_s)
            self._owns_connection = False
            self.ray.shutdown()

    def _tend(self) -> None:
        """Probe the GCS, scale, retire lost, stuck or surplus actors, start missing ones, mark started ones usable."""
        if self._probe:
            check_reachable(self._probe)  # raises while the cluster is gone: _down
        self._check_overdue()
        doomed: list[RemoteActor] = []
        with self.cond:
            for modality, mod in self.mods.items():
                self._scale(modality, mod)
                for i, actor in enumerate(mod.actors):
                    if actor is not None and (actor.lost or i >= mod.target) and actor.busy == 0:
                        mod.actors[i] = None
                        doomed.append(actor)
                        if actor.node:
                            mod.retired.append(actor)
            wanted = [(mod, i) for mod in self.mods.values() for i in range(mod.target) if mod.actors[i] is None]
            starting = [
                a for mod in self.mods.values() for a in mod.actors if a is not None and not a.usable and not a.lost
            ]
        for actor in doomed:
            self.ray.kill(actor.handle, no_restart=True)
        for mod, i in wanted:
            handle = self._actor_class.options(
                num_cpus=mod.config.num_cpus,
                resources=dict(mod.config.resources) or None,
                scheduling_strategy="SPREAD",
                max_restarts=0,
            ).remote(*self._args)
            with self.cond:
                mod.actors[i] = RemoteActor(handle, handle.ready.remote())
        for actor in starting:
            done, _ = self.ray.wait([actor.ready], timeout=0)
            if done:
                self._started_actor(actor)

    def _check_overdue(self) -> None:
        """Drop the late answers that came; an actor stuck past ``_STUCK_DEADLINES`` deadlines is lost."""
        with self.cond:
            late = [(mod, a) for mod in self.mods.values() for a in mod.actors if a is not None and a.overdue]
        for mod, actor in late:
            refs = list(actor.overdue)
            done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
            stuck = time.monotonic() - actor.overdue_since > _STUCK_DEADLINES * mod.config.deadline_s
            with self.cond:
                actor.overdue = [r for r in actor.overdue if r not in done]
                if not actor.overdue:
                    self.cond.notify_all()
                elif stuck and not actor.lost:
                    actor.lost, actor.usable = True, False
                    mod.lost += 1
                    log.warning(
                        "a remote decode worker (%s) has not answered for %.0f s: replacing it",
                        actor.where,
                        _STUCK_DEADLINES * mod.config.deadline_s,
                    )

    def _started_actor(self, actor: RemoteActor) -> None:
        try:
            where: dict[str, Any] = self.ray.get(actor.ready)
        except Exception as exc:  # noqa: BLE001  it could not start (or died at once): replaced next tick
            with self.cond:
                actor.lost = True
            log.warning("a remote decode worker did not start (%s: %s)", type(exc).__name__, exc)
            return
        with self.cond:
            actor.usable, actor.where = True, f"{where['host']}:{where['pid']}"
            actor.node, actor.ip, actor.pid = where["node"], where["ip"], where["pid"]
            if self._warned and self.outages:
                log.info("the Ray cluster at %s answers again: decoding there as well", self.address)
            self._warned = False
            self.cond.notify_all()

    def _scale(self, modality: str, mod: RemoteModality) -> None:
        """One actor more after ``grow_after_s`` starved (up to the cap), one fewer after ``shrink_after_s`` idle."""
        now = time.monotonic()
        up = [a for a in mod.actors[: mod.target] if a is not None and a.usable]
        busy = sum(a.busy for a in up)
        capacity = len(up) * mod.config.tasks_per_worker
        starved = capacity > 0 and busy >= _BUSY_SHARE * capacity and self.backlog(modality) > 0
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

    def close(self) -> None:
        """Stop the controller, kill the actors, and disconnect if the connection was made here (idempotent)."""
        with self.cond:
            if self._closed:
                return
            self._closed = True
            self.cond.notify_all()
        self._thread.join()
        with self.cond:
            actors = [a for mod in self.mods.values() for a in mod.actors if a is not None]
            connected, self.connected = self.connected, False
        if connected:
            for actor in actors:
                try:
                    self.ray.kill(actor.handle, no_restart=True)
                except Exception:  # noqa: BLE001  already gone with its node
                    pass
        if self._owns_connection:
            self.ray.shutdown()
