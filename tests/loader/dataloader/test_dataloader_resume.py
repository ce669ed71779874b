"""Resuming mid-epoch yields exactly the batches an uninterrupted run yields next, with and without workers."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

from omnifeed.loader import DataLoader

pytestmark = pytest.mark.timeout(240)


class Numbers(Dataset):
    def __init__(self, n: int = 11) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Seeds(Numbers):
    """Which worker seed served each item: resumed workers must be seeded as the originals."""

    def __getitem__(self, i: int) -> tuple[int, int]:
        info = get_worker_info()
        return i, info.seed if info is not None else -1


class Counter(IterableDataset):
    """Stateful iterable: items worker_id, worker_id + W, ... below ``n``; ``stop`` ends worker 0 early."""

    def __init__(self, n: int = 13, stop: int | None = None) -> None:
        self.n, self.stop, self.next = n, stop, None

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start = worker if self.next is None else self.next
        self.next = None
        end = self.stop if self.stop is not None and worker == 0 else self.n
        for value in range(start, end, workers):
            self.next = value + workers
            yield value

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


class Stateless(Counter):
    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


class StatefulIterable(IterableDataset):
    """The state lives in the iterator object, as torchdata allows."""

    class _It:
        def __init__(self) -> None:
            self.i = 0

        def __iter__(self) -> Any:
            return self

        def __next__(self) -> int:
            if self.i >= 9:
                raise StopIteration
            self.i += 1
            return self.i * 10

        def state_dict(self) -> dict[str, int]:
            return {"i": self.i}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.i = state["i"]

    def __iter__(self) -> Any:
        return StatefulIterable._It()


class Stride(Sampler[int]):
    """A stateful sampler: every index from ``start`` by 2, then the rest; resumes from its state."""

    def __init__(self, n: int) -> None:
        self.n, self.done, self.resume_at = n, 0, 0

    def __iter__(self) -> Iterator[int]:
        order = list(range(0, self.n, 2)) + list(range(1, self.n, 2))
        self.done, self.resume_at = self.resume_at, 0
        for i in order[self.done :]:
            self.done += 1
            yield i

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = state["done"]


class LazyRandom(Sampler[int]):
    """A custom sampler that draws from the global torch RNG on its first pull."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(self.n).tolist()

    def __len__(self) -> int:
        return self.n


def values(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [values(b) for b in batch]
    return batch


def assert_resumes_everywhere(
    make: Callable[[], DataLoader[Any]],
    *,
    seed: int = 0,
    points: list[int] | None = None,
    restore_rng: bool = True,
    through_json: bool = True,
) -> None:
    """For each stop point: the batches before it, then those of a new loader loaded with the state (through
    JSON unless the sampler's state is not JSON), equal one uninterrupted epoch. The resumed run restores the global RNG
    saved with the checkpoint, as a training script does (a state saved before the epoch's first batch leaves the
    shuffle seed to be drawn with the next batch, as an uninterrupted run draws it); ``restore_rng=False`` scrambles it
    instead."""
    torch.manual_seed(seed)
    expected = [values(b) for b in make()]
    for stop in points if points is not None else range(len(expected) + 1):
        torch.manual_seed(seed)
        loader = make()
        head, iterator = [], iter(loader)
        for _ in range(stop):
            head.append(values(next(iterator)))
        state, rng = loader.state_dict(), torch.get_rng_state()
        state = json.loads(json.dumps(state)) if through_json else state
        del iterator
        torch.manual_seed(seed + 1000)
        resumed = make()
        resumed.load_state_dict(state)
        if restore_rng:
            torch.set_rng_state(rng)
        assert head + [values(b) for b in resumed] == expected, f"resumed after {stop} batches"


def assert_resumes_across_epochs(
    make: Callable[[], DataLoader[Any]], points: list[tuple[int, int | None]], *, epochs: int = 2, seed: int = 0
) -> None:
    """For each point ``(epoch, stop)``, ``stop`` batches into ``epoch`` (None: after its StopIteration), the
    batches before it and those of a new loader loaded with the state (and the global RNG saved with it) equal
    ``epochs`` uninterrupted epochs."""
    torch.manual_seed(seed)
    loader = make()
    expected = [[values(b) for b in loader] for _ in range(epochs)]
    for epoch, stop in points:
        torch.manual_seed(seed)
        loader = make()
        got = [[values(b) for b in loader] for _ in range(epoch)]
        iterator = iter(loader)
        got.append([values(b) for b in iterator] if stop is None else [values(next(iterator)) for _ in range(stop)])
        state, rng = json.loads(json.dumps(loader.state_dict())), torch.get_rng_state()
        del iterator
        loader.close()
        torch.manual_seed(seed + 1000)
        resumed = make()
        resumed.load_state_dict(state)
        torch.set_rng_state(rng)
        if stop is not None:
            got[-1] += [values(b) for b in resumed]
        got += [[values(b) for b in resumed] for _ in range(epoch + 1, epochs)]
        resumed.close()
        assert got == expected, f"resumed at batch {stop} of epoch {epoch}"


class Rewinding(IterableDataset):
    """Stateful iterable that rewinds when exhausted and rotates its items by its epoch count (kept in its state);
    with 2 workers worker 0 ends exactly at a batch's end and worker 1 inside a short batch."""

    def __init__(self) -> None:
        self.epoch, self.position = 0, 0

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        items = list(range(worker, 11, workers))
        items = items[self.epoch % len(items) :] + items[: self.epoch % len(items)]
        while self.position < len(items):
            self.position += 1
            yield 100 * self.epoch + items[self.position - 1]
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "options",
    [{}, {"shuffle": True}, {"shuffle": True, "drop_last": True}],
    ids=["sequential", "shuffle", "shuffle-drop-last"],
)
def test_map_style_resumes_exactly(num_workers: int, options: dict[str, Any]) -> None:
    points = None if num_workers == 0 else [0, 1, 3, 5]
    assert_resumes_everywhere(
        lambda: DataLoader(Numbers(), batch_size=2, num_workers=num_workers, **options), points=points
    )


