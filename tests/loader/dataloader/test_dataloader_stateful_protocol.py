"""torchdata's ``Stateful`` protocol and ``snapshot_every_n_steps``, as ``StatefulDataLoader`` documents them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from omnifeed.loader import DataLoader

pytestmark = pytest.mark.timeout(240)


class SelfIterating(IterableDataset):
    """Its own iterator, holding no state before ``iter()`` (torchdata's ``CountIterCallsIter``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> SelfIterating:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self.at, self.end = worker * self.n // workers, (worker + 1) * self.n // workers
        return self

    def __next__(self) -> int:
        if self.at >= self.end:
            raise StopIteration
        self.at += 1
        return self.at - 1

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at, "end": self.end}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at, self.end = state["at"], state["end"]


class CountingMap(Dataset):
    """Counts how often the loader asks it for its state."""

    def __init__(self, n: int) -> None:
        self.n, self.asked = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, self.asked

    def state_dict(self) -> dict[str, int]:
        self.asked += 1
        return {"asked": self.asked}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class RngMap(Dataset):
    """Its state is the global torch RNG (torchdata's ``DummyMapDataset``): restoring it must precede the epoch's
    draws."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        return i

    def state_dict(self) -> dict[str, Any]:
        return {"g": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["g"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_is_its_own_iterator_resumes_and_is_stored_once(workers: int) -> None:
    loader = DataLoader(SelfIterating(40), batch_size=2, num_workers=workers)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(5)]
    state = loader.state_dict()
    rest = [b.tolist() for b in iterator]
    assert all(s is None or s["dataset"] is None for s in state["workers"]["datasets"])
    resumed = DataLoader(SelfIterating(40), batch_size=2, num_workers=workers)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest
    assert sorted(x for b in head + rest for x in b) == list(range(40))


def test_a_state_taken_before_iterating_round_trips_for_a_self_iterating_dataset() -> None:
    loader = DataLoader(SelfIterating(10), batch_size=3)
    state = loader.state_dict()
    again = DataLoader(SelfIterating(10), batch_size=3)
    again.load_state_dict(state)
    assert again.state_dict() == state
    assert [b.tolist() for b in again] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.parametrize("every", [0, 3, 5])
def test_snapshot_every_n_steps_resumes_from_the_last_snapshot_plus_the_steps_since(every: int) -> None:
    loader = DataLoader(SelfIterating(60), batch_size=2, num_workers=2, snapshot_every_n_steps=every)
    iterator = iter(loader)
    for _ in range(7):
        next(iterator)
    state = loader.state_dict()
    rest = [b.tolist() for b in iterator]
    snapshot_step = 0 if every == 0 else 7 // every * every
    assert state["yielded"] == snapshot_step and state["since_snapshot"] == 7 - snapshot_step
    resumed = DataLoader(SelfIterating(60), batch_size=2, num_workers=2, snapshot_every_n_steps=every)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest


def test_workers_are_asked_for_their_state_only_around_snapshot_steps() -> None:
    def asked(every: int | None) -> int:
        loader = DataLoader(CountingMap(40), batch_size=1, num_workers=2, snapshot_every_n_steps=every)
        return max(counts[1].item() for counts in loader)

    # a worker's 20 items see how often it was asked before each: after every batch, around every 10th, never
    assert asked(1) == 19 and 0 < asked(10) <= 4 and asked(0) == 0


def test_snapshot_every_n_steps_refuses_negative_and_accepts_zero_and_none() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        DataLoader(CountingMap(4), snapshot_every_n_steps=-1)
    for every in (0, None):
        assert DataLoader(CountingMap(4), snapshot_every_n_steps=every).snapshot_every_n_steps == every


def test_multi_epoch_resume_restores_the_datasets_rng_state_before_the_next_epochs_draws() -> None:
    def epochs(loader: DataLoader, count: int) -> list[int]:
        return [b.item() for _ in range(count) for b in loader]

    torch.manual_seed(0)
    first = DataLoader(RngMap(), shuffle=True)
    seen = epochs(first, 2)
    state = first.state_dict()
    torch.manual_seed(1)  # the global RNG moves on after the save: only the dataset's state puts it back
    resumed = DataLoader(RngMap(), shuffle=True)
    resumed.load_state_dict(state)
    seen += epochs(resumed, 2)
    torch.manual_seed(0)
    assert seen == epochs(DataLoader(RngMap(), shuffle=True), 4)


def test_a_state_for_another_worker_count_is_refused_at_iter_as_an_assertion_error() -> None:
    loader = DataLoader(SelfIterating(10), batch_size=2, num_workers=0)
    next(iter(loader))
    other = DataLoader(SelfIterating(10), batch_size=2, num_workers=2)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(AssertionError, match="resume with num_workers=0"):
        iter(other)
    other.load_state_dict({})
    assert sum(len(b) for b in other) == 10


class LiveCountingIter:
    """An iterator whose ``state_dict()`` is its live dict, which every ``__next__`` changes."""

    def __init__(self, n: int) -> None:
        info = get_worker_info()
        worker, self.workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self.n, self.live = n, {"next": worker, "served": 0}

    def __iter__(self) -> LiveCountingIter:
        return self

    def __next__(self) -> int:
        if self.live["next"] >= self.n:
            raise StopIteration
        self.live["next"] += self.workers
        self.live["served"] += 1
        return self.live["next"] - self.workers

    def state_dict(self) -> dict[str, int]:
        return self.live

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.live = dict(state)


class LiveCounting(IterableDataset):
    """Sharded across workers; its iterator hands out its live state (legal under torchdata's protocol)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> LiveCountingIter:
        return LiveCountingIter(self.n)


def test_a_live_state_dict_taken_after_each_batch_resumes_exactly_with_workers() -> None:
    def make() -> DataLoader:
        return DataLoader(LiveCounting(48), batch_size=2, num_workers=2, prefetch_factor=4)

    loader = make()
    batches, states = [], []
    for batch in loader:  # workers run ahead of the consumer, so a live state is changed after it was taken
        batches.append(batch.tolist())
        states.append(loader.state_dict())
    assert sorted(x for b in batches for x in b) == list(range(48))
    for step, state in enumerate(states):
        resumed = make()
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == batches[step + 1 :], f"resumed after batch {step}"


class RandomDraws(IterableDataset):
    """Each epoch's iterator draws ``n`` numbers from the dataset's generator (seeded per worker) and keeps its state in
    the iterator's state: restoring an iterator moves the generator, which the next epoch's iterator draws on from."""

    def __init__(self, n: int) -> None:
        self.n, self.rng, self.seeded = n, torch.Generator(), False

    def __iter__(self) -> RandomDrawsIter:
        if not self.seeded:
            info = get_worker_info()
            self.rng.manual_seed(7 + (info.id if info is not None else 0))
            self.seeded = True
        return RandomDrawsIter(self)


class RandomDrawsIter:
    def __init__(self, dataset: RandomDraws) -> None:
        self.dataset, self.drawn = dataset, 0

    def __iter__(self) -> RandomDrawsIter:
        return self

    def __next__(self) -> int:
        if self.drawn >= self.dataset.n:
            raise StopIteration
        self.drawn += 1
        return int(torch.randint(1 << 30, (1,), generator=self.dataset.rng))

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "rng": self.dataset.rng.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = state["drawn"]
        self.dataset.rng.set_state(state["rng"])


@pytest.mark.parametrize("workers", [0, 2])
def test_the_epoch_after_an_epoch_end_state_continues_the_iterators_random_draws(workers: int) -> None:
    def make() -> DataLoader:
        return DataLoader(RandomDraws(6), batch_size=2, num_workers=workers, persistent_workers=workers > 0)

    def epoch(loader: DataLoader) -> list[list[int]]:
        return [b.tolist() for b in loader]

    uninterrupted = make()
    first = epoch(uninterrupted)
    state = uninterrupted.state_dict()
    expected = [epoch(uninterrupted), epoch(uninterrupted)]
    assert state["status"] == "finished" and expected[0] != first  # the draws go on across epochs
    resumed = make()
    resumed.load_state_dict(state)
    assert [epoch(resumed), epoch(resumed)] == expected
