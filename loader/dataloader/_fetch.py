"""`BatchFetcher`: one task's index into a collated batch, by torch's rules, with the dataset's state.

Map-style: ``dataset.__getitems__(indices)`` when the dataset has it, else ``dataset[i]`` for each
index (or ``dataset[index]`` without batching). Iterable: the next ``batch_size`` items of the
dataset's iterator; a short last batch is kept unless ``drop_last``; ``StopIteration`` once exhausted.
The state after a batch is ``{"dataset": dataset.state_dict(), "iterator": iterator.state_dict()}``
for the parts that have one (torchdata's ``Stateful`` protocol), or None when neither has.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.utils.data._utils.worker as torch_worker
from torch.utils.data import default_collate, default_convert

from ._sampling import has_state

_TORCH_COLLATES = (default_collate, default_convert)


class BatchFetcher:
    """Fetches and collates batches of one dataset replica (in a worker or the main process)."""

    def __init__(self, dataset: Any, *, iterable: bool, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 drop_last: bool, state: Mapping[str, Any] | None = None, ended: bool = False,
                 in_worker: bool = False) -> None:
        self.dataset = dataset
        self.iterable = iterable
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.ended = ended  # an iterable dataset ran out (a resumed worker may have before the state was saved)
        # torch's collates put tensors in new shared memory inside a worker; the hand-off copies them
        # into reused segments instead, so let them allocate ordinary memory there.
        self._plain_collate = in_worker and any(collate_fn is c for c in _TORCH_COLLATES)
        if state is not None and state.get("dataset") is not None:
            dataset.load_state_dict(copy.deepcopy(state["dataset"]))
        # the state the epoch starts from (before ``iter(dataset)``), kept by the main process; None without one
        self.initial_state = ({"dataset": dataset.state_dict(), "iterator": None}
                              if has_state(dataset) and not in_worker else None)
        self._iterator: Iterator[Any] | None = None
        if iterable:
            self._iterator = iter(dataset)
            if state is not None and state.get("iterator") is not None and has_state(self._iterator):
                self._iterator.load_state_dict(copy.deepcopy(state["iterator"]))  # type: ignore[union-attr]
        self.stateful = has_state(dataset) or (self._iterator is not dataset and has_state(self._iterator))

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
        return {
            "dataset": self.dataset.state_dict() if has_state(self.dataset) else None,
            "iterator": iterator.state_dict() if iterator is not None and iterator is not self.dataset  # type: ignore[attr-defined]
            and has_state(iterator) else None,
        }
