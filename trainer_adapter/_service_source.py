"""`ServiceSource`: a `FeedClient`'s batches from the node's feed service, over its socket.

The source holds the client's cursor: the feed state after the last batch it took. When the
service goes away (restart, crash) it reconnects with backoff and continues from exactly the
next micro-batch not yet taken; a service crash costs the trainer a wait, never a sample.

Until the source has reached its service once, a path where nothing listens is given up on after
a few seconds (a wrong path, no service started); the long ``reconnect_timeout_s`` is for a service
that was up and went away. A service of another user is refused at once (`connect`), never retried.

The next batch is received ahead on a thread of the source's (`BatchesAhead`, ``receive_ahead``
batches; 0: on the trainer's thread when asked), so the trainer's ``next()`` takes a batch that is
already decoded and assembled. Batches received ahead and never yielded (a resize, a resume,
closing) are given back with the goodbye (``returned``): the service logs those deliveries as
returned, so the audit log holds what trainers were handed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from omnifeed.loader.feed import FeedPosition
from omnifeed.loader.service import (
    MAX_REPLY_BYTES,
    PROTOCOL,
    ProtocolError,
    ServiceError,
    ServiceUnavailableError,
    check_reply,
    connect,
    next_request,
    receive,
    send,
)

from ._ahead import BatchesAhead
from ._attempt_feed import checkpoint_digest
from ._segments import Handoff
from ._sources import Topology

log = logging.getLogger("omnifeed.client")

_FATAL_CODES = frozenset({"protocol", "fingerprint", "state", "topology", "position", "feed"})
_NO_SERVICE_S = 5.0  # before a first connection: how long a path where nothing listens is retried

Received = tuple[dict[str, Any], dict[str, Any], FeedPosition, int]  # batch, state after it, that state read, number


class ServiceSource:
    """The batches of one trainer rank from the service at ``address`` (`BatchSource`); connects on first use."""

    def __init__(
        self,
        address: str,
        topology: Topology,
        *,
        index_fingerprint: str | None,
        reconnect_timeout_s: float,
        request_timeout_s: float | None,
        trusted_uid: int | None,
        receive_ahead: int = 1,
    ) -> None:
        self.address, self.topology, self.trusted_uid = address, topology, trusted_uid
        self.index_fingerprint = index_fingerprint
        self.reconnect_timeout_s, self.request_timeout_s = reconnect_timeout_s, request_timeout_s
        self._plan_shape: tuple[int, float | None] | None = None  # (batch size, cost budget) from the service
        self._resumed_from: str | None = None  # digest of the state last loaded: "the job resumed from this checkpoint"
        self._attempt: str | None = None  # the service's name for the run since then (kept across reconnections)
        self._sock: socket.socket | None = None
        self._state: dict[str, Any] | None = None  # after the last batch yielded to the trainer: `state_dict()`
        self._position: FeedPosition | None = None  # `_state` read
        self._cursor: dict[str, Any] | None = None  # after the last batch received (ahead of `_state` by those waiting)
        self._allow_mixture_change = False  # the next hello carries the state over to the service's mixture weights
        self._handoff = Handoff()  # segments mapped, batches the trainer holds and dropped
        self._service = ""  # batch numbers belong to one service process: a release must not reach another
        self._token = uuid.uuid4().hex  # this client, across its reconnections
        self._waited_s = 0.0
        self._closing = threading.Event()  # close() interrupts a reconnection's backoff on the thread ahead
        self._ahead = BatchesAhead(self._receive, receive_ahead, "omnifeed-client-ahead") if receive_ahead else None
        self.reconnects = 0
        self._reached = False  # a service welcomed this client once: from then on, wait for it to come back
        self._first_failure: float | None = None  # when the first attempt before that failed
        self._told_busy = False

    def next_batch(self) -> dict[str, Any]:
        """The next batch of this rank (crossing epochs freely); waits for, and reconnects to, the service."""
        batch, self._state, self._position, _ = self._receive() if self._ahead is None else self._ahead.take()
        return batch

    @property
    def waited_s(self) -> float:
        """Seconds the trainer waited for batches (received ahead: its waits in ``next()``)."""
        return self._waited_s if self._ahead is None else self._ahead.waited_s

    def _receive(self) -> Received:
        """The batch after the cursor, from the service (on the thread ahead, or the trainer's)."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        handoff = self._handoff
        while True:
            try:
                sock = self._sock if self._sock is not None else self._connected(deadline)
                started = time.perf_counter()
                sock.sendall(next_request(handoff.released_to(self._service)))  # a ready-made frame: once a batch
                message = handoff.receive(sock, self._service)
                if message["op"] != "batch":
                    check_reply(message, "batch")
                self._waited_s += time.perf_counter() - started
            except (OSError, EOFError, ServiceError) as exc:
                self._lost(exc, deadline)
                continue
            self._cursor = state = message["state"]
            return message["batch"], state, FeedPosition.from_dict(state), message["seq"]

    @property
    def position(self) -> FeedPosition:
        """The state after the last batch yielded, read (connecting first if none came yet)."""
        if self._position is None:
            self._position = FeedPosition.from_dict(self._current_state())
        return self._position

    def __len__(self) -> int:
        """Micro-batches left in the epoch in progress, as the service plans them (no data read).

        Before the first batch is asked for, the question goes over a connection of its own that says no hello:
        asking the length opens no stream, so the service starts producing nothing for this rank.
        """
        deadline = time.monotonic() + self.reconnect_timeout_s
        request = {
            "op": "length",
            "state": self._state,
            "dp_world_size": self.topology.dp_world_size,
            "grad_accum": self.topology.grad_accum,
            **({"allow_mixture_change": True} if self._allow_mixture_change else {}),
        }
        while True:
            try:
                if self._sock is not None:
                    with self._quiet():
                        send(self._sock, request)
                        reply = check_reply(receive(self._sock, MAX_REPLY_BYTES)[0], "length")
                else:
                    with connect(self.address, self.request_timeout_s, self.trusted_uid) as sock:
                        send(sock, request)
                        reply = check_reply(receive(sock, MAX_REPLY_BYTES)[0], "length")
            except (OSError, EOFError, ServiceError) as exc:
                self._lost(exc, deadline)
                continue
            return int(reply["micro_batches"])

    def state_dict(self) -> dict[str, Any]:
        """The feed state after the last batch taken (connecting first if none came yet)."""
        return dict(self._current_state())

    def load_state_dict(self, state: Mapping[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Reconnect resuming from ``state``: the service checks it at once (and carries it over to its mixture
        weights when ``allow_mixture_change``)."""
        with self._quiet():
            self._goodbye()
            self._state, self._position = dict(state), None
            self._allow_mixture_change = allow_mixture_change
            self._resumed_from = checkpoint_digest(state)
            self._attempt = None
            self._reconnected()

    def resize(self, topology: Topology) -> None:
        """Reconnect at ``topology``."""
        with self._quiet():
            self.topology = topology
            self._goodbye()
            self._reconnected()

    @property
    def plan_shape(self) -> tuple[int, float | None]:
        """The batch size and budget of the service's plan (known once connected)."""
        assert self._plan_shape is not None
        return self._plan_shape

    def close(self) -> None:
        """Say goodbye and disconnect."""
        self._closing.set()
        with self._quiet():
            self._goodbye()
        if self._ahead is not None:
            self._ahead.stop()

    # -- connection ------------------------------------------------------------------------
    @contextmanager
    def _quiet(self) -> Iterator[None]:
        """No batch is being received ahead inside the block: the trainer's thread may use the connection."""
        if self._ahead is None:
            yield
        else:
            with self._ahead.paused():
                yield

    def _reconnected(self) -> None:
        """Connect again from the state yielded last (inside `_quiet`, batches ahead given back)."""
        self._cursor = self._state
        self._connected(time.monotonic() + self.reconnect_timeout_s)
        self._state, self._position = self._cursor, None  # a mixture change carries the state over in the welcome

    def _connected(self, deadline: float) -> socket.socket:
        while self._sock is None:
            try:
                self._sock = self._hello()
            except (OSError, EOFError, ServiceError) as exc:
                self._lost(exc, deadline)
        return self._sock

    def _hello(self) -> socket.socket:
        sock = connect(self.address, self.request_timeout_s, self.trusted_uid)
        topology = self.topology
        try:
            hello = {
                "op": "hello",
                "protocol": PROTOCOL,
                "pid": os.getpid(),
                "rank": topology.rank,
                "world_size": topology.world_size,
                "dp_rank": topology.dp_rank,
                "dp_world_size": topology.dp_world_size,
                "grad_accum": topology.grad_accum,
                "state": self._cursor,
                "resume": self._resumed_from,
                "attempt": self._attempt,
                "token": self._token,
                "index_fingerprint": self.index_fingerprint,
                **({"allow_mixture_change": True} if self._allow_mixture_change else {}),
            }
            try:
                send(sock, hello)
            except (BrokenPipeError, ConnectionResetError):
                _raise_refusal(sock)  # a service that refuses (busy) answers and hangs up before reading
                raise
            reply, _ = receive(sock, MAX_REPLY_BYTES)
            welcome = check_reply(reply, "welcome")
        except BaseException:
            sock.close()
            raise
        self._cursor = welcome["state"]  # carried over, if a mixture change was allowed: later hellos need not allow it
        self._allow_mixture_change = False
        self.index_fingerprint = welcome["index_fingerprint"]
        self._plan_shape = (int(welcome["batch_size"]), welcome["budget"])
        self._attempt = welcome.get("attempt")
        self._handoff.forget_all()  # segment numbers belong to a connection's stream; the service sends each one anew
        self._service = welcome["service"]
        self._reached = True
        return sock

    def _lost(self, exc: BaseException, deadline: float) -> None:
        """The service is unreachable: wait and retry until ``deadline``, then give up with a clear error.

        Before the client first reached its service, a path where nothing listens (no socket,
        or a socket nobody serves) is given up on after `_NO_SERVICE_S`.
        """
        if isinstance(exc, ServiceUnavailableError) or (isinstance(exc, ServiceError) and exc.code in _FATAL_CODES):
            raise exc
        self._drop_connection()
        now = time.monotonic()
        start = f"start one with `omnifeed serve --config SERVICE_YAML --socket {self.address}`"
        if not self._reached:
            self._first_failure = now if self._first_failure is None else self._first_failure
            nothing = isinstance(exc, (FileNotFoundError, ConnectionRefusedError))
            if nothing and now - self._first_failure >= _NO_SERVICE_S:
                what = "no such socket" if isinstance(exc, FileNotFoundError) else "nothing listens on that socket"
                raise ServiceUnavailableError(
                    f"no omnifeed service at {self.address} ({what}); {start}, or point "
                    "the client at the socket a service serves"
                ) from None
        if now > deadline:
            if isinstance(exc, ServiceError) and exc.code == "busy":
                raise ServiceUnavailableError(
                    f"the omnifeed service at {self.address} stayed busy for "
                    f"{self.reconnect_timeout_s:.0f} s ({exc}); raise max_clients in its "
                    "config or close the connections it holds"
                ) from None
            raise ServiceUnavailableError(
                f"no omnifeed service at {self.address} for {self.reconnect_timeout_s:.0f} "
                f"s ({type(exc).__name__}: {exc}); {start}"
            ) from exc
        if isinstance(exc, ServiceError) and exc.code == "busy" and not self._told_busy:
            self._told_busy = True
            log.warning(
                "omnifeed service at %s is busy (%s); retrying for up to %.0f s", self.address, exc, deadline - now
            )
        self.reconnects += 1
        delay = min(2.0, 0.05 * 2 ** min(self.reconnects, 6))
        if not self._reached and self._first_failure is not None:  # give up on time, not one backoff late
            delay = max(0.05, min(delay, self._first_failure + _NO_SERVICE_S - now))
        log.info("omnifeed service at %s unreachable (%s); retrying in %.2f s", self.address, exc, delay)
        if self._closing.wait(delay):
            raise ServiceUnavailableError(f"the client of the omnifeed service at {self.address} is closed") from None

    def _drop_connection(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def _current_state(self) -> dict[str, Any]:
        if self._state is None:
            with self._quiet():
                self._reconnected()
        assert self._state is not None
        return self._state

    def _goodbye(self) -> None:
        """Say goodbye and disconnect, giving back the batches received ahead (inside `_quiet`); batches the trainer
        still holds stay valid."""
        returned = [seq for *_, seq in self._ahead.drain()] if self._ahead is not None else []
        if self._sock is not None:
            try:
                release = self._handoff.released_to(self._service)  # with the batches drained, now unreferenced
                send(self._sock, {"op": "bye", "release": release, "returned": returned})
                receive(self._sock, MAX_REPLY_BYTES)
            except (OSError, EOFError, ProtocolError):
                pass
            self._drop_connection()

    def __del__(self) -> None:
        if getattr(self, "_ahead", None) is not None:
            self._ahead.stop()  # type: ignore[union-attr]
        if getattr(self, "_sock", None) is not None:
            self._drop_connection()


def _raise_refusal(sock: socket.socket) -> None:
    """Raise the `ServiceError` a service sent before hanging up, if one is waiting on ``sock``; else return."""
    sock.settimeout(1.0)
    try:
        reply, _ = receive(sock, MAX_REPLY_BYTES)
    except (OSError, EOFError, ProtocolError):
        return
    if reply["op"] == "error":
        check_reply(reply, "welcome")  # raises it as a ServiceError
