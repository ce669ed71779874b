"""Where a `FeedClient`'s batches come from: the `BatchSource` protocol, and `FeedSource`, a feed in this process.

`FeedClient` holds one source and delegates to it: `FeedSource` (``FeedClient.in_process``) or
`ServiceSource` (``_service_source.py``, the node's service over its socket). A source is given the
rank's `Topology` and yields that rank's batches; the client keeps the topology checks, the resize
rules and the hints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from omnifeed.loader import Feed
from omnifeed.loader.feed import FeedPosition


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
    """The batches of a feed in this process (``FeedClient.in_process``): no waiting, no connection."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.waited_s = 0.0
        self.reconnects = 0
        self.index_fingerprint: str | None = None

    def next_batch(self) -> dict[str, Any]:
        """The feed's next batch."""
        return self.feed.next_batch()

    @property
    def position(self) -> FeedPosition:
        """The feed's position."""
        return self.feed.position

    def __len__(self) -> int:
        """The feed's micro-batches left in the epoch in progress."""
        return len(self.feed)

    def state_dict(self) -> dict[str, Any]:
        """The feed's state."""
        return self.feed.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Load ``state`` into the feed."""
        self.feed.load_state_dict(state, allow_mixture_change=allow_mixture_change)

    def resize(self, topology: Topology) -> None:
        """Deal the feed's following steps to the data-parallel ranks of ``topology``."""
        self.feed.resize(topology.dp_world_size, topology.dp_rank, topology.grad_accum)

    @property
    def plan_shape(self) -> tuple[int, float | None]:
        """The feed's plan's batch size and budget."""
        return self.feed.plan.config.batch_size, self.feed.plan.budget

    def close(self) -> None:
        """Close the feed."""
        self.feed.close()
