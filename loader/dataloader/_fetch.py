"""`BatchFetcher`: one task's index into a collated batch, by torch's rules, with the dataset's state.

Map-style: ``dataset.__getitems__(indices)`` when the dataset has it, else ``dataset[i]`` for each
index (or ``dataset[index]`` without batching). Iterable: the next ``batch_size`` items of the
dataset's iterator; a short last batch is kept unless ``drop_last``; ``StopIteration`` once exhausted.
The state after a batch is ``{"dataset": dataset.state_dict(), "iterator": iterator.state_dict()}``
for the parts that have one (torchdata's ``Stateful`` protocol), or None when neither has; a dataset that
is its own iterator is stored once, as the iterator (torchdata does the same).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.utils.data._utils.worker as torch_worker
from torch.utils.data import default_collate, default_convert

from ._sampling import has_state

_TORCH_COLLATES = (default_collate, default_convert)


def restore_ended_iterator(dataset: Any, state: Mapping[str, Any]) -> None:
    """Restore the state the last epoch's iterator ended in, into an iterator then dropped: what torchdata does with a
    state saved at an epoch's end before the next epoch's ``iter(dataset)``, so side effects (e.g. RNG state) carry."""
    ended = iter(dataset)
    if has_state(ended):
        ended.load_state_dict(copy.deepcopy(dict(state)))  # type: ignore[attr-defined]


class BatchFetcher:
    """Fetches and collates batches of one dataset replica (in a worker or the main process)."""

    def __init__(
        self,
        dataset: Any,
        *,
        iterable: bool,
        auto_collation: bool,
        collate_fn: Callable[[Any], Any],
        drop_last: bool,
        state: Mapping[str, Any] | None = None,
        ended: bool = False,
        in_worker: bool = False,
        ended_iterator: Mapping[str, Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.iterable = iterable
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.ended = ended  # an iterable dataset ran out (a resumed worker may have before the state was saved)
        # torch's collates put tensors in new shared memory inside a worker; the hand-off copies them
        # into reused segments instead, so let them allocate ordinary memory there.
        self._plain_collate = in_worker and any(collate_fn is c for c in _TORCH_COLLATES)
        # torchdata's order: the dataset's state, then ``iter(dataset)``, then the iterator's state (which is the
        # dataset's own when ``iter`` returns the dataset: it may hold no state before ``iter``)
        if state is not None and state.get("dataset") is not None:
            dataset.load_state_dict(copy.deepcopy(state["dataset"]))
        if iterable and ended_iterator is not None:
            restore_ended_iterator(dataset, ended_iterator)
        self._iterator: Iterator[Any] | None = None
        if iterable:
            self._iterator = iter(dataset)
            if state is not None and state.get("iterator") is not None and has_state(self._iterator):
                self._iterator.load_state_dict(copy.deepcopy(state["iterator"]))  # type: ignore[union-attr]
        self.stateful = has_state(dataset) or has_state(self._iterator)
        # the state the epoch starts from, kept by the main process; None without one
        self.initial_state = self.state() if not in_worker else None

    def fetch(self, index: Any) -> Any:
        """The collated batch of ``index``; ``StopIteration`` when an iterable dataset is exhausted."""
        if self.iterable:
            assert self._iterator is not None
            if self.ended:
                raise StopIteration
            if not self.auto_collation:
                return self._collate(next(self._iterator))
            data = []
            for _ in index:
                try:
                    data.append(next(self._iterator))
                except StopIteration:
                    self.ended = True
                    break
            if not data or (self.drop_last and len(data) < len(index)):
                raise StopIteration
            return self._collate(data)
        if not self.auto_collation:
            return self._collate(self.dataset[index])
        getitems = getattr(self.dataset, "__getitems__", None)
        return self._collate(getitems(index) if getitems else [self.dataset[i] for i in index])

    def _collate(self, data: Any) -> Any:
        if not self._plain_collate:
            return self.collate_fn(data)
        info = torch_worker._worker_info
        torch_worker._worker_info = None
        try:
            return self.collate_fn(data)
        finally:
            torch_worker._worker_info = info

    def state(self) -> dict[str, Any] | None:
        """The dataset's (and its iterator's) state now, or None when neither has one."""
        if not self.stateful:
            return None
        iterator = self._iterator
        own_iterator = iterator is self.dataset  # its state is stored once, as the iterator's
        # a copy: a state_dict() may return the dataset's live objects, which later batches change before the
        # reply carrying it is pickled (a worker's queue pickles in a background thread)
        return copy.deepcopy(
            {
                "dataset": self.dataset.state_dict() if has_state(self.dataset) and not own_iterator else None,
                "iterator": (
                    iterator.state_dict()  # type: ignore[attr-defined]
                    if iterator is not None and has_state(iterator)
                    else None
                ),
            }
        )