def test_unbatched_shuffle_resumes_exactly() -> None:
    assert_resumes_everywhere(lambda: DataLoader(Numbers(), batch_size=None, shuffle=True), points=[0, 1, 5, 11])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_needs_no_global_rng(num_workers: int) -> None:
    assert_resumes_everywhere(
        lambda: DataLoader(Numbers(), batch_size=2, shuffle=True, num_workers=num_workers),
        points=[1, 4],
        restore_rng=False,
    )
    assert_resumes_everywhere(
        lambda: DataLoader(Numbers(), batch_size=4, sampler=LazyRandom(11), num_workers=num_workers),
        points=[1],
        restore_rng=False,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_with_a_generator_resumes_exactly(num_workers: int) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(
            Numbers(), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5), num_workers=num_workers
        )

    assert_resumes_everywhere(make, points=None if num_workers == 0 else [0, 2])


@pytest.mark.parametrize(
    "make_sampler",
    [
        lambda: SubsetRandomSampler(range(1, 10)),
        lambda: WeightedRandomSampler([1.0] * 11, num_samples=11),
        lambda: RandomSampler(range(11), replacement=True, num_samples=40),
        lambda: LazyRandom(11),
    ],
    ids=["subset", "weighted", "replacement", "custom"],
)
def test_random_samplers_replay_their_epoch(make_sampler: Callable[[], Sampler[int]]) -> None:
    assert_resumes_everywhere(lambda: DataLoader(Numbers(), batch_size=4, sampler=make_sampler()))
    assert_resumes_everywhere(
        lambda: DataLoader(Numbers(), batch_size=4, sampler=make_sampler()), points=[1, 2], restore_rng=False
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_sampler_and_batch_sampler_resume_from_their_state(num_workers: int) -> None:
    points = None if num_workers == 0 else [0, 2, 4]
    assert_resumes_everywhere(
        lambda: DataLoader(Numbers(), batch_size=2, sampler=Stride(11), num_workers=num_workers), points=points
    )
    assert_resumes_everywhere(
        lambda: DataLoader(Numbers(), batch_sampler=BatchSampler(Stride(11), 3, False), num_workers=num_workers),
        points=points,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_iterable_resumes_from_each_workers_state(num_workers: int) -> None:
    points = None if num_workers == 0 else [0, 1, 3, 6]
    assert_resumes_everywhere(lambda: DataLoader(Counter(), batch_size=2, num_workers=num_workers), points=points)


def test_iterable_workers_ending_unevenly_resume_in_rotation() -> None:
    assert_resumes_everywhere(
        lambda: DataLoader(Counter(n=20, stop=4), batch_size=2, num_workers=2), points=[1, 2, 3, 5]
    )


def test_iterator_state_resumes() -> None:
    assert_resumes_everywhere(lambda: DataLoader(StatefulIterable(), batch_size=2))


def test_stateless_iterable_is_replayed_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert_resumes_everywhere(lambda: DataLoader(Stateless(), batch_size=2, num_workers=2), points=[3])
    assert "replays the 3 batches" in caplog.text


def test_resumed_workers_get_the_original_seeds() -> None:
    assert_resumes_everywhere(lambda: DataLoader(Seeds(), batch_size=2, num_workers=2), points=[2])


def test_in_order_false_resumes_every_batch_exactly_once() -> None:
    loader = DataLoader(Numbers(20), batch_size=2, num_workers=2, in_order=False)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(4)]
    state = loader.state_dict()
    del iterator
    resumed = DataLoader(Numbers(20), batch_size=2, num_workers=2, in_order=False)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert sorted(head + rest) == [[i, i + 1] for i in range(0, 20, 2)]


def test_persistent_workers_resume_and_continue_with_later_epochs() -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Numbers(), batch_size=2, shuffle=True, num_workers=2, persistent_workers=True)

    assert_resumes_everywhere(make, points=[2])
    loader = make()
    assert len([b for b in loader]) == len([b for b in loader]) == 6


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_between_epochs_continues_the_loaders_generator(num_workers: int) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(
            Numbers(), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(4), num_workers=num_workers
        )

    assert_resumes_across_epochs(make, [(0, None), (1, 0)], epochs=3)


