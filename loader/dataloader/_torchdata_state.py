"""Loading a torchdata ``StatefulDataLoader`` checkpoint: its state layout mapped onto omnifeed's.

``DataLoader.load_state_dict`` recognises torchdata's layout by its keys (``_num_yielded`` without workers,
``_snapshot`` with them) and turns it into an omnifeed state (``_state``) that continues with the batches
``StatefulDataLoader`` gives after loading it:

- ``_num_yielded`` / ``_snapshot._snapshot_step`` → ``yielded``; ``_steps_since_snapshot`` → ``since_snapshot``;
  ``_iterator_finished`` → ``status``; ``_main_snapshot._base_seed`` → ``base_seed``; ``_num_workers`` →
  ``workers.count``; ``_last_yielded_worker_id`` → ``workers.next - 1``;
- ``_sampler_iter_yielded`` → ``sampler.consumed``; ``_index_sampler_state`` / ``_sampler_iter_state`` →
  ``sampler.snapshot`` (a stateful sampler, batch sampler or sampler iterator);
- ``dataset_state`` and ``fetcher_state.{dataset_iter_state, fetcher_ended}`` (per worker under
  ``_worker_snapshots.worker_N``) → ``workers.datasets[N].{dataset, iterator}`` and ``workers.ended[N]``.

``shuffle=True``: torchdata replaces torch's ``RandomSampler`` by its own, whose generator is seeded once and
whose iterator draws the epoch's permutation as it is created. Loading such a checkpoint gives the loader that
shuffle (``TorchdataShuffle``, ``TorchdataBatches``: ``loader.sampler`` / ``loader.batch_sampler`` are replaced),
so later epochs are StatefulDataLoader's too; its own states then carry the generator and reinstate the shuffle
in a new loader. The loader gets the shuffle only once the whole state is accepted (``ShuffleSwap``): a refused
state leaves it as it was. A random sampler without state mid-epoch is refused: StatefulDataLoader itself restarts it in
another order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler

from ._sampling import IndexStream, _unchanged, decode_rng, encode_rng
from ._state import STATE_FORMAT

SHUFFLE_KEY = "torchdata_shuffle"  # a TorchdataShuffle's state: the generator, base64


def is_torchdata_state(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` is in ``StatefulDataLoader``'s layout (single- or multi-process)."""
    return isinstance(state, Mapping) and ("_num_yielded" in state or "_snapshot" in state)


def _rng_text(value: Any) -> str:
    """A generator state from a checkpoint (torchdata's uint8 tensor, or this module's base64) as base64."""
    if isinstance(value, str):
        return value
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
        return encode_rng(value)
    raise ValueError(
        f"a StatefulDataLoader checkpoint's sampler generator state must be a uint8 tensor, got {type(value).__name__}"
    )


