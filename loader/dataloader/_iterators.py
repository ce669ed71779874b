"""The loader's iterators: what both share, and the one that loads in the main process.

An iterator runs one epoch (persistent workers: one epoch at a time): it starts the index stream,
draws the worker base seed from the loader's generator exactly where torch does, fetches batches, and
records its progress in an ``EpochProgress`` the loader keeps, so ``state_dict()`` works even after
the iterator is gone. An iterator never sees the loader: it takes the loader's ``LoaderSettings``
(``_settings``), the ``LoaderMetrics`` it counts into, and the progress to resume from; the loader
reads the progress back from ``iterator.progress`` (and ``restart()`` for persistent workers).
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data._utils.pin_memory import pin_memory

from ._fetch import BatchFetcher, restore_ended_iterator
from ._sampling import IndexStream
from ._settings import LoaderSettings
from ._state import EpochProgress

logger = logging.getLogger(__name__)


@dataclass
class LoaderMetrics:
    """Counters a loader keeps across its iterators."""

    batches: int = 0
    wait_s: float = 0.0
    shared_memory_batches: int = 0
    pickled_batches: int = 0
    started: float | None = None

    def snapshot(self) -> dict[str, Any]:
        """Batches yielded, their rate, time the consumer waited in ``next()``, and how batches crossed from workers."""
        elapsed = time.perf_counter() - self.started if self.started is not None else 0.0
        return {
            "batches": self.batches,
            "batches_per_s": self.batches / elapsed if elapsed > 0 else 0.0,
            "consumer_wait_s": self.wait_s,
            "handoff": {"shared_memory": self.shared_memory_batches, "pickled": self.pickled_batches},
        }


def draw_base_seed(generator: torch.Generator | None) -> int:
    """The worker base seed, drawn from ``generator`` (or the global RNG) as torch draws it."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _pin_memory_settings(settings: LoaderSettings) -> tuple[bool, str | None]:
    """Whether and where to pin, with torch's warnings."""
    if settings.pin_memory and settings.pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the device,"
            f"ignore pin_memory_device='{settings.pin_memory_device}'.",
            stacklevel=4,
        )
    if settings.pin_memory and not torch.accelerator.is_available():
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=4,
        )
    pin = settings.pin_memory and torch.accelerator.is_available()
    accelerator = torch.accelerator.current_accelerator() if pin else None
    device = accelerator.type if accelerator is not None else None
    if device == "mps":
        warnings.warn(
            "'pin_memory' argument is set as true but not supported on MPS now, device pinned memory won't be used.",
            stacklevel=4,
        )
        return False, None
    return pin, device


