"""The index path of the drop-in loader: an omnifeed index and a ``FeedConfig`` behind torch's surface.

``DataLoader(index, feed_config=FeedConfig(...), world_size=, rank=)`` iterates a ``Feed``: per-modality
decode pools, plan order, length bucketing; ``state_dict``, ``load_state_dict``, ``resize``, ``metrics``
and ``close`` are the feed's. Batching, shuffling and decode workers come from the config, so torch's
arguments for them must keep their defaults.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data._utils.pin_memory import pin_memory

from ..feed import Feed, FeedConfig
from ..index import SampleIndex

_TORCH_DEFAULTS: dict[str, Any] = {
    "batch_size": 1,
    "shuffle": None,
    "sampler": None,
    "batch_sampler": None,
    "num_workers": 0,
    "collate_fn": None,
    "drop_last": False,
    "timeout": 0,
    "worker_init_fn": None,
    "multiprocessing_context": None,
    "generator": None,
    "prefetch_factor": None,
    "persistent_workers": False,
    "in_order": True,
}


def is_index(dataset: Any, feed_config: FeedConfig | None) -> bool:
    """Whether the loader was given an omnifeed index (a ``SampleIndex``, a path, or a ``feed_config``)."""
    return feed_config is not None or isinstance(dataset, (SampleIndex, os.PathLike))


def open_feed(
    dataset: Any, feed_config: FeedConfig | None, world_size: int | None, rank: int | None, torch_args: dict[str, Any]
) -> Feed:
    """The feed of an index given to ``DataLoader``; ``ValueError`` for torch arguments it cannot take."""
    changed = [
        name
        for name, default in _TORCH_DEFAULTS.items()
        if torch_args[name] != default and not (name == "shuffle" and torch_args[name] is False)
    ]
    if changed:
        raise ValueError(
            f"with an omnifeed index, batching, shuffling and decode workers come from feed_config "
            f"(plan.batch_size, plan.shuffle, plan.drop_last, pools): drop {', '.join(changed)} from the DataLoader call"
        )
    if (world_size is None) != (rank is None):
        raise ValueError("give both world_size= and rank= (or neither, for one rank)")
    if not isinstance(dataset, (SampleIndex, str, os.PathLike)):
        raise TypeError(
            f"feed_config needs an omnifeed index (a SampleIndex or its directory), got {type(dataset).__name__}"
        )
    index = dataset if isinstance(dataset, SampleIndex) else SampleIndex(Path(dataset))
    return Feed(index, feed_config or FeedConfig(), world_size=world_size or 1, rank=rank or 0)


def feed_steps_left(feed: Feed) -> int:
    """This rank's batches left in the feed's epoch in progress (fixed-size batches only)."""
    plan = feed.plan
    if plan.bucketing is not None:
        raise TypeError(
            "len() is unknown with bucketing: micro-batches are filled to a cost budget, so their "
            "number is only known once the epoch is planned; count steps with the plan instead"
        )
    return feed.position.micro_batches_left(plan)


def feed_batches(feed: Feed, pin: bool) -> Iterator[dict[str, Any]]:
    """The feed's batches of one epoch, pinned when asked and an accelerator exists (torch's warning otherwise)."""
    if pin and not torch.accelerator.is_available():
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=3,
        )
        pin = False
    batches = iter(feed)
    if not pin:
        return batches
    device = torch.accelerator.current_accelerator()
    return (pin_memory(batch, device.type if device is not None else None) for batch in batches)