class _ShuffleIterator(Iterator[int]):
    """torchdata's ``_StatefulRandomSamplerIterator``: the permutation drawn at creation; state ``yielded``,
    ``generator``."""

    def __init__(self, sampler: TorchdataShuffle) -> None:
        self.sampler = sampler
        self.start = sampler.generator.get_state()
        self.yielded = 0
        self.perm = torch.randperm(len(sampler), generator=sampler.generator).tolist()

    def __next__(self) -> int:
        if self.yielded >= len(self.perm):
            raise StopIteration
        self.yielded += 1
        return int(self.perm[self.yielded - 1])

    def state_dict(self) -> dict[str, Any]:
        """``yielded`` this epoch and the generator's state (base64) at the epoch's start."""
        return {"yielded": self.yielded, "generator": encode_rng(self.start)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Redraw the epoch's permutation from its start state and skip what was yielded."""
        self.start = decode_rng(_rng_text(state["generator"]))
        self.sampler.generator.set_state(self.start)
        self.perm = torch.randperm(len(self.sampler), generator=self.sampler.generator).tolist()
        self.yielded = min(int(state["yielded"]), len(self.perm))


class TorchdataShuffle(Sampler[int]):
    """StatefulDataLoader's ``RandomSampler``: one permutation per epoch from a generator that lives across epochs."""

    reiterated_by_workers = True  # a new worker iterator of StatefulDataLoader iterates its sampler twice

    def __init__(self, data_source: Sized, generator: torch.Generator) -> None:
        self.data_source = data_source
        self.generator = generator

    def __len__(self) -> int:
        return len(self.data_source)

    def __iter__(self) -> _ShuffleIterator:
        return _ShuffleIterator(self)

    def state_dict(self) -> dict[str, Any]:
        """The generator's state (base64), which the next epoch's permutation is drawn from."""
        return {SHUFFLE_KEY: encode_rng(self.generator.get_state())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the generator back in ``state``'s state."""
        self.generator.set_state(decode_rng(_rng_text(state[SHUFFLE_KEY])))


class _BatchIterator(Iterator[list[int]]):
    """torchdata's ``_BatchSamplerIterator`` over a ``TorchdataShuffle`` (which it iterates at creation)."""

    def __init__(self, sampler: TorchdataShuffle, batch_size: int, drop_last: bool) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.inner = iter(sampler)
        self.samples_yielded = 0

    def __next__(self) -> list[int]:
        batch: list[int] = []
        for index in self.inner:
            batch.append(index)
            self.samples_yielded += 1
            if len(batch) == self.batch_size:
                return batch
        if not batch or self.drop_last:
            raise StopIteration
        return batch

    def state_dict(self) -> dict[str, Any]:
        """torchdata's keys: ``samples_yielded`` and the sampler iterator's state."""
        return {"samples_yielded": self.samples_yielded, "sampler_iter_state": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after ``samples_yielded`` samples of the epoch ``sampler_iter_state`` describes."""
        self.samples_yielded = int(state["samples_yielded"])
        self.inner = iter(self.sampler)
        self.inner.load_state_dict(state["sampler_iter_state"])


class TorchdataBatches(BatchSampler):
    """torchdata's ``BatchSampler`` over a ``TorchdataShuffle``; its state is the shuffle's generator."""

    sampler: TorchdataShuffle
    reiterated_by_workers = True

    def __iter__(self) -> _BatchIterator:  # type: ignore[override]
        return _BatchIterator(self.sampler, self.batch_size, self.drop_last)

    def state_dict(self) -> dict[str, Any]:
        """The shuffle's state."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the shuffle's state."""
        self.sampler.load_state_dict(state)


@dataclass(frozen=True)
class ShuffleSwap:
    """StatefulDataLoader's shuffle built for a loader and not yet given to it (``torchdata_shuffle``)."""

    sampler: TorchdataShuffle
    batch_sampler: TorchdataBatches | None

    @property
    def index_sampler(self) -> Sampler[Any]:
        """What the loader draws its tasks from once it has the shuffle (torch's ``_index_sampler``)."""
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    def give_to(self, loader: Any) -> None:
        """Replace ``loader.sampler`` (and ``loader.batch_sampler`` when it batches) by the shuffle."""
        object.__setattr__(loader, "sampler", self.sampler)  # torch freezes these attributes against user assignment
        if self.batch_sampler is not None:
            object.__setattr__(loader, "batch_sampler", self.batch_sampler)


def torchdata_shuffle(loader: Any) -> ShuffleSwap | None:
    """StatefulDataLoader's shuffle for ``loader`` (shuffle=True: torch's ``RandomSampler``), built without changing
    the loader; None when it has that shuffle already.

    The sampler keeps the loader's generator when it has one (as StatefulDataLoader's does), else gets its own.
    Raises ``ValueError`` when the loader samples otherwise.
    """
    if isinstance(loader.sampler, TorchdataShuffle):
        return None
    batching = loader.batch_sampler is not None
    if (
        not _unchanged(loader.sampler, RandomSampler)
        or loader.sampler.replacement
        or loader.sampler._num_samples is not None
        or (batching and not _unchanged(loader.batch_sampler, BatchSampler))
    ):
        raise ValueError(
            "this state shuffles as StatefulDataLoader(shuffle=True) does: load it into a DataLoader "
            "built with shuffle=True and no sampler or batch_sampler"
        )
    generator = loader.sampler.generator if loader.sampler.generator is not None else torch.Generator()
    sampler = TorchdataShuffle(loader.dataset, generator)
    return ShuffleSwap(sampler, TorchdataBatches(sampler, loader.batch_size, loader.drop_last) if batching else None)


def needs_torchdata_shuffle(state: Mapping[str, Any]) -> bool:
    """Whether an omnifeed state was written by a loader that had adopted StatefulDataLoader's shuffle."""
    sampler = state.get("sampler")
    snapshot = sampler.get("snapshot") if isinstance(sampler, Mapping) else None
    return (
        isinstance(snapshot, Mapping)
        and isinstance(snapshot.get("sampler"), Mapping)
        and SHUFFLE_KEY in snapshot["sampler"]
    )


def _is_shuffle_state(sampler_iter_state: Any) -> bool:
    """Whether a checkpoint's ``_sampler_iter_state`` is torchdata's (batched) ``RandomSampler`` iterator's."""
    inner = (
        sampler_iter_state.get("sampler_iter_state", sampler_iter_state)
        if isinstance(sampler_iter_state, Mapping)
        else None
    )
    return isinstance(inner, Mapping) and set(inner) == {"yielded", "generator"}


def _worker_dataset(worker: Any, iterable: bool) -> tuple[dict[str, Any] | None, bool]:
    """A torchdata worker state (``dataset_state``, ``fetcher_state``) as omnifeed's dataset entry and ``ended``."""
    if worker is None:
        return None, False
    fetcher = worker.get("fetcher_state") or {}
    dataset, iterator = worker.get("dataset_state"), fetcher.get("dataset_iter_state") if iterable else None
    entry = {"dataset": dataset, "iterator": iterator} if dataset is not None or iterator is not None else None
    return entry, bool(fetcher.get("fetcher_ended", False)) if iterable else False


def _shuffle_snapshot(loader: Any, sampler_iter_state: Mapping[str, Any], finished: bool) -> dict[str, Any]:
    """The adopted shuffle's snapshot for a checkpoint's ``RandomSampler`` iterator state: the generator after the
    epoch's permutation (where StatefulDataLoader's is once it has loaded the state), and mid-epoch the iterator's."""
    batched = "samples_yielded" in sampler_iter_state
    inner = dict(sampler_iter_state["sampler_iter_state"] if batched else sampler_iter_state)
    inner["generator"] = _rng_text(inner["generator"])
    generator = torch.Generator()
    generator.set_state(decode_rng(inner["generator"]))
    torch.randperm(len(loader.sampler), generator=generator)
    iterator = (
        {"samples_yielded": int(sampler_iter_state["samples_yielded"]), "sampler_iter_state": inner}
        if batched
        else inner
    )
    return {"sampler": {SHUFFLE_KEY: encode_rng(generator.get_state())}, "iterator": None if finished else iterator}


def _sampler_snapshot(loader: Any, main: Mapping[str, Any], consumed: int, finished: bool) -> dict[str, Any] | None:
    """The ``sampler.snapshot`` for a checkpoint's sampler states, given this loader's sampler; None where the
    order is restarted by skipping tasks. Raises ``ValueError`` where the checkpoint cannot continue exactly."""
    index_state, iter_state = main["_index_sampler_state"], main["_sampler_iter_state"]
    if _is_shuffle_state(iter_state):
        torchdata_shuffle(loader)  # refuses a loader that cannot take the shuffle; the caller gives it
        return _shuffle_snapshot(loader, iter_state, finished)
    stream = IndexStream(loader._index_sampler, loader.generator)
    torchdata_batches = isinstance(iter_state, Mapping) and "samples_yielded" in iter_state
    if stream.mode == "stateful":
        if not torchdata_batches:
            return {"sampler": index_state, "iterator": iter_state}
        if "sampler_iter_state" in iter_state or "sampler_state" not in iter_state:
            raise ValueError(
                "the StatefulDataLoader checkpoint holds no state this loader's sampler can load: "
                "build the DataLoader with the sampler and batch arguments the checkpoint was made with"
            )
        return {"sampler": iter_state["sampler_state"], "iterator": None}
    if iter_state is not None and not torchdata_batches and stream.mode != "fixed":
        return {"sampler": None, "iterator": iter_state}  # a sampler whose iterator has the state
    if stream.mode != "fixed" and consumed and not finished:
        raise ValueError(
            "this StatefulDataLoader checkpoint is mid-epoch with a random sampler that has no state "
            "(StatefulDataLoader itself would restart the epoch in a new order): resume from a checkpoint "
            "taken at an epoch's end, or give the sampler state_dict/load_state_dict"
        )
    return None


def from_torchdata_state(state: Mapping[str, Any], loader: Any) -> dict[str, Any]:
    """The omnifeed state that continues ``loader`` where StatefulDataLoader would continue from ``state``.

    Changes neither ``loader`` nor ``state``: a state that needs StatefulDataLoader's shuffle says so
    (``needs_torchdata_shuffle``), and the caller gives it (``torchdata_shuffle``). Raises ``ValueError`` for an
    incomplete state or one that cannot continue exactly (the message says what to do).
    """
    try:
        multi = "_snapshot" in state
        if multi:
            snap = state["_snapshot"]
            main = snap["_main_snapshot"]
            count, base_seed, yielded = int(main["_num_workers"]), main["_base_seed"], int(snap["_snapshot_step"])
            since, last = int(state["_steps_since_snapshot"]), int(snap["_last_yielded_worker_id"])
            found = snap.get("_worker_snapshots", {})
            workers = [found.get(f"worker_{i}") for i in range(count)]
        else:
            main, count, base_seed, yielded, since, last = state, 0, None, int(state["_num_yielded"]), 0, -1
            workers = [{"dataset_state": state["dataset_state"], "fetcher_state": state["fetcher_state"]}]
        finished = bool(state["_iterator_finished"])
        consumed = int(main["_sampler_iter_yielded"])
        iterable = bool(loader._is_iterable)
        snapshot = None if iterable else _sampler_snapshot(loader, main, consumed, finished)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"an incomplete StatefulDataLoader state ({type(exc).__name__}: {exc}); pass what "
            "StatefulDataLoader.state_dict() returned"
        ) from None
    entries = [_worker_dataset(w, iterable) for w in workers]
    return {
        "format": STATE_FORMAT,
        "status": "finished" if finished else "running",
        "base_seed": base_seed,
        "yielded": yielded,
        "since_snapshot": since,
        "sampler": {
            "consumed": yielded if iterable else consumed,
            "also_yielded": [],
            "replay": None,
            "snapshot": snapshot,
        },
        "workers": {
            "count": count,
            "next": (last + 1) % max(1, count),
            "datasets": [e[0] for e in entries],
            "ended": [e[1] for e in entries],
        },
    }
