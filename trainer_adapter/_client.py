"""`FeedClient`: a trainer rank's batches from the node's feed service, or from a feed in this process.

The client holds its own cursor: the feed state after the last batch it yielded. When the
service goes away (restart, crash) the client reconnects with backoff and continues from
exactly the next micro-batch it has not yielded; a service crash costs the trainer a wait,
never a sample. Batches are the in-process feed's format (``omnifeed.loader`` batch
format); their tensors are views of shared memory the service wrote once, so taking a
batch costs the trainer a header read, whatever the batch's size.

A batch's memory goes back to the service once the trainer holds nothing of it (checked at
each request, `_segments.Handoff`; the tensors of a segment's layout are built once and handed
out again), so holding on to batches is safe, only memory-hungry.
Tensor-parallel peers map the same pages: an in-place edit of a batch is seen by them.

The client maps what its service hands it, so it first checks that the service is the user's
own (`omnifeed.loader.service.connect`: the socket's directory, then ``SO_PEERCRED``); a service
of another user is refused at once (`UntrustedServiceError`), never retried. Until the client
has reached its service once, a path where nothing listens is given up on after a few
seconds (a wrong path, no service started); the long ``reconnect_timeout_s`` is for a
service that was up and went away.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omnifeed.loader import Feed, FeedError
from omnifeed.loader.feed import FeedPosition
from omnifeed.loader.service import (
    MAX_REPLY_BYTES,
    PROTOCOL,
    ProtocolError,
    ServiceConfig,
    ServiceError,
    ServiceUnavailableError,
    check_reply,
    connect,
    default_socket,
    next_request,
    receive,
    send,
)

from ._attempt_feed import AttemptFeed, checkpoint_digest, torchrun_round
from ._hints import LrRule, TopologyHints, topology_hints
from ._segments import Handoff

log = logging.getLogger("omnifeed.client")

_FATAL_CODES = frozenset({"protocol", "fingerprint", "state", "topology", "position", "feed"})
_NO_SERVICE_S = 5.0  # before a first connection: how long a path where nothing listens is retried


class FeedClient:
    """An iterable of batches for one trainer rank, with ``state_dict()`` / ``load_state_dict()``.

    ``rank``/``world_size`` are the global ones; ``dp_rank``/``dp_world_size`` the data-parallel
    ones when tensor or context parallelism groups several ranks on one data-parallel rank
    (default: the global ones). Peers of a data-parallel rank receive the same batches.

    ``reconnect_timeout_s``: how long to wait for a service that was reached and went away
    (before the first connection, a path where nothing listens fails after about 5 s).
    ``trusted_uid``: a service running as this other uid is accepted (default: only the
    user's own); anything else raises `omnifeed.loader.service.UntrustedServiceError`.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        dp_rank: int | None = None,
        dp_world_size: int | None = None,
        grad_accum: int = 1,
        index_fingerprint: str | None = None,
        reconnect_timeout_s: float = 300.0,
        request_timeout_s: float | None = None,
        lr_rule: LrRule = "linear",
        trusted_uid: int | None = None,
    ) -> None:
        self.address = address or default_socket()
        self.trusted_uid = trusted_uid
        self._set_topology(rank, world_size, dp_rank, dp_world_size, grad_accum)
        self.index_fingerprint = index_fingerprint
        self.lr_rule: LrRule = lr_rule
        self._plan_shape: tuple[int, float | None] | None = None  # (batch size, cost budget) from the service
        self._resumed_from: str | None = None  # digest of the state last loaded: "the job resumed from this checkpoint"
        self._attempt: str | None = None  # the service's name for the run since then (kept across reconnections)
        self.reconnect_timeout_s, self.request_timeout_s = reconnect_timeout_s, request_timeout_s
        self._feed: Feed | None = None
        self._sock: socket.socket | None = None
        self._state: dict[str, Any] | None = None
        self._handoff = Handoff()  # segments mapped, batches the trainer holds and dropped
        self._service = ""  # batch numbers belong to one service process: a release must not reach another
        self._token = uuid.uuid4().hex  # this client, across its reconnections
        self.waited_s = 0.0
        self.reconnects = 0
        self._reached = False  # a service welcomed this client once: from then on, wait for it to come back
        self._first_failure: float | None = None  # when the first attempt before that failed
        self._told_busy = False
        self._closed = False

    def _set_topology(
        self, rank: int, world_size: int, dp_rank: int | None, dp_world_size: int | None, grad_accum: int
    ) -> None:
        dp_world_size = world_size if dp_world_size is None else dp_world_size
        dp_rank = rank if dp_rank is None else dp_rank
        if (
            not 0 <= dp_rank < dp_world_size
            or not 0 <= rank < world_size
            or world_size % dp_world_size
            or grad_accum < 1
        ):
            raise ValueError(
                f"rank {rank} of {world_size}, data-parallel rank {dp_rank} of {dp_world_size}, "
                f"accumulation {grad_accum}: ranks must be inside their world sizes, the world a "
                "multiple of the data-parallel size, accumulation at least 1"
            )
        self.rank, self.world_size, self.dp_rank, self.dp_world_size = rank, world_size, dp_rank, dp_world_size
        self.grad_accum = grad_accum

    @classmethod
    def from_torchrun_env(
        cls,
        address: str | None = None,
        *,
        config: ServiceConfig | str | Path | None = None,
        tensor_parallel: int = 1,
        grad_accum: int = 1,
        lr_rule: LrRule = "linear",
        **options: Any,
    ) -> FeedClient:
        """A client for this torchrun worker: ``WORLD_SIZE``, ``RANK`` (and ``LOCAL_RANK``) from the environment.

        Ranks ``tensor_parallel`` apart in a row form one data-parallel rank (peers get the same
        batches). With ``config`` the feed runs in this process instead of a service. After an
        elastic restart at another world size, ``load_state_dict(checkpoint)`` performs the
        resize and returns its `TopologyHints` (torchrun restarts every worker on any membership
        change, and its restart count does not count joins: the world size in the saved state is
        what tells a resize).
        """
        try:
            world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        except KeyError as exc:
            raise RuntimeError(
                f"{exc.args[0]} is not set: run under torchrun, or build FeedClient(rank=, world_size=)"
            ) from None
        if world % tensor_parallel:
            raise ValueError(f"WORLD_SIZE {world} is not a multiple of tensor_parallel {tensor_parallel}")
        dp_rank, dp_world = rank // tensor_parallel, world // tensor_parallel
        if config is not None:
            return cls.in_process(
                config,
                rank=rank,
                world_size=world,
                dp_rank=dp_rank,
                dp_world_size=dp_world,
                grad_accum=grad_accum,
                lr_rule=lr_rule,
                round_token=torchrun_round(os.environ),
            )
        return cls(
            address,
            rank=rank,
            world_size=world,
            dp_rank=dp_rank,
            dp_world_size=dp_world,
            grad_accum=grad_accum,
            lr_rule=lr_rule,
            **options,
        )

    @classmethod
    def in_process(
        cls,
        config: ServiceConfig | str | Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        dp_rank: int | None = None,
        dp_world_size: int | None = None,
        grad_accum: int = 1,
        lr_rule: LrRule = "linear",
        round_token: str | None = None,
    ) -> FeedClient:
        """The same interface over a feed in this process (tests, single-process jobs): no service needed.

        Its audit log has the service's attempts and resume markers (`AttemptFeed`); ``round_token``
        names this (re)start alike on every rank (``from_torchrun_env`` takes torchrun's; None: each
        client its own attempt with one data-parallel rank, no attempts with several).
        """
        config = config if isinstance(config, ServiceConfig) else ServiceConfig.from_yaml(config)
        client = cls(
            config.socket,
            rank=rank,
            world_size=world_size,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            grad_accum=grad_accum,
            lr_rule=lr_rule,
        )
        client._feed = AttemptFeed(
            config.index,
            config.feed,
            world_size=client.dp_world_size,
            rank=client.dp_rank,
            grad_accum=grad_accum,
            round_token=round_token,
            audit_log=config.audit_log if client.rank == client._first_peer() else None,
        )
        return client

    def _first_peer(self) -> int:
        """The lowest global rank of this data-parallel rank's group (the one that audits in-process)."""
        group = self.world_size // self.dp_world_size
        return self.rank - self.rank % group if group > 1 else self.rank

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        start = self.epoch

        def batches() -> Iterator[dict[str, Any]]:
            while not (self._position().accum_done == 0 and self.epoch > start):
                yield self.next_batch()

        return batches()

    def __len__(self) -> int:
        """Micro-batches this rank receives in the epoch in progress from here (what ``iter(client)`` yields).

        At an epoch's start, the whole epoch's share. The service plans the rest of the epoch (no data read).
        Before the first batch is asked for, the question goes over a connection of its own that says no hello:
        asking the length opens no stream, so the service starts producing nothing for this rank.
        """
        if self._feed is not None:
            return len(self._feed)
        deadline = time.monotonic() + self.reconnect_timeout_s
        request = {
            "op": "length",
            "state": self._state,
            "dp_world_size": self.dp_world_size,
            "grad_accum": self.grad_accum,
        }
        while True:
            try:
                if self._sock is not None:
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

    @property
    def epoch(self) -> int:
        """Epoch of the next batch this client will yield."""
        return self._position().epoch

    def _position(self) -> FeedPosition:
        """Where the client is: the in-process feed's position, or the last state the service sent, read."""
        return self._feed.position if self._feed is not None else FeedPosition.from_dict(self._current_state())

    def next_batch(self) -> dict[str, Any]:
        """The next batch of this rank (crossing epochs freely); waits for, and reconnects to, the service."""
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._feed is not None:
            return self._feed.next_batch()
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
                self.waited_s += time.perf_counter() - started
            except (OSError, EOFError, ServiceError) as exc:
                self._lost(exc, deadline)
                continue
            self._state = message["state"]
            batch: dict[str, Any] = message["batch"]
            return batch

    # -- connection ------------------------------------------------------------------------
    def _connected(self, deadline: float) -> socket.socket:
        while self._sock is None:
            try:
                self._sock = self._hello()
            except (OSError, EOFError, ServiceError) as exc:
                self._lost(exc, deadline)
        return self._sock

    def _hello(self) -> socket.socket:
        sock = connect(self.address, self.request_timeout_s, self.trusted_uid)
        try:
            hello = {
                "op": "hello",
                "protocol": PROTOCOL,
                "pid": os.getpid(),
                "rank": self.rank,
                "world_size": self.world_size,
                "dp_rank": self.dp_rank,
                "dp_world_size": self.dp_world_size,
                "grad_accum": self.grad_accum,
                "state": self._state,
                "resume": self._resumed_from,
                "attempt": self._attempt,
                "token": self._token,
                "index_fingerprint": self.index_fingerprint,
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
        self._state = welcome["state"]
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
        time.sleep(delay)

    def _drop_connection(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def _current_state(self) -> dict[str, Any]:
        if self._state is None:
            self._connected(time.monotonic() + self.reconnect_timeout_s)
        assert self._state is not None
        return self._state

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The client's data state: the feed state after the last batch it yielded (``Feed.state_dict()``'s format)."""
        if self._feed is not None:
            return self._feed.state_dict()
        return dict(self._current_state())

    def load_state_dict(self, state: Mapping[str, Any]) -> TopologyHints | None:
        """Continue from ``state``; saved at another data-parallel size or accumulation, it is a resize: its hints.

        The service checks the state at once (another index or batching config is refused,
        naming both fingerprints).
        """
        position = FeedPosition.from_dict(state)
        saved = (position.world_size, position.grad_accum)
        if self._feed is not None:
            self._feed.load_state_dict(state)
        else:
            self._goodbye()
            self._state = dict(state)
            self._resumed_from = checkpoint_digest(state)
            self._attempt = None
            self._connected(time.monotonic() + self.reconnect_timeout_s)
        if saved == (self.dp_world_size, self.grad_accum):
            return None
        return self._hints(*saved)

    def resize(
        self,
        world_size: int,
        rank: int,
        *,
        dp_world_size: int | None = None,
        dp_rank: int | None = None,
        grad_accum: int | None = None,
    ) -> TopologyHints:
        """Continue at another world size (at a step boundary; else `FeedError`): what it means, as hints.

        Batches already taken stay valid. Later batches are this rank's share of the rest of
        the plan at the new size: nothing skipped, nothing repeated across all ranks.
        """
        position = self._position()
        if position.accum_done:
            raise FeedError(
                f"resize at a step boundary: {position.accum_done} of {self.grad_accum} micro-batches of "
                f"step {position.step} are delivered; finish the step first"
            )
        previous = (self.dp_world_size, self.grad_accum)
        self._set_topology(rank, world_size, dp_rank, dp_world_size, grad_accum or self.grad_accum)
        if self._feed is not None:
            self._feed.resize(self.dp_world_size, self.dp_rank, self.grad_accum)
        else:
            self._goodbye()
            self._connected(time.monotonic() + self.reconnect_timeout_s)
        return self._hints(*previous)

    def _hints(self, previous_world_size: int, previous_grad_accum: int) -> TopologyHints:
        if self._feed is not None:
            batch_size, budget = self._feed.plan.config.batch_size, self._feed.plan.budget
        else:
            assert self._plan_shape is not None
            batch_size, budget = self._plan_shape
        return topology_hints(
            world_size=self.dp_world_size,
            previous_world_size=previous_world_size,
            grad_accum=self.grad_accum,
            previous_grad_accum=previous_grad_accum,
            topology_version=self._position().topology_version,
            micro_batch_samples=None if budget is not None else batch_size,
            micro_batch_cost=budget,
            lr_rule=self.lr_rule,
        )

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Say goodbye and disconnect (idempotent); batches the trainer still holds stay valid."""
        if self._closed:
            return
        self._closed = True
        if self._feed is not None:
            self._feed.close()
            return
        self._goodbye()

    def _goodbye(self) -> None:
        """Say goodbye and disconnect (batches the trainer still holds stay valid)."""
        if self._sock is not None:
            try:
                send(self._sock, {"op": "bye", "release": self._handoff.released_to(self._service)})
                receive(self._sock, MAX_REPLY_BYTES)
            except (OSError, EOFError, ProtocolError):
                pass
            self._drop_connection()

    def __enter__(self) -> FeedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
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
