"""`DataLoader`: torch's DataLoader, resumable mid-epoch, elastic across ranks, with a faster hand-off.

It subclasses ``torch.utils.data.DataLoader`` and runs torch's own constructor, so arguments,
validation errors, attributes (and which of them are frozen), ``len()`` and ``isinstance`` checks are
torch's. Only the iterators are omnifeed's (``_iterators``, ``_worker_pool``): they record what each
epoch delivered, so ``state_dict()`` / ``load_state_dict()`` resume exactly, and workers hand batches
over through reused shared memory (``_handoff``). An iterator is given the loader's ``LoaderSettings``
(``_settings``), never the loader itself.

Keyword-only extras after torch's arguments:

- ``snapshot_every_n_steps``: torchdata's ``StatefulDataLoader`` argument, with its meaning: workers report
  their dataset states around every n-th batch (never with 0; every batch with 1 or None), and a mid-epoch
  ``state_dict()`` is the last snapshot plus the batches since, fetched again and dropped on resume.
- ``world_size``, ``rank``, ``shuffle_seed``: the elastic path. omnifeed deals a map-style dataset
  across ranks itself (no ``DistributedSampler``): ``ElasticBatchSampler``. ``resize(world_size, rank)``
  re-deals the rest of the epoch; every sample is delivered exactly once per epoch across resizes.
- ``feed_config``: the index path. ``dataset`` is an omnifeed index (``SampleIndex`` or its directory)
  and batches come from a ``Feed`` (per-modality decode pools, caches, bucketing).

The constructor chooses the path once, as a collaborator behind ``DeliveryPath`` (``_delivery``), and
``iter()``, ``len()``, ``state_dict``, ``load_state_dict``, ``resize``, ``metrics`` and ``close`` delegate
to it, passing the loader: ``TorchPath`` (``_torch_path``: omnifeed's iterators, the epoch's progress, the
metrics), ``ElasticPath`` (``_elastic_path``: a ``TorchPath`` over an ``ElasticBatchSampler``),
``TorchIterators`` (DataPipes: torch's own iterators, no state) and ``FeedPath`` (``_feed_path``).

See ``docs/migration.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch.utils.data
from torch.utils.data import Dataset, IterDataPipe, MapDataPipe, Sampler
from torch.utils.data.dataloader import _DatasetKind

from ..feed import FeedConfig
from ..index import SampleIndex
from ._delivery import DeliveryPath
from ._elastic_path import ElasticPath, elastic_sampler
from ._feed_path import FeedPath, is_index, open_feed
from ._state import EpochProgress
from ._torch_path import TorchIterators, TorchPath

T_co = TypeVar("T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """``torch.utils.data.DataLoader`` with ``state_dict``/``load_state_dict``, ``resize`` and ``metrics``."""

    def __init__(
        self,
        dataset: Dataset[T_co] | SampleIndex | str | os.PathLike[str] | None,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        snapshot_every_n_steps: int | None = 1,
        world_size: int | None = None,
        rank: int | None = None,
        shuffle_seed: int = 0,
        feed_config: FeedConfig | None = None,
    ) -> None:
        if snapshot_every_n_steps is not None and (
            not isinstance(snapshot_every_n_steps, int) or snapshot_every_n_steps < 0
        ):
            raise ValueError(
                f"snapshot_every_n_steps must be a non-negative integer or None, got {snapshot_every_n_steps!r}"
            )
        self.snapshot_every_n_steps = snapshot_every_n_steps
        torch_args = {
            "batch_size": batch_size,
            "shuffle": shuffle,
            "sampler": sampler,
            "batch_sampler": batch_sampler,
            "num_workers": num_workers,
            "collate_fn": collate_fn,
            "drop_last": drop_last,
            "timeout": timeout,
            "worker_init_fn": worker_init_fn,
            "multiprocessing_context": multiprocessing_context,
            "generator": generator,
            "prefetch_factor": prefetch_factor,
            "persistent_workers": persistent_workers,
            "in_order": in_order,
        }
        self._path: DeliveryPath
        if is_index(dataset, feed_config):
            feed_path = FeedPath(open_feed(dataset, feed_config, world_size, rank, torch_args))
            feed_path.set_torch_attributes(self, pin_memory, pin_memory_device)
            self._path = feed_path
            return
        path = TorchPath()
        if world_size is not None or rank is not None:
            dealer = elastic_sampler(dataset, torch_args, world_size, rank, shuffle_seed)
            torch_args.update(batch_size=1, shuffle=None, sampler=None, batch_sampler=dealer, drop_last=False)
            path = ElasticPath(dealer)
        super().__init__(
            dataset,  # type: ignore[arg-type]
            pin_memory=pin_memory,
            pin_memory_device=pin_memory_device,
            **torch_args,
        )
        object.__setattr__(self, "_checked_workers", self.num_workers)  # torch's constructor warned about this count
        if isinstance(path, ElasticPath):  # torch clears these when given a batch sampler; report what was asked
            object.__setattr__(self, "batch_size", batch_size)
            object.__setattr__(self, "drop_last", drop_last)
        # DataPipes keep torch's own iterators (and have no state here)
        self._path = TorchIterators(path) if isinstance(self.dataset, (IterDataPipe, MapDataPipe)) else path

    # -- iteration ---------------------------------------------------------------------------
    @property
    def _is_iterable(self) -> bool:
        return bool(self._dataset_kind == _DatasetKind.Iterable)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._path.iterate(self)

    def _get_iterator(self, resume: EpochProgress | None = None) -> Any:  # type: ignore[override]
        return self._path.new_iterator(self, resume)

    def __len__(self) -> int:
        return self._path.length(self)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: a small dict (JSON-friendly when the dataset's and sampler's states are).

        ``load_state_dict`` of it, in this or a new process, makes the next ``iter()`` yield exactly the
        batches an uninterrupted run would have yielded next. Keys: see ``loader/dataloader/_state.py``
        (the index path returns the feed's state).
        """
        return self._path.state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state`` at the next ``iter()``; ``{}`` resets to a fresh start (as torchdata's).

        A state saved between epochs puts the loader's and samplers' generators back at once. A torchdata
        ``StatefulDataLoader`` state (recognised by its keys) continues as StatefulDataLoader would from it
        (``_torchdata_state``); with ``shuffle=True`` the loader then shuffles as StatefulDataLoader does.

        Raises ``ValueError`` for a state of another kind; one that needs the same ``num_workers`` makes the next
        ``iter()`` raise ``WorkerCountError`` (a ``ValueError`` and, as torchdata's, an ``AssertionError``); on the
        elastic path ``StateMismatchError`` for a state of another dataset length or batching. A refused state leaves
        the loader as it was (a deferred ``WorkerCountError`` replaces what was loaded before, and nothing else).
        ``state`` is not modified.
        """
        self._path.load_state_dict(self, state)

    def resize(self, world_size: int, rank: int) -> None:
        """Deal the rest of the epoch (and later ones) to ``world_size`` ranks, this one being ``rank``.

        Takes effect at once, also in the middle of a ``for`` loop: batches already prefetched for the
        old dealing are dropped and nothing delivered is dealt again. Every rank must resize at the
        same step. Needs the elastic path (``world_size=``/``rank=`` at construction) or an index.
        """
        self._path.resize(self, world_size, rank)

    # -- lifecycle and metrics ----------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Batches yielded, batches/s, time the consumer waited, and batches handed over through shared memory."""
        return self._path.metrics()

    def close(self) -> None:
        """Stop worker processes (persistent ones too) or the feed's threads (idempotent)."""
        self._path.close(self)

    def __enter__(self) -> DataLoader[T_co]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
