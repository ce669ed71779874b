"""What the plan deals: a micro-batch (epoch, place, window, sample positions, cost) and a window's micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from omnifeed.bucketing import Pack

_NOTHING = np.empty(0, dtype=np.int64)
_NOTHING.flags.writeable = False

LengthSource = Callable[[np.ndarray], Mapping[str, np.ndarray]]
"""Positions -> the index's length columns (``text_tokens``, ``image_width``, ...) at those positions."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: its epoch, its place in that epoch, its window, its sample positions.

    ``cost`` is its padded cost under the cost model (its size for fixed batching, its
    tokens for a pack); ``pack`` holds segment boundaries in packing mode; ``ends_epoch`` is
    true for the epoch's last micro-batch.
    """

    epoch: int
    index: int
    window: int
    positions: np.ndarray
    cost: float
    pack: Pack | None = None
    ends_epoch: bool = False


@dataclass(frozen=True)
class WindowPlan:
    """The micro-batches of one window, where the next window starts in the stream and what it carries there."""

    epoch: int
    window: int
    start: int
    budget: float | None
    micro_batches: tuple[MicroBatch, ...]
    next_start: int
    last: bool  # whether this window ends its epoch
    carry: np.ndarray = field(
        default_factory=lambda: _NOTHING
    )  # positions carried into the next window (never out of the last)
