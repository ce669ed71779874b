"""`LoaderSettings`: what an iterator reads of its DataLoader, fixed when the iterator is made.

The DataLoader builds one each time it makes an iterator (``DataLoader._settings()``); the iterators
(``_iterators``, ``_worker_pool``) take it instead of the loader, so no stage holds its owner. The
values are those torch's own iterators read from the loader in ``_BaseDataLoaderIter.__init__``, so
changing an attribute of the loader (``num_workers``, ``collate_fn``, ...) affects the next iterator,
not the running one; persistent workers keep the settings of the iterator that started them, as in
torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True, eq=False)
class LoaderSettings:
    """One iterator's view of its loader (torch's attributes of the same names, after its constructor).

    - ``dataset``: the dataset; ``iterable``: whether it is an ``IterableDataset`` (torch's dataset kind).
    - ``auto_collation``: whether batches are made by a batch sampler (torch's ``_auto_collation``);
      ``index_sampler``: the batch sampler if so, else the sampler (torch's ``_index_sampler``).
    - ``collate_fn``, ``drop_last``: as given to (or defaulted by) torch's constructor.
    - ``num_workers``, ``prefetch_factor`` (batches per worker in flight), ``timeout`` (seconds, 0 for
      none), ``worker_init_fn``, ``multiprocessing_context`` (a context object or None for torch's),
      ``persistent_workers``, ``in_order``: the worker settings.
    - ``generator``: where the worker base seed (and the default shuffle's seed) is drawn from; None for
      the global RNG.
    - ``pin_memory``, ``pin_memory_device``: as given (the iterator decides where to pin, with torch's
      warnings).
    - ``iterable_len_called``: ``len(dataloader)`` as last reported for an iterable dataset, or None
      (torch's ``_IterableDataset_len_called``: more batches than that warns).
    - ``snapshot_every_n_steps``: torchdata's argument; how often workers report their dataset states (``_state``).
    """

    dataset: Any
    iterable: bool
    auto_collation: bool
    index_sampler: Iterable[Any]
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    num_workers: int
    prefetch_factor: int | None
    timeout: float
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: Any
    persistent_workers: bool
    in_order: bool
    generator: torch.Generator | None
    pin_memory: bool
    pin_memory_device: str
    iterable_len_called: int | None
    snapshot_every_n_steps: int | None = 1