class LoaderIterator:
    """One epoch of a loader: ``next()`` gives the next batch; progress kept for ``state_dict()``.

    ``settings``: the loader's, as it makes this iterator; ``metrics``: the loader's counters, which this
    iterator adds to; ``resume``: the progress to continue (a loaded or interrupted epoch), or None.
    """

    def __init__(self, settings: LoaderSettings, metrics: LoaderMetrics, resume: EpochProgress | None) -> None:
        self._dataset = settings.dataset
        self._iterable = settings.iterable
        self._index_sampler = settings.index_sampler
        self._num_workers = settings.num_workers
        self._timeout = settings.timeout
        self._generator = settings.generator
        self._len_called = settings.iterable_len_called
        self._pin_memory, self._pin_memory_device = _pin_memory_settings(settings)
        self._metrics = metrics
        self._stream = IndexStream(self._index_sampler, settings.generator)
        self._profile_name = f"enumerate(DataLoader)#{type(self).__name__}.__next__"
        self._skip_batches = 0
        self.closed = False
        # the dataset objects live on into the next epoch (main process, persistent workers), carrying their state
        self._dataset_outlives_epoch = self._num_workers == 0 or settings.persistent_workers
        # persistent workers keep their base seed across epochs: torch draws none for a later epoch
        kept = (
            resume.base_seed
            if resume is not None and resume.status == "finished" and settings.persistent_workers
            else None
        )
        self._every = settings.snapshot_every_n_steps
        self.progress = self._begin(resume, kept)

    def _begin(self, resume: EpochProgress | None, base_seed: int | None) -> EpochProgress:
        """Start an epoch: fresh (drawing the base seed unless given) or where ``resume`` left off."""
        progress = self._begin_epoch(resume, base_seed)
        progress.every = self._every
        return progress

    def _begin_epoch(self, resume: EpochProgress | None, base_seed: int | None) -> EpochProgress:
        self._skip_batches = 0
        self.ended_iterators: list[Any] = []  # per worker: the iterator state a loaded epoch ended in
        workers = self._num_workers
        if resume is not None and resume.status == "running":
            refetch = (
                self._iterable
                and resume.yielded + resume.since_snapshot > 0
                and all(s is None for s in resume.datasets)
            )
            if not refetch:
                self._stream.begin(consumed=resume.consumed, replay=resume.replay, snapshot=resume.snapshot)
                resume.replay = self._stream.replay
                self._skip_batches, resume.since_snapshot = resume.since_snapshot, 0  # yielded after the snapshot
                return resume
            # an iterable dataset without state: replay the epoch from its start and drop what was yielded
            logger.warning(
                "the dataset has no state_dict/load_state_dict: resuming replays the %d batches of this "
                "epoch already yielded and drops them; give it those methods to resume directly",
                resume.yielded,
            )
            self._skip_batches = resume.yielded + resume.since_snapshot
            self._stream.begin(replay=resume.replay)
            return EpochProgress(workers, base_seed=resume.base_seed, replay=self._stream.replay)
        datasets: list[Any] = []
        if resume is not None:  # a state between epochs: start the next one where it would have started
            if resume.snapshot is not None:  # a stateful sampler
                self._stream.load_snapshot(resume.snapshot)
            if self._dataset_outlives_epoch:
                datasets = resume.next_epoch_datasets()
                if self._iterable:
                    self.ended_iterators = [s.get("iterator") if isinstance(s, dict) else None for s in resume.datasets]
            if workers == 0 and datasets and datasets[0] is not None:
                # the dataset object carries its state into the epoch, before the epoch's draws (as it did
                # in the saved run: a dataset's state may hold RNG state the draws then read)
                self._dataset.load_state_dict(copy.deepcopy(datasets[0]["dataset"]))
                datasets = []
            if workers == 0 and self.ended_iterators and self.ended_iterators[0] is not None:
                restore_ended_iterator(self._dataset, self.ended_iterators[0])
        start = self._stream.idle_snapshot()
        self._stream.begin(draws_base_seed=base_seed is None)
        seed = draw_base_seed(self._generator) if base_seed is None else base_seed
        if (
            workers
            and not self._dataset_outlives_epoch
            and getattr(self._index_sampler, "reiterated_by_workers", False)
        ):
            # StatefulDataLoader's shuffle (adopted from its checkpoint): its new worker iterator iterates the sampler
            # again after drawing the base seed, and the epoch takes that second permutation
            start = self._stream.idle_snapshot()
            self._stream.begin(draws_base_seed=False)
        return EpochProgress(workers, base_seed=seed, replay=self._stream.replay, snapshot=start, datasets=datasets)

    def __iter__(self) -> LoaderIterator:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        with torch.autograd.profiler.record_function(self._profile_name):
            started = time.perf_counter()
            if self._metrics.started is None:
                self._metrics.started = started
            try:
                if self.closed:
                    raise StopIteration
                while self._skip_batches:
                    self._next_data()
                    self._skip_batches -= 1
                data = self._next_data()
            except StopIteration:
                self.progress.status = "finished"
                if self.progress.snapshot is not None:  # a stateful sampler: its state between epochs
                    self.progress.snapshot = self._stream.idle_snapshot()
                self.progress.replay = self._stream.idle_replay()  # the generators, for the next epoch
                self._finished()
                raise
            finally:
                self._metrics.wait_s += time.perf_counter() - started
            self._metrics.batches += 1
            if self._iterable and self._len_called is not None and self.progress.yielded > self._len_called:
                message = (
                    f"Length of IterableDataset {self._dataset} was reported to be {self._len_called}"
                    f"(when accessing len(dataloader)), but {self.progress.yielded} samples have been fetched. "
                )
                if self._num_workers > 0:
                    message += (
                        "For multiprocessing data-loading, this could be caused by not properly configuring the "
                        "IterableDataset replica at each worker. Please see "
                        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
                    )
                warnings.warn(message, stacklevel=2)
            return data

    def _pin(self, data: Any) -> Any:
        return pin_memory(data, self._pin_memory_device) if self._pin_memory else data

    def _next_data(self) -> Any:
        raise NotImplementedError

    def _finished(self) -> None:
        """The epoch ended (hook for releasing workers)."""

    def redeal(self) -> None:
        """Drop what is in flight and continue from the last delivered batch (after a resize)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release workers, if any (idempotent); a closed iterator yields nothing more."""
        self.closed = True


class SingleProcessIterator(LoaderIterator):
    """Loads in the calling process (``num_workers=0``)."""

    def __init__(self, settings: LoaderSettings, metrics: LoaderMetrics, resume: EpochProgress | None) -> None:
        if settings.timeout != 0:
            raise AssertionError(
                "timeout applies to worker processes: with num_workers=0 set timeout=0 "
                "(torch raises this AssertionError too)"
            )
        super().__init__(settings, metrics, resume)
        self._fetcher = BatchFetcher(
            self._dataset,
            iterable=self._iterable,
            auto_collation=settings.auto_collation,
            collate_fn=settings.collate_fn,
            drop_last=settings.drop_last,
            state=self.progress.datasets[0],
            ended=self.progress.ended[0],
        )
        if self.progress.datasets[0] is None:  # what the epoch starts from, for a state saved before its first batch
            self.progress.datasets[0] = self._fetcher.initial_state

    def _next_data(self) -> Any:
        task, index = self._stream.pulled, self._stream.pull()
        while task in self.progress.also_yielded:  # yielded before the state was saved (in_order=False)
            task, index = self._stream.pulled, self._stream.pull()
        self.progress.dispatched(task, self._stream.snapshot())
        try:
            data = self._fetcher.fetch(index)
        except StopIteration:
            if self._iterable:
                self.progress.worker_ended(task, 0, self._fetcher.state())
            raise
        except BaseException:
            self.progress.delivered(task, 0, None, yielded=False)
            raise
        self.progress.delivered(task, 0, self._fetcher.state(), yielded=True, ended=self._fetcher.ended)
        return self._pin(data)

    def redeal(self) -> None:
        """Nothing is in flight without workers: later pulls already see the new dealing."""
