"""A real torchdata ``StatefulDataLoader`` checkpoint loads into ``DataLoader`` and continues with StatefulDataLoader's
batches."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, RandomSampler, get_worker_info

from omnifeed.loader import DataLoader

torchdata_sdl = pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Numbers(Dataset):
    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> int:
        return i


class Counter(IterableDataset):
    """A stateful iterable dataset, sharded across workers; its state is the next number of each shard."""

    def __init__(self, n: int) -> None:
        self.n, self.at = n, None

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start = self.at if self.at is not None else worker
        self.at = None
        for i in range(start, self.n, workers):
            self.next = i + workers
            yield i

    def state_dict(self) -> dict[str, Any]:
        return {"at": getattr(self, "next", None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = state["at"]


def _batches(loader: Any, epochs: int) -> list[list[list[int]]]:
    return [[torch.as_tensor(b).tolist() for b in loader] for _ in range(epochs)]


def _checkpoint(make: Any, steps: int | None) -> dict[str, Any]:
    """A StatefulDataLoader checkpoint after ``steps`` batches (None: after the epoch's end)."""
    torch.manual_seed(1)
    loader = torchdata_sdl.StatefulDataLoader(**make())
    for _ in itertools.islice(loader, steps):  # steps=None: to the epoch's end
        pass
    return loader.state_dict()


def _both_continue(make: Any, state: dict[str, Any], epochs: int = 2) -> tuple[Any, Any]:
    torch.manual_seed(5)
    reference = torchdata_sdl.StatefulDataLoader(**make())
    reference.load_state_dict(state)
    expected = _batches(reference, epochs)
    torch.manual_seed(5)
    ours = DataLoader(**make())
    ours.load_state_dict(state)
    return _batches(ours, epochs), expected


MAP_CONFIGS = {
    "sequential": {"batch_size": 4},
    "shuffle": {"batch_size": 4, "shuffle": True},
    "shuffle-generator": {"batch_size": 4, "shuffle": True, "generator": 3},
    "shuffle-unbatched": {"batch_size": None, "shuffle": True},
    "workers": {"batch_size": 4, "num_workers": 2},
    "workers-shuffle": {"batch_size": 4, "shuffle": True, "num_workers": 2, "drop_last": True},
    "workers-shuffle-generator-every-3": {
        "batch_size": 4,
        "shuffle": True,
        "num_workers": 2,
        "generator": 3,
        "snapshot_every_n_steps": 3,
    },
    "persistent-shuffle": {"batch_size": 4, "shuffle": True, "num_workers": 2, "persistent_workers": True},
}


def _map_loader(config: dict[str, Any]) -> Any:
    def make() -> dict[str, Any]:
        args = dict(config)
        if "generator" in args:
            args["generator"] = torch.Generator().manual_seed(args["generator"])
        return {"dataset": Numbers(), **args}

    return make


@pytest.mark.parametrize("steps", [5, None], ids=["mid-epoch", "epoch-end"])
@pytest.mark.parametrize("name", list(MAP_CONFIGS))
def test_map_style_checkpoint_continues_with_stateful_dataloaders_batches(name: str, steps: int | None) -> None:
    make = _map_loader(MAP_CONFIGS[name])
    got, expected = _both_continue(make, _checkpoint(make, steps))
    assert got == expected
    assert len(expected[0]) == (len(expected[1]) - 5 if steps is not None else len(expected[1]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_iterable_dataset_checkpoint_continues_per_worker(num_workers: int) -> None:
    def make() -> dict[str, Any]:
        return {"dataset": Counter(40), "batch_size": 3, "num_workers": num_workers}

    got, expected = _both_continue(make, _checkpoint(make, 4), epochs=1)
    assert got == expected
    assert sorted(i for b in got[0] for i in b) == sorted(set(range(40)) - set(_first_batches(make, 4)))


def _first_batches(make: Any, steps: int) -> list[int]:
    torch.manual_seed(1)
    it = iter(torchdata_sdl.StatefulDataLoader(**make()))
    return [i for _ in range(steps) for i in next(it).tolist()]


def test_own_state_after_a_torchdata_shuffle_keeps_its_shuffle_in_a_new_loader() -> None:
    make = _map_loader(MAP_CONFIGS["shuffle"])
    _, expected = _both_continue(make, _checkpoint(make, 5), epochs=2)
    first = DataLoader(**make())
    first.load_state_dict(_checkpoint(make, 5))
    it = iter(first)
    head = [next(it).tolist() for _ in range(3)]
    second = DataLoader(**make())
    second.load_state_dict(first.state_dict())
    assert isinstance(second.sampler, type(first.sampler))
    assert [head + _batches(second, 1)[0], _batches(second, 1)[0]] == expected


def test_mid_epoch_random_sampler_without_state_is_refused() -> None:
    def make() -> dict[str, Any]:
        return {"dataset": Numbers(), "batch_size": 4, "sampler": RandomSampler(Numbers())}

    loader = DataLoader(**make())
    with pytest.raises(ValueError, match="epoch's end"):
        loader.load_state_dict(_checkpoint(make, 3))


def test_own_format_is_what_the_loader_writes_after_a_torchdata_checkpoint() -> None:
    make = _map_loader(MAP_CONFIGS["workers"])
    loader = DataLoader(**make())
    loader.load_state_dict(_checkpoint(make, 2))
    assert loader.state_dict()["format"].startswith("omnifeed.dataloader-state/")


class StatefulNumbers(Numbers):
    """Has a (constant) state, so a checkpoint holds each worker's place and needs the same ``num_workers``."""

    def state_dict(self) -> dict[str, int]:
        return {"n": 37}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def _shuffled() -> dict[str, Any]:
    return {"dataset": StatefulNumbers(), "batch_size": 4, "shuffle": True}


def _refused_state(case: str) -> dict[str, Any]:
    """A state ``load_state_dict`` refuses, after it would have switched the loader to StatefulDataLoader's shuffle."""
    if case == "corrupt-checkpoint":
        return {**_checkpoint(_shuffled, 3), "_num_yielded": -1}
    if case == "corrupt-own-state":
        first = DataLoader(**_shuffled())
        first.load_state_dict(_checkpoint(_shuffled, 3))
        next(iter(first))
        return {**first.state_dict(), "status": "paused"}
    return _checkpoint(lambda: {**_shuffled(), "num_workers": 2}, 3)  # another num_workers: the next iter() refuses


@pytest.mark.parametrize("case", ["corrupt-checkpoint", "corrupt-own-state", "other-num-workers"])
def test_a_refused_state_leaves_the_loader_as_it_was(case: str) -> None:
    state = _refused_state(case)
    torch.manual_seed(3)
    untouched = _batches(DataLoader(**_shuffled()), 2)
    torch.manual_seed(3)
    loader = DataLoader(**_shuffled())
    samplers = loader.sampler, loader.batch_sampler
    if case == "other-num-workers":
        loader.load_state_dict(state)
        with pytest.raises(AssertionError, match="num_workers=2"):
            iter(loader)
        loader.load_state_dict({})
    else:
        with pytest.raises(ValueError):
            loader.load_state_dict(state)
    assert (loader.sampler, loader.batch_sampler) == samplers
    assert _batches(loader, 2) == untouched


def test_a_refused_state_keeps_the_state_loaded_before_it() -> None:
    torch.manual_seed(3)
    first = DataLoader(**_shuffled())
    it = iter(first)
    next(it)
    state = first.state_dict()
    rest = [b.tolist() for b in it]
    resumed = DataLoader(**_shuffled())
    resumed.load_state_dict(state)
    with pytest.raises(ValueError):
        resumed.load_state_dict(_refused_state("corrupt-checkpoint"))
    assert _batches(resumed, 1) == [rest]