def test_a_generator_reseeded_after_loading_a_state_between_epochs_takes_effect() -> None:
    generator = torch.Generator()
    loader = DataLoader(Numbers(), batch_size=3, shuffle=True, generator=generator)
    generator.manual_seed(1)
    first = [b.tolist() for b in loader]
    state = loader.state_dict()
    generator.manual_seed(2)
    second = [b.tolist() for b in loader]
    resumed = DataLoader(Numbers(), batch_size=3, shuffle=True, generator=generator)
    resumed.load_state_dict(state)
    generator.manual_seed(2)
    assert [b.tolist() for b in resumed] == second != first


@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "generator"])
def test_persistent_workers_resume_between_and_inside_later_epochs(generator: bool) -> None:
    def make() -> DataLoader[Any]:  # Seeds: the worker seeds must stay the first epoch's
        return DataLoader(
            Seeds(),
            batch_size=3,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(4) if generator else None,
        )

    assert_resumes_across_epochs(make, [(0, None), (1, 2)], epochs=3)


def test_fixed_order_with_a_generator_seeds_later_epochs_as_uninterrupted() -> None:
    assert_resumes_across_epochs(
        lambda: DataLoader(Seeds(), batch_size=3, num_workers=2, generator=torch.Generator().manual_seed(4)), [(0, 2)]
    )


@pytest.mark.parametrize(
    "make_sampler", [lambda: WeightedRandomSampler([1.0] * 11, 11), lambda: LazyRandom(11)], ids=["weighted", "custom"]
)
def test_a_state_before_the_first_batch_leaves_the_global_rng_as_uninterrupted(
    make_sampler: Callable[[], Sampler[int]],
) -> None:
    assert_resumes_across_epochs(lambda: DataLoader(Numbers(), batch_size=4, sampler=make_sampler()), [(0, 0), (1, 0)])


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_iterable_state_through_a_short_last_batch_and_into_the_next_epoch(num_workers: int, persistent: bool) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Rewinding(), batch_size=2, num_workers=num_workers, persistent_workers=persistent)

    assert_resumes_across_epochs(make, [(0, 6), (0, None), (1, 0), (1, 5)])


def test_state_at_epoch_end_continues_with_the_next_epoch() -> None:
    torch.manual_seed(3)
    loader = DataLoader(Numbers(), batch_size=4, shuffle=True)
    first = [b.tolist() for b in loader]
    rng, state = torch.get_rng_state(), loader.state_dict()
    second = [b.tolist() for b in loader]
    assert state["status"] == "finished"
    torch.set_rng_state(rng)
    resumed = DataLoader(Numbers(), batch_size=4, shuffle=True)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == second != first


def test_resuming_twice_and_a_resumed_epoch_draws_no_random_numbers() -> None:
    torch.manual_seed(0)
    expected = [b.tolist() for b in DataLoader(Numbers(), batch_size=2, shuffle=True)]
    torch.manual_seed(0)
    loader = DataLoader(Numbers(), batch_size=2, shuffle=True)
    iterator = iter(loader)
    head = [next(iterator).tolist()]
    for _ in range(2):
        state = loader.state_dict()
        loader = DataLoader(Numbers(), batch_size=2, shuffle=True)
        loader.load_state_dict(state)
        iterator = iter(loader)
        head.append(next(iterator).tolist())
    before = torch.get_rng_state()
    rest = [b.tolist() for b in iterator]
    assert head + rest == expected
    assert torch.equal(torch.get_rng_state(), before)


