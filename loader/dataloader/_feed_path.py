"""The index path of the drop-in loader: an omnifeed index and a ``FeedConfig`` behind torch's surface.

``DataLoader(index, feed_config=FeedConfig(...), world_size=, rank=)`` iterates a ``Feed``: per-modality
decode pools, plan order, length bucketing. ``open_feed`` checks torch's arguments and opens the feed;
``FeedPath``, the loader's ``DeliveryPath`` (``_delivery``), sets the attributes torch's constructor would
and makes ``iter()``, ``len()``, ``state_dict``, ``load_state_dict``, ``resize``, ``metrics`` and ``close``
the feed's. Batching, shuffling and decode workers come from the config, so torch's arguments for them must
keep their defaults.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _DatasetKind

from ..feed import Feed, FeedConfig, open_feed_index
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
            f"(plan.batch_size, plan.shuffle, plan.drop_last, pools): drop {', '.join(changed)} "
            "from the DataLoader call"
        )
    if (world_size is None) != (rank is None):
        raise ValueError("give both world_size= and rank= (or neither, for one rank)")
    mixture = feed_config is not None and feed_config.plan.mixture is not None
    if not isinstance(dataset, (SampleIndex, str, os.PathLike)) and not (dataset is None and mixture):
        raise TypeError(
            f"feed_config needs an omnifeed index (a SampleIndex or its directory; None with plan.mixture), "
            f"got {type(dataset).__name__}"
        )
    index = open_feed_index(dataset if isinstance(dataset, (SampleIndex, type(None))) else Path(dataset), feed_config)
    return Feed(index, feed_config or FeedConfig(), world_size=world_size or 1, rank=rank or 0)


class FeedPath:
    """The index path: ``iter()``, ``len()``, state, ``resize``, ``metrics`` and ``close`` are the feed's."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed

    def set_torch_attributes(self, loader: Any, pin: bool, pin_device: str) -> None:
        """The attributes torch's constructor would set on ``loader``, describing the feed."""
        plan = self.feed.plan.config
        loader.dataset = self.feed.index
        loader.batch_size = plan.batch_size if plan.bucketing is None else None
        loader.drop_last = plan.drop_last
        loader.sampler, loader.batch_sampler, loader.generator, loader.collate_fn = None, None, None, None
        loader.num_workers, loader.prefetch_factor, loader.timeout, loader.worker_init_fn = 0, None, 0, None
        loader.multiprocessing_context = None
        loader.pin_memory, loader.pin_memory_device = pin, pin_device
        loader.persistent_workers, loader.in_order = False, True
        loader._dataset_kind = _DatasetKind.Map
        loader._IterableDataset_len_called = None
        loader._iterator = None
        loader._DataLoader__initialized = True  # torch's freeze of batch_size, sampler, dataset, ...

    def iterate(self, loader: Any) -> Iterator[dict[str, Any]]:
        """The feed's batches of one epoch, pinned when ``loader.pin_memory`` and an accelerator exists."""
        pin = loader.pin_memory
        if pin and not torch.accelerator.is_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,
            )
            pin = False
        batches = iter(self.feed)
        if not pin:
            return batches
        device = torch.accelerator.current_accelerator()
        return (pin_memory(batch, device.type if device is not None else None) for batch in batches)

    def new_iterator(self, loader: Any, resume: Any = None) -> Iterator[dict[str, Any]]:
        """The feed's batches (the feed keeps its own position)."""
        return self.iterate(loader)

    def length(self, loader: Any) -> int:
        """This rank's batches left in the feed's epoch in progress (fixed-size batches only)."""
        plan = self.feed.plan
        if plan.bucketing is not None:
            raise TypeError(
                "len() is unknown with bucketing: micro-batches are filled to a cost budget, so their "
                "number is only known once the epoch is planned; count steps with the plan instead"
            )
        return self.feed.position.micro_batches_left(plan)

    def state_dict(self, loader: Any) -> dict[str, Any]:
        """The feed's state."""
        return self.feed.state_dict()

    def load_state_dict(self, loader: Any, state: Mapping[str, Any]) -> None:
        """The feed continues from ``state``."""
        self.feed.load_state_dict(state)

    def resize(self, loader: Any, world_size: int, rank: int) -> None:
        """The feed re-deals the rest of the epoch."""
        self.feed.resize(world_size, rank)

    def metrics(self) -> dict[str, Any]:
        """The feed's metrics."""
        return self.feed.metrics()

    def close(self, loader: Any) -> None:
        """Stop the feed's threads (idempotent)."""
        loader._iterator = None
        self.feed.close()
