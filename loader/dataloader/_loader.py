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

See ``docs/migration.md``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch.utils.data
from torch.utils.data import Dataset, IterableDataset, IterDataPipe, MapDataPipe, Sampler
from torch.utils.data.dataloader import _DatasetKind

from ..feed import Feed, FeedConfig
from ..index import SampleIndex
from ._elastic import ElasticBatchSampler
from ._feed_path import feed_batches, feed_steps_left, is_index, open_feed
from ._iterators import LoaderIterator, LoaderMetrics, SingleProcessIterator, draw_base_seed
from ._sampling import IndexStream
from ._settings import LoaderSettings
from ._state import EpochProgress, WorkerCountError, parse_state
from ._torchdata_state import from_torchdata_state, is_torchdata_state, needs_torchdata_shuffle, torchdata_shuffle
from ._worker_pool import WorkerPoolIterator

T_co = TypeVar("T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """``torch.utils.data.DataLoader`` with ``state_dict``/``load_state_dict``, ``resize`` and ``metrics``."""

    def __init__(
        self,
        dataset: Dataset[T_co] | SampleIndex | str | os.PathLike[str],
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
        self._metrics = LoaderMetrics()
        self._progress: EpochProgress | None = None  # the latest epoch's progress
        self._pending: EpochProgress | None = None  # a loaded state, for the next iter()
        self._live: weakref.ReferenceType[LoaderIterator] | None = None
        self._feed: Feed | None = None
        self._elastic: ElasticBatchSampler | None = None
        self._refusal: WorkerCountError | None = (
            None  # a loaded state for another num_workers: the next iter() raises it
        )
        self._torchdata_draw = False  # a loaded StatefulDataLoader state: its iterator draws a base seed it discards
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
        if is_index(dataset, feed_config):
            self._feed = open_feed(dataset, feed_config, world_size, rank, torch_args)
            self._init_attributes_for_feed(self._feed, pin_memory, pin_memory_device)
            return
        if world_size is not None or rank is not None:
            self._elastic = _elastic_sampler(dataset, torch_args, world_size, rank, shuffle_seed)
            torch_args.update(batch_size=1, shuffle=None, sampler=None, batch_sampler=self._elastic, drop_last=False)
        super().__init__(dataset, pin_memory=pin_memory, pin_memory_device=pin_memory_device, **torch_args)  # type: ignore[arg-type]
        object.__setattr__(self, "_checked_workers", self.num_workers)  # torch's constructor warned about this count
        if self._elastic is not None:  # torch clears these when given a batch sampler; report what was asked
            object.__setattr__(self, "batch_size", batch_size)
            object.__setattr__(self, "drop_last", drop_last)

    def _init_attributes_for_feed(self, feed: Feed, pin_memory: bool, pin_memory_device: str) -> None:
        """The attributes torch's constructor would set, describing the feed."""
        plan = feed.plan.config
        self.dataset = feed.index  # type: ignore[assignment]
        self.batch_size = plan.batch_size if plan.bucketing is None else None
        self.drop_last = plan.drop_last
        self.sampler, self.batch_sampler, self.generator, self.collate_fn = None, None, None, None  # type: ignore[assignment]
        self.num_workers, self.prefetch_factor, self.timeout, self.worker_init_fn = 0, None, 0, None
        self.multiprocessing_context = None
        self.pin_memory, self.pin_memory_device = pin_memory, pin_memory_device
        self.persistent_workers, self.in_order = False, True
        self._dataset_kind = _DatasetKind.Map
        self._IterableDataset_len_called = None
        self._iterator = None
        self._DataLoader__initialized = True  # torch's freeze of batch_size, sampler, dataset, ...

    # -- iteration ---------------------------------------------------------------------------
    @property
    def _is_iterable(self) -> bool:
        return bool(self._dataset_kind == _DatasetKind.Iterable)

    @property
    def _datapipe(self) -> bool:
        return isinstance(self.dataset, (IterDataPipe, MapDataPipe))

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self._feed is not None:
            return feed_batches(self._feed, self.pin_memory)
        if self._datapipe:  # DataPipes keep torch's own iterators (and have no state here)
            return super().__iter__()
        if self._refusal is not None:
            raise self._refusal
        resume, self._pending = self._pending, None
        if self._torchdata_draw and resume is not None:  # as StatefulDataLoader does, for the RNG streams after it
            draw_base_seed(self.generator)
        self._torchdata_draw = False
        live = self._live() if self._live is not None else None
        if (
            self._elastic is not None
            and resume is None
            and self._progress is not None
            and self._progress.status == "running"
        ):  # the elastic path continues where delivery stopped
            if live is not None and live is self._iterator:
                self._rewind_elastic()
                live.redeal()
                return live
            resume = self._progress
            if live is not None:
                live.close()
        if self.persistent_workers and self.num_workers > 0:
            current = self._iterator
            if isinstance(current, WorkerPoolIterator) and resume is None and not current.closed:
                self._progress = current.restart()
                return current
            if isinstance(current, LoaderIterator):
                current.close()
            self._iterator = self._get_iterator(resume)
            return self._iterator
        return self._get_iterator(resume)

    def _get_iterator(self, resume: EpochProgress | None = None) -> Any:  # type: ignore[override]
        if self._datapipe:
            return super()._get_iterator()
        iterator: LoaderIterator
        if self.num_workers == 0:
            iterator = SingleProcessIterator(self._settings(), self._metrics, resume)
        else:
            if self.num_workers != getattr(self, "_checked_workers", None):  # warn once per count, not per epoch
                self.check_worker_number_rationality()
                object.__setattr__(self, "_checked_workers", self.num_workers)
            iterator = WorkerPoolIterator(self._settings(), self._metrics, resume)
        self._progress = iterator.progress
        self._live = weakref.ref(iterator)
        return iterator

    def _settings(self) -> LoaderSettings:
        """What a new iterator reads of this loader (torch's attributes, as they are now)."""
        return LoaderSettings(
            dataset=self.dataset,
            iterable=self._is_iterable,
            auto_collation=self._auto_collation,
            index_sampler=self._index_sampler,
            collate_fn=self.collate_fn,
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            timeout=self.timeout,
            worker_init_fn=self.worker_init_fn,
            multiprocessing_context=self.multiprocessing_context,
            persistent_workers=self.persistent_workers,
            in_order=self.in_order,
            generator=self.generator,
            pin_memory=self.pin_memory,
            pin_memory_device=self.pin_memory_device,
            iterable_len_called=self._IterableDataset_len_called,
            snapshot_every_n_steps=self.snapshot_every_n_steps,
        )

    def __len__(self) -> int:
        if self._feed is not None:
            return feed_steps_left(self._feed)
        if self._elastic is not None:
            progress = self._pending or self._progress
            if progress is not None and progress.status == "running" and progress.snapshot is not None:
                return progress.yielded + self._elastic.steps_left(progress.snapshot["sampler"])
            return len(self._elastic)
        return super().__len__()

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: a small dict (JSON-friendly when the dataset's and sampler's states are).

        ``load_state_dict`` of it, in this or a new process, makes the next ``iter()`` yield exactly the
        batches an uninterrupted run would have yielded next. Keys: see ``loader/dataloader/_state.py``
        (the index path returns the feed's state).
        """
        if self._feed is not None:
            return self._feed.state_dict()
        self._refuse_datapipe("state_dict")
        progress = self._pending or self._progress
        if progress is None:
            stream = IndexStream(self._index_sampler, self.generator)
            progress = EpochProgress(
                self.num_workers, status="fresh", snapshot=stream.idle_snapshot(), replay=stream.idle_replay()
            )
        return progress.state()

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
        if self._feed is not None:
            self._feed.load_state_dict(state)
            return
        self._refuse_datapipe("load_state_dict")
        # everything is checked and converted before anything changes: a refused state leaves the loader as it was
        foreign = bool(state) and is_torchdata_state(state)
        if foreign:
            if self._elastic is not None:
                raise ValueError(
                    "a StatefulDataLoader checkpoint has no elastic dealing: load it into a DataLoader "
                    "built without world_size/rank"
                )
            state = from_torchdata_state(state, self)
        # StatefulDataLoader's shuffle, from its checkpoint or an own state saved after loading one
        shuffle = torchdata_shuffle(self) if state and needs_torchdata_shuffle(state) else None
        try:
            progress = (
                None if not state else parse_state(state, num_workers=self.num_workers, iterable=self._is_iterable)
            )
        except WorkerCountError as exc:  # raised by the next iter(), as torchdata's; the state is not applied
            self._close_iterators()
            self._refusal, self._pending, self._progress, self._torchdata_draw = exc, None, None, False
            return
        if self._elastic is not None and progress is not None and progress.snapshot is not None:
            self._elastic.check_state(progress.snapshot["sampler"])  # another dataset or batching: refuse now
        if progress is not None and progress.status != "running" and progress.replay is not None:
            # between epochs: the generators as they were when the state was saved, now, so that a script that
            # reseeds them before the next epoch (as it did in the saved run) still does (all or none of them)
            index_sampler = shuffle.index_sampler if shuffle is not None else self._index_sampler
            IndexStream(index_sampler, self.generator).restore_generators(progress.replay)
        if shuffle is not None:
            shuffle.give_to(self)
        self._close_iterators()
        self._refusal, self._torchdata_draw = None, foreign
        self._pending = progress
        self._progress = progress

    def resize(self, world_size: int, rank: int) -> None:
        """Deal the rest of the epoch (and later ones) to ``world_size`` ranks, this one being ``rank``.

        Takes effect at once, also in the middle of a ``for`` loop: batches already prefetched for the
        old dealing are dropped and nothing delivered is dealt again. Every rank must resize at the
        same step. Needs the elastic path (``world_size=``/``rank=`` at construction) or an index.
        """
        if self._feed is not None:
            self._feed.resize(world_size, rank)
            return
        if self._elastic is None:
            raise ValueError(
                "resize() needs the elastic path: construct the DataLoader with world_size= and rank= "
                "(omnifeed then deals the dataset across ranks itself, without a DistributedSampler)"
            )
        self._elastic.resize(world_size, rank)
        self._rewind_elastic()
        live = self._live() if self._live is not None else None
        if live is not None and not live.closed and self._progress is not None and self._progress.status == "running":
            live.redeal()

    def _rewind_elastic(self) -> None:
        """Put the elastic sampler back to the last delivered batch (prefetching ran ahead of it)."""
        progress = self._pending or self._progress
        if self._elastic is None or progress is None or progress.snapshot is None:
            return
        self._elastic.rewind(progress.snapshot["sampler"])
        progress.snapshot = {"sampler": self._elastic.state_dict(), "iterator": None}

    def _refuse_datapipe(self, what: str) -> None:
        if self._datapipe:
            raise TypeError(
                f"{what}() is not supported for DataPipe datasets (deprecated in torch); "
                "wrap the data in a Dataset or IterableDataset"
            )

    # -- lifecycle and metrics ----------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Batches yielded, batches/s, time the consumer waited, and batches handed over through shared memory."""
        if self._feed is not None:
            return self._feed.metrics()
        return self._metrics.snapshot()

    def _close_iterators(self) -> None:
        live = self._live() if self._live is not None else None
        for iterator in (live, self._iterator):
            if isinstance(iterator, LoaderIterator):
                iterator.close()
        self._iterator = None

    def close(self) -> None:
        """Stop worker processes (persistent ones too) or the feed's threads (idempotent)."""
        self._close_iterators()
        if self._feed is not None:
            self._feed.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickles as torch's loader does: without the weak reference to the live iterator."""
        state = self.__dict__.copy()
        state["_live"] = None
        return state

    def __enter__(self) -> DataLoader[T_co]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _elastic_sampler(
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
