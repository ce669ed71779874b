"""The elastic path of the drop-in loader: ``world_size=``/``rank=``, a map-style dataset dealt by omnifeed.

``elastic_sampler`` checks torch's arguments and builds the ``ElasticBatchSampler`` that torch's constructor
is given as the batch sampler. ``ElasticPath`` is the torch path (``TorchPath``) with what dealing adds: an
``iter()`` during an epoch continues where delivery stopped, ``len()`` counts the batches this rank has left,
``resize`` re-deals the rest of the epoch at once, and a state must fit the dataset and batching.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import IterableDataset

from ._elastic import ElasticBatchSampler
from ._state import EpochProgress
from ._torch_path import TorchPath


class ElasticPath(TorchPath):
    """The torch path over an ``ElasticBatchSampler``: resumable, resizable, every sample once per epoch."""

    def __init__(self, sampler: ElasticBatchSampler) -> None:
        super().__init__()
        self._sampler = sampler

    def iterate(self, loader: Any) -> Any:
        """The next epoch's iterator; during an epoch, one that continues where delivery stopped."""
        resume = self._take_pending(loader)
        if resume is None and self._progress is not None and self._progress.status == "running":
            live = self._live_iterator()
            if live is not None and live is loader._iterator:
                self._rewind()
                live.redeal()
                return live
            resume = self._progress
            if live is not None:
                live.close()
        return self._start(loader, resume)

    def length(self, loader: Any) -> int:
        """This rank's batches in the epoch: those delivered plus those left to deal."""
        progress = self._pending or self._progress
        if progress is not None and progress.status == "running" and progress.snapshot is not None:
            return progress.yielded + self._sampler.steps_left(progress.snapshot["sampler"])
        return len(self._sampler)

    def _from_torchdata(self, loader: Any, state: Mapping[str, Any]) -> Mapping[str, Any]:
        raise ValueError(
            "a StatefulDataLoader checkpoint has no elastic dealing: load it into a DataLoader "
            "built without world_size/rank"
        )

    def _check(self, progress: EpochProgress) -> None:
        if progress.snapshot is not None:
            self._sampler.check_state(progress.snapshot["sampler"])  # another dataset or batching: refuse now

    def resize(self, loader: Any, world_size: int, rank: int) -> None:
        """Re-deal the rest of the epoch; a live iterator drops what it prefetched for the old dealing."""
        self._sampler.resize(world_size, rank)
        self._rewind()
        live = self._live_iterator()
        if live is not None and not live.closed and self._progress is not None and self._progress.status == "running":
            live.redeal()

    def _rewind(self) -> None:
        """Put the sampler back to the last delivered batch (prefetching ran ahead of it)."""
        progress = self._pending or self._progress
        if progress is None or progress.snapshot is None:
            return
        self._sampler.rewind(progress.snapshot["sampler"])
        progress.snapshot = {"sampler": self._sampler.state_dict(), "iterator": None}


def elastic_sampler(
    dataset: Any, args: dict[str, Any], world_size: int | None, rank: int | None, shuffle_seed: int
) -> ElasticBatchSampler:
    """The sampler of the elastic path, or ``ValueError`` saying which argument does not fit it."""
    if world_size is None or rank is None:
        raise ValueError("give both world_size= and rank= for the elastic path")
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            "world_size/rank deal a map-style dataset's indices across ranks; an IterableDataset "
            "shards itself (read your rank and torch.utils.data.get_worker_info() in its __iter__)"
        )
    if args["sampler"] is not None or args["batch_sampler"] is not None:
        raise ValueError(
            "with world_size/rank omnifeed deals the indices across ranks itself: drop sampler= and "
            "batch_sampler= (no DistributedSampler is needed)"
        )
    if args["batch_size"] is None:
        raise ValueError("the elastic path deals micro-batches: give a batch_size")
    if not args["in_order"]:
        raise ValueError(
            "the elastic path delivers steps in plan order: in_order=False is not supported with world_size/rank"
        )
    return ElasticBatchSampler(
        len(dataset),
        args["batch_size"],
        world_size=world_size,
        rank=rank,
        seed=shuffle_seed,
        shuffle=bool(args["shuffle"]),
        drop_last=args["drop_last"],
        fingerprint=f"{type(dataset).__module__}.{type(dataset).__qualname__}:{len(dataset)}",
    )
