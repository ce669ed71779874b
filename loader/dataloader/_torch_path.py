"""The torch path of the drop-in loader: a user dataset through omnifeed's resumable iterators.

``TorchPath`` makes the loader's iterators (``SingleProcessIterator``, ``WorkerPoolIterator``) from its
``LoaderSettings``, keeps the latest epoch's progress for ``state_dict()``, a loaded state for the next
``iter()`` and the loader's metrics. ``ElasticPath`` (``_elastic_path``) extends it. ``TorchIterators``
wraps either for DataPipes, which keep torch's own iterators and have no state.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch.utils.data

from ._iterators import LoaderIterator, LoaderMetrics, SingleProcessIterator, draw_base_seed
from ._sampling import IndexStream
from ._settings import LoaderSettings
from ._state import EpochProgress, WorkerCountError, parse_state
from ._torchdata_state import from_torchdata_state, is_torchdata_state, needs_torchdata_shuffle, torchdata_shuffle
from ._worker_pool import WorkerPoolIterator


class TorchPath:
    """A user dataset (map-style or iterable) through omnifeed's iterators, resumable mid-epoch."""

    def __init__(self) -> None:
        self._metrics = LoaderMetrics()
        self._progress: EpochProgress | None = None  # the latest epoch's progress
        self._pending: EpochProgress | None = None  # a loaded state, for the next iter()
        self._live: weakref.ReferenceType[LoaderIterator] | None = None
        self._refusal: WorkerCountError | None = None  # a loaded state for another num_workers: iter() raises it
        self._torchdata_draw = False  # a loaded StatefulDataLoader state: its iterator draws a base seed it discards

    def __getstate__(self) -> dict[str, Any]:
        """The loader pickles with its path, as torch's loader does: without the weak reference to the live iterator."""
        state = self.__dict__.copy()
        state["_live"] = None
        return state

    # -- iteration ---------------------------------------------------------------------------
    def iterate(self, loader: Any) -> Any:
        """The next epoch's iterator, or the loaded state's (a deferred ``WorkerCountError`` is raised here)."""
        return self._start(loader, self._take_pending(loader))

    def _take_pending(self, loader: Any) -> EpochProgress | None:
        """The loaded state the next iterator resumes (taken once), or None."""
        if self._refusal is not None:
            raise self._refusal
        resume, self._pending = self._pending, None
        if self._torchdata_draw and resume is not None:  # as StatefulDataLoader does, for the RNG streams after it
            draw_base_seed(loader.generator)
        self._torchdata_draw = False
        return resume

    def _live_iterator(self) -> LoaderIterator | None:
        return self._live() if self._live is not None else None

    def _start(self, loader: Any, resume: EpochProgress | None) -> Any:
        """A new iterator resuming ``resume``, or the persistent workers' one restarted."""
        if loader.persistent_workers and loader.num_workers > 0:
            current = loader._iterator
            if isinstance(current, WorkerPoolIterator) and resume is None and not current.closed:
                self._progress = current.restart()
                return current
            if isinstance(current, LoaderIterator):
                current.close()
            loader._iterator = loader._get_iterator(resume)
            return loader._iterator
        return loader._get_iterator(resume)

    def new_iterator(self, loader: Any, resume: EpochProgress | None = None) -> LoaderIterator:
        """An iterator of the loader's settings as they are now, continuing ``resume`` when given."""
        iterator: LoaderIterator
        if loader.num_workers == 0:
            iterator = SingleProcessIterator(loader_settings(loader), self._metrics, resume)
        else:
            if loader.num_workers != getattr(loader, "_checked_workers", None):  # warn once per count, not per epoch
                loader.check_worker_number_rationality()
                object.__setattr__(loader, "_checked_workers", loader.num_workers)
            iterator = WorkerPoolIterator(loader_settings(loader), self._metrics, resume)
        self._progress = iterator.progress
        self._live = weakref.ref(iterator)
        return iterator

    def length(self, loader: Any) -> int:
        """torch's ``len()``."""
        return torch.utils.data.DataLoader.__len__(loader)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self, loader: Any) -> dict[str, Any]:
        """The latest epoch's progress (or a loaded one), or a fresh start's."""
        progress = self._pending or self._progress
        if progress is None:
            stream = IndexStream(loader._index_sampler, loader.generator)
            progress = EpochProgress(
                loader.num_workers, status="fresh", snapshot=stream.idle_snapshot(), replay=stream.idle_replay()
            )
        return progress.state()

    def load_state_dict(self, loader: Any, state: Mapping[str, Any]) -> None:
        """Check and convert ``state``, then apply it (see ``DataLoader.load_state_dict``)."""
        # everything is checked and converted before anything changes: a refused state leaves the loader as it was
        foreign = bool(state) and is_torchdata_state(state)
        if foreign:
            state = self._from_torchdata(loader, state)
        # StatefulDataLoader's shuffle, from its checkpoint or an own state saved after loading one
        shuffle = torchdata_shuffle(loader) if state and needs_torchdata_shuffle(state) else None
        try:
            progress = (
                None if not state else parse_state(state, num_workers=loader.num_workers, iterable=loader._is_iterable)
            )
        except WorkerCountError as exc:  # raised by the next iter(), as torchdata's; the state is not applied
            self.close(loader)
            self._refusal, self._pending, self._progress, self._torchdata_draw = exc, None, None, False
            return
        if progress is not None:
            self._check(progress)
        if progress is not None and progress.status != "running" and progress.replay is not None:
            # between epochs: the generators as they were when the state was saved, now, so that a script that
            # reseeds them before the next epoch (as it did in the saved run) still does (all or none of them)
            index_sampler = shuffle.index_sampler if shuffle is not None else loader._index_sampler
            IndexStream(index_sampler, loader.generator).restore_generators(progress.replay)
        if shuffle is not None:
            shuffle.give_to(loader)
        self.close(loader)
        self._refusal, self._torchdata_draw = None, foreign
        self._pending = progress
        self._progress = progress

    def _from_torchdata(self, loader: Any, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """A StatefulDataLoader checkpoint as this loader's state."""
        return from_torchdata_state(state, loader)

    def _check(self, progress: EpochProgress) -> None:
        """Refuse a parsed state this path cannot continue (nothing to check here)."""

    def resize(self, loader: Any, world_size: int, rank: int) -> None:
        """``ValueError``: only the elastic and the index paths deal across ranks."""
        raise ValueError(
            "resize() needs the elastic path: construct the DataLoader with world_size= and rank= "
            "(omnifeed then deals the dataset across ranks itself, without a DistributedSampler)"
        )

    # -- lifecycle and metrics ----------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """The loader's counters."""
        return self._metrics.snapshot()

    def close(self, loader: Any) -> None:
        """Close the live iterator and the persistent one."""
        for iterator in (self._live_iterator(), loader._iterator):
            if isinstance(iterator, LoaderIterator):
                iterator.close()
        loader._iterator = None


class TorchIterators:
    """A DataPipe dataset: torch's own iterators and no state; length, resize, metrics, close are ``inner``'s."""

    def __init__(self, inner: TorchPath) -> None:
        self._inner = inner

    def iterate(self, loader: Any) -> Any:
        """torch's ``iter()`` (which calls ``loader._get_iterator()``, hence ``new_iterator``)."""
        return torch.utils.data.DataLoader.__iter__(loader)

    def new_iterator(self, loader: Any, resume: EpochProgress | None = None) -> Any:
        """torch's iterator."""
        return torch.utils.data.DataLoader._get_iterator(loader)

    def length(self, loader: Any) -> int:
        """The inner path's ``len()``."""
        return self._inner.length(loader)

    def state_dict(self, loader: Any) -> dict[str, Any]:
        """``TypeError``: a DataPipe has no state here."""
        raise _no_state("state_dict")

    def load_state_dict(self, loader: Any, state: Mapping[str, Any]) -> None:
        """``TypeError``: a DataPipe has no state here."""
        raise _no_state("load_state_dict")

    def resize(self, loader: Any, world_size: int, rank: int) -> None:
        """The inner path's ``resize``."""
        self._inner.resize(loader, world_size, rank)

    def metrics(self) -> dict[str, Any]:
        """The inner path's counters."""
        return self._inner.metrics()

    def close(self, loader: Any) -> None:
        """The inner path's ``close``."""
        self._inner.close(loader)


def _no_state(what: str) -> TypeError:
    return TypeError(
        f"{what}() is not supported for DataPipe datasets (deprecated in torch); "
        "wrap the data in a Dataset or IterableDataset"
    )


def loader_settings(loader: Any) -> LoaderSettings:
    """What a new iterator reads of ``loader`` (torch's attributes, as they are now)."""
    return LoaderSettings(
        dataset=loader.dataset,
        iterable=loader._is_iterable,
        auto_collation=loader._auto_collation,
        index_sampler=loader._index_sampler,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        persistent_workers=loader.persistent_workers,
        in_order=loader.in_order,
        generator=loader.generator,
        pin_memory=loader.pin_memory,
        pin_memory_device=loader.pin_memory_device,
        iterable_len_called=loader._IterableDataset_len_called,
        snapshot_every_n_steps=loader.snapshot_every_n_steps,
    )
