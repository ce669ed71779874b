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

The client keeps the rank's topology, the resize rules and the hints; its batches come from one
`BatchSource` (``_sources.py``): `ServiceSource` (the connection, ``_service_source.py``) or
`FeedSource` (``in_process``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omnifeed.loader import FeedError
from omnifeed.loader.feed import FeedPosition
from omnifeed.loader.service import ServiceConfig, default_socket

from ._attempt_feed import AttemptFeed, torchrun_round
from ._hints import LrRule, TopologyHints, topology_hints
from ._service_source import ServiceSource
from ._sources import BatchSource, FeedSource, Topology


class FeedClient:
    """An iterable of batches for one trainer rank, with ``state_dict()`` / ``load_state_dict()``.

    ``rank``/``world_size`` are the global ones; ``dp_rank``/``dp_world_size`` the data-parallel
    ones when tensor or context parallelism groups several ranks on one data-parallel rank
    (default: the global ones). Peers of a data-parallel rank receive the same batches.

    ``reconnect_timeout_s``: how long to wait for a service that was reached and went away
    (before the first connection, a path where nothing listens fails after about 5 s).
    ``trusted_uid``: a service running as this other uid is accepted (default: only the
    user's own); anything else raises `omnifeed.loader.service.UntrustedServiceError`.
    ``receive_ahead``: batches received from the service ahead of the trainer, on a thread of the
    client's, while the trainer computes (0: each on the trainer's thread when it asks); batches
    received and never yielded (a resize, a resume, ``close()``) are given back to the service.
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
        receive_ahead: int = 1,
    ) -> None:
        if receive_ahead < 0:
            raise ValueError(f"receive_ahead must be 0 or more, not {receive_ahead}")
        self.address = address or default_socket()
        self.trusted_uid = trusted_uid
        self._set_topology(rank, world_size, dp_rank, dp_world_size, grad_accum)
        self.lr_rule: LrRule = lr_rule
        self.reconnect_timeout_s, self.request_timeout_s = reconnect_timeout_s, request_timeout_s
        self._source: BatchSource = ServiceSource(
            self.address,
            self._topology(),
            index_fingerprint=index_fingerprint,
            reconnect_timeout_s=reconnect_timeout_s,
            request_timeout_s=request_timeout_s,
            trusted_uid=trusted_uid,
            receive_ahead=receive_ahead,
        )
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

    def _topology(self) -> Topology:
        return Topology(self.rank, self.world_size, self.dp_rank, self.dp_world_size, self.grad_accum)

    @property
    def index_fingerprint(self) -> str | None:
        """The index's fingerprint: the one given, or the service's once connected (in-process: None)."""
        return self._source.index_fingerprint

    @property
    def waited_s(self) -> float:
        """Seconds spent waiting for the service's batches (in-process: 0)."""
        return self._source.waited_s

    @property
    def reconnects(self) -> int:
        """Times the connection to the service was lost or refused and retried (in-process: 0)."""
        return self._source.reconnects

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
        collate_ahead: int = 1,
    ) -> FeedClient:
        """The same interface over a feed in this process (tests, single-process jobs): no service needed.

        ``collate_ahead``: batches taken from the feed and collated ahead of the trainer on a thread of the
        client's (0: on the trainer's thread, in ``next()``); position, state and audit records follow the batches
        yielded.

        Its audit log has the service's attempts and resume markers (`AttemptFeed`); ``round_token``
        names this (re)start alike on every rank (``from_torchrun_env`` takes torchrun's; None: each
        client its own attempt with one data-parallel rank, no attempts with several).
        """
        if collate_ahead < 0:
            raise ValueError(f"collate_ahead must be 0 or more, not {collate_ahead}")
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
        client._source = FeedSource(
            AttemptFeed(
                config.index,
                config.feed,
                world_size=client.dp_world_size,
                rank=client.dp_rank,
                grad_accum=grad_accum,
                round_token=round_token,
                audit_log=config.audit_log if client.rank == client._first_peer() else None,
            ),
            collate_ahead,
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
            source = self._source  # a trainer's loop calls this once a batch: few look-ups after a step's cold caches
            while True:
                position = source.position
                if position.accum_done == 0 and position.epoch > start:
                    return
                if self._closed:
                    raise RuntimeError("the client is closed")
                yield source.next_batch()

        return batches()

    def __len__(self) -> int:
        """Micro-batches this rank receives in the epoch in progress from here (what ``iter(client)`` yields).

        At an epoch's start, the whole epoch's share. The service plans the rest of the epoch (no data read).
        Before the first batch is asked for, the question goes over a connection of its own that says no hello:
        asking the length opens no stream, so the service starts producing nothing for this rank.
        """
        return len(self._source)

    @property
    def epoch(self) -> int:
        """Epoch of the next batch this client will yield."""
        return self._source.position.epoch

    def next_batch(self) -> dict[str, Any]:
        """The next batch of this rank (crossing epochs freely); waits for, and reconnects to, the service."""
        if self._closed:
            raise RuntimeError("the client is closed")
        return self._source.next_batch()

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The client's data state: the feed state after the last batch it yielded (``Feed.state_dict()``'s format)."""
        return self._source.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, allow_mixture_change: bool = False) -> TopologyHints | None:
        """Continue from ``state``; saved at another data-parallel size or accumulation, it is a resize: its hints.

        The service checks the state at once (another index or batching config is refused,
        naming both fingerprints; a state of other mixture weights or phases too, unless
        ``allow_mixture_change``: then each source goes on from its position under the new ones).
        """
        position = FeedPosition.from_dict(state)
        saved = (position.world_size, position.grad_accum)
        self._source.load_state_dict(state, allow_mixture_change=allow_mixture_change)
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
        position = self._source.position
        if position.accum_done:
            raise FeedError(
                f"resize at a step boundary: {position.accum_done} of {self.grad_accum} micro-batches of "
                f"step {position.step} are delivered; finish the step first"
            )
        previous = (self.dp_world_size, self.grad_accum)
        self._set_topology(rank, world_size, dp_rank, dp_world_size, grad_accum or self.grad_accum)
        self._source.resize(self._topology())
        return self._hints(*previous)

    def _hints(self, previous_world_size: int, previous_grad_accum: int) -> TopologyHints:
        batch_size, budget = self._source.plan_shape
        return topology_hints(
            world_size=self.dp_world_size,
            previous_world_size=previous_world_size,
            grad_accum=self.grad_accum,
            previous_grad_accum=previous_grad_accum,
            topology_version=self._source.position.topology_version,
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
        self._source.close()

    def __enter__(self) -> FeedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
