"""Where a `FeedClient`'s batches come from: the `BatchSource` protocol, and `FeedSource`, a feed in this process.

`FeedClient` holds one source and delegates to it: `FeedSource` (``FeedClient.in_process``) or
`ServiceSource` (``_service_source.py``, the node's service over its socket). A source is given the
rank's `Topology` and yields that rank's batches; the client keeps the topology checks, the resize
rules and the hints.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from omnifeed.loader.feed import FeedPosition

from ._ahead import BatchesAhead
from ._attempt_feed import AttemptFeed


@dataclass(frozen=True)
class Topology:
    """A trainer rank's place: global and data-parallel rank and world size, and micro-batches per step."""

    rank: int
    world_size: int
    dp_rank: int
    dp_world_size: int
    grad_accum: int


class BatchSource(Protocol):
    """What `FeedClient` needs of where its batches come from."""

    reconnects: int  # connections lost and retried
    index_fingerprint: str | None  # the index's, once known

    def next_batch(self) -> dict[str, Any]:
        """The next batch of this rank (crossing epochs freely)."""
        ...

    @property
    def waited_s(self) -> float:
        """Seconds the trainer waited for batches."""
        ...

    @property
    def position(self) -> FeedPosition:
        """Where the source is: the position of the next batch."""
        ...

    def __len__(self) -> int:
        """Micro-batches this rank receives in the epoch in progress from here."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The feed state after the last batch taken (``Feed.state_dict()``'s format)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Continue from ``state`` (the source checks it; a state of other mixture weights only if allowed)."""
        ...

    def resize(self, topology: Topology) -> None:
        """Continue at ``topology`` (at a step boundary, checked by the client)."""
        ...

    @property
    def plan_shape(self) -> tuple[int, float | None]:
        """The plan's micro-batch size and cost budget (None: fixed-size batches)."""
        ...

    def close(self) -> None:
        """Let go of the feed or the connection (batches taken stay valid)."""
        ...


class FeedSource:
    """The batches of a feed in this process (``FeedClient.in_process``): no connection.

    The next ``collate_ahead`` batches are taken and collated on a thread of their own (`BatchesAhead`),
    so the trainer's ``next()`` is a queue pop, not a micro-batch collated on its thread (~1.3 ms of CPU
    for the mix's batches of 8, more while the decode threads want the interpreter lock). The position,
    the state and the audit log's records follow the batches yielded; those made ahead and not yielded
    when the feed is moved (a resize, a load) or closed are dropped and the feed rewound past them: they
    come again, decoded again.
    """

    def __init__(self, feed: AttemptFeed, collate_ahead: int = 1) -> None:
        self.feed = feed
        self.reconnects = 0
        self.index_fingerprint: str | None = None
        self._position = feed.position  # after the last batch yielded
        self._ahead = BatchesAhead(self._collated, collate_ahead, "omnifeed-collate-ahead") if collate_ahead else None
        feed.defer_records = self._ahead is not None

    def _collated(self) -> tuple[dict[str, Any], FeedPosition, list[tuple[FeedPosition, dict[str, Any]]]]:
        batch = self.feed.next_batch()
        return batch, self.feed.position, self.feed.take_deferred()

    def next_batch(self) -> dict[str, Any]:
        """The feed's next batch."""
        if self._ahead is None:
            batch = self.feed.next_batch()
            self._position = self.feed.position
            return batch
        batch, self._position, records = self._ahead.take()
        for before, record in records:
            self.feed.log_delivery(before, record)
        return batch

    @property
    def waited_s(self) -> float:
        """Seconds the trainer waited in ``next()`` for a batch made ahead (0 without a thread ahead)."""
        return self._ahead.waited_s if self._ahead is not None else 0.0

    @property
    def position(self) -> FeedPosition:
        """The position after the last batch yielded."""
        return self._position

    def __len__(self) -> int:
        """The feed's micro-batches left in the epoch in progress after the last batch yielded."""
        return self._position.micro_batches_left(self.feed.plan)

    def state_dict(self) -> dict[str, Any]:
        """The feed's state after the last batch yielded."""
        return self._position.to_dict()

    @contextmanager
    def _rewound(self) -> Iterator[None]:
        """Inside, nothing is made ahead and the feed is where the trainer is (batches made ahead dropped)."""
        if self._ahead is None:
            yield
            return
        with self._ahead.paused():
            if self._ahead.drain() or self.feed.position != self._position:
                self.feed.take_deferred()
                self.feed.seek(self._position)
            yield

    def load_state_dict(self, state: Mapping[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Load ``state`` into the feed."""
        with self._rewound():
            self.feed.load_state_dict(state, allow_mixture_change=allow_mixture_change)
            self._position = self.feed.position

    def resize(self, topology: Topology) -> None:
        """Deal the feed's following steps to the data-parallel ranks of ``topology``."""
        with self._rewound():
            self.feed.resize(topology.dp_world_size, topology.dp_rank, topology.grad_accum)
            self._position = self.feed.position

    @property
    def plan_shape(self) -> tuple[int, float | None]:
        """The feed's plan's batch size and budget."""
        return self.feed.plan.config.batch_size, self.feed.plan.budget

    def close(self) -> None:
        """Stop making batches ahead and close the feed."""
        if self._ahead is not None:
            with self._ahead.paused():
                self._ahead.stop()
        self.feed.close()