def test_state_is_small_json_and_loading_is_strict() -> None:
    loader = DataLoader(Numbers(), batch_size=2, shuffle=True, num_workers=0)
    fresh = loader.state_dict()
    assert fresh["status"] == "fresh" and len(json.dumps(fresh)) < 400
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    assert len(json.dumps(state)) < 400
    original = json.dumps(state)
    DataLoader(Numbers(), batch_size=2, shuffle=True).load_state_dict(state)
    assert json.dumps(state) == original  # not modified
    with pytest.raises(ValueError, match="not an omnifeed DataLoader state"):
        loader.load_state_dict({"format": "other/1"})
    with pytest.raises(ValueError, match="incomplete StatefulDataLoader state"):
        loader.load_state_dict({"_snapshot": {}})
    with pytest.raises(ValueError, match="must have the keys"):
        loader.load_state_dict({k: v for k, v in state.items() if k != "yielded"})
    with pytest.raises(ValueError, match="past the end of this sampler's epoch"):
        small = DataLoader(Numbers(3), batch_size=2, shuffle=True)
        small.load_state_dict({**state, "sampler": {**state["sampler"], "consumed": 5}})
        list(small)
    loader.load_state_dict({})
    assert loader.state_dict()["status"] == "fresh"


def test_iterable_state_needs_the_same_number_of_workers() -> None:
    loader = DataLoader(Counter(), batch_size=2, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    del iterator
    other = DataLoader(Counter(), batch_size=2, num_workers=0)
    other.load_state_dict(state)  # refused at iter(), as torchdata's (an AssertionError there)
    for error in (ValueError, AssertionError):
        with pytest.raises(error, match="resume with num_workers=2"):
            iter(other)


def test_map_style_state_resumes_with_another_number_of_workers() -> None:
    torch.manual_seed(1)
    loader = DataLoader(Numbers(), batch_size=2, shuffle=True, num_workers=2)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(2)]
    state = loader.state_dict()
    del iterator
    torch.manual_seed(1)
    expected = [b.tolist() for b in DataLoader(Numbers(), batch_size=2, shuffle=True)]
    resumed = DataLoader(Numbers(), batch_size=2, shuffle=True)
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == expected


def test_torchdata_code_runs_unchanged() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader.sampler")

    def make() -> DataLoader[Any]:
        sampler = stateful.RandomSampler(Numbers(), generator=torch.Generator().manual_seed(2))
        return DataLoader(Numbers(), batch_sampler=stateful.BatchSampler(sampler, 3, False), snapshot_every_n_steps=4)

    assert_resumes_everywhere(make, through_json=False)  # its samplers' states hold tensors


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 30),
    batch_size=st.integers(1, 7),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    stop=st.integers(0, 40),
    seed=st.integers(0, 2**32),
)
def test_resume_anywhere_equals_uninterrupted(
    n: int, batch_size: int, drop_last: bool, shuffle: bool, stop: int, seed: int
) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Numbers(n), batch_size=batch_size, drop_last=drop_last, shuffle=shuffle)

    batches = (n // batch_size) if drop_last else -(-n // batch_size)
    assert_resumes_everywhere(make, seed=seed, points=[min(stop, batches)])


@pytest.mark.parametrize("sampler", ["shuffle", "subset"])
def test_a_resume_leaves_the_loaders_generator_as_the_uninterrupted_run_does(sampler: str) -> None:
    def make() -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(4)
        if sampler == "shuffle":
            return DataLoader(Numbers(), batch_size=3, shuffle=True, generator=generator)
        return DataLoader(
            Numbers(), batch_size=3, sampler=SubsetRandomSampler(range(11), generator), generator=generator
        )

    uninterrupted = make()
    epochs = [[b.tolist() for b in uninterrupted] for _ in range(3)]
    loader = make()
    [b.tolist() for b in loader]
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    resumed = make()  # a new process: its generator starts from the seed again
    resumed.load_state_dict(state)
    assert [epochs[1][0]] + [b.tolist() for b in resumed] == epochs[1]
    assert [b.tolist() for b in resumed] == epochs[2]


def test_a_state_whose_generators_do_not_load_leaves_every_generator_as_it_was() -> None:
    def make() -> DataLoader:
        sampler = RandomSampler(Numbers(20), generator=torch.Generator().manual_seed(1))
        return DataLoader(Numbers(20), batch_size=3, sampler=sampler, generator=torch.Generator().manual_seed(2))

    def epochs(loader: DataLoader) -> list[list[int]]:
        return [b.tolist() for _ in range(2) for b in loader]

    saved = make()
    list(saved)
    state = saved.state_dict()
    assert len(state["sampler"]["replay"]["generators"]) == 2  # the sampler's, then the loader's
    state["sampler"]["replay"]["generators"][-1] = "AAAA"  # valid base64, not a generator state
    loader = make()
    with pytest.raises(ValueError, match="generator"):
        loader.load_state_dict(state)
    assert epochs(loader) == epochs(make())
