"""The elastic path: ranks simulated in one process get every sample exactly once per epoch across resizes."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, IterableDataset

from omnifeed.loader import DataLoader, StateMismatchError

pytestmark = pytest.mark.timeout(240)


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(3))


class Numbers(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def loader(n: int, world_size: int, rank: int, **options: Any) -> DataLoader[Any]:
    return DataLoader(
        Numbers(n),
        batch_size=options.pop("batch_size", 4),
        shuffle=options.pop("shuffle", True),
        world_size=world_size,
        rank=rank,
        shuffle_seed=options.pop("shuffle_seed", 9),
        **options,
    )


def run_ranks(n: int, schedule: dict[int, int], *, steps: int, num_workers: int = 0, **options: Any) -> list[list[int]]:
    """The global micro-batch sequence of ranks stepping in lockstep for ``steps`` steps; before step s in
    ``schedule`` every rank resizes to ``schedule[s]`` ranks (leavers stop; joiners load rank 0's state)."""
    world = schedule[0]
    loaders = [loader(n, world, r, num_workers=num_workers, **options) for r in range(world)]
    iterators = [iter(ld) for ld in loaders]
    sequence: list[list[int]] = []
    for step in range(steps):
        if step and step in schedule:
            world, state = schedule[step], loaders[0].state_dict()
            loaders, iterators = loaders[:world], iterators[:world]
            for r, ld in enumerate(loaders):
                ld.resize(world, r)
            for r in range(len(loaders), world):
                joiner = loader(n, world, r, **options)
                joiner.load_state_dict(state)
                loaders.append(joiner)
                iterators.append(iter(joiner))
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):  # every rank ends the epoch at the same step
            iterators = [iter(ld) for ld in loaders]
            batches = [next(it) for it in iterators]
        assert all(b is not None for b in batches), "ranks disagree on where the epoch ends"
        sequence.extend(b.tolist() for b in batches)
    for ld in loaders:
        ld.close()
    return sequence


def assert_exactly_once_per_epoch(sequence: list[list[int]], n: int, per_epoch: int) -> None:
    for epoch in range(len(sequence) // per_epoch):
        seen = Counter(i for batch in sequence[epoch * per_epoch : (epoch + 1) * per_epoch] for i in batch)
        assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}, f"epoch {epoch}"


def test_ranks_share_out_each_epoch_exactly_once() -> None:
    sequence = run_ranks(24, {0: 3}, steps=4)
    assert_exactly_once_per_epoch(sequence, 24, per_epoch=6)
    assert sequence == run_ranks(24, {0: 1}, steps=12)  # the global order does not depend on the world size


def test_resizes_mid_epoch_keep_exactly_once_and_the_global_order() -> None:
    reference = run_ranks(30, {0: 1}, steps=40)  # 8 micro-batches (the last one short) per epoch
    resized = run_ranks(30, {0: 4, 1: 3, 3: 5, 5: 2, 7: 1}, steps=10)
    assert resized == reference[: len(resized)]
    assert_exactly_once_per_epoch(resized, 30, per_epoch=8)


def test_resize_mid_loop_with_workers_drops_prefetched_batches() -> None:
    reference = run_ranks(40, {0: 1}, steps=20)
    with_workers = run_ranks(40, {0: 2, 2: 1, 4: 3}, steps=7, num_workers=2)
    assert with_workers == reference[: len(with_workers)]


def test_len_is_this_ranks_batches_and_follows_resizes() -> None:
    ranks = [loader(30, 4, r) for r in range(4)]
    assert [len(ld) for ld in ranks] == [2] * 4  # 8 micro-batches over 4 ranks
    iterators = [iter(ld) for ld in ranks]
    for it in iterators:
        next(it)
    ranks[0].resize(2, 0)
    assert len(ranks[0]) == 1 + 2  # one delivered, then the 4 micro-batches left over 2 ranks
    assert len([b for b in iterators[0]]) == 2


def test_breaking_out_of_the_loop_continues_where_delivery_stopped() -> None:
    expected = [b.tolist() for b in loader(40, 1, 0)]
    elastic = loader(40, 1, 0, num_workers=2)
    head = []
    for batch in elastic:
        head.append(batch.tolist())
        if len(head) == 3:
            break  # the workers had prefetched more; none of it is lost
    rest = [b.tolist() for b in elastic]
    assert head + rest == expected
    elastic.close()


def test_state_resumes_at_another_world_size_and_refuses_another_dataset() -> None:
    first = loader(24, 2, 0)
    iterator = iter(first)
    next(iterator)
    state = first.state_dict()
    plan_state = state["sampler"]["snapshot"]["sampler"]["plan"]
    assert plan_state["micro_batch"] == 2 and plan_state["world_size"] == 2
    grown = loader(24, 3, 2)
    grown.load_state_dict(state)
    assert next(iter(grown)).tolist() == run_ranks(24, {0: 1}, steps=5)[4]
    with pytest.raises(StateMismatchError, match="another index"):
        loader(25, 2, 0).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="another batching config"):
        loader(24, 2, 0, batch_size=3).load_state_dict(state)


def test_attributes_and_refusals() -> None:
    elastic = loader(10, 2, 1, batch_size=3, drop_last=True)
    assert isinstance(elastic, tud.DataLoader) and (elastic.batch_size, elastic.drop_last) == (3, True)
    # 3 full micro-batches of 3 over 2 ranks: the second step borrows its missing one from the next epoch
    assert len(elastic) == 2 and [len(b) for b in elastic] == [3, 3]
    with pytest.raises(ValueError, match="needs the elastic path"):
        DataLoader(Numbers(4)).resize(2, 0)
    with pytest.raises(ValueError, match="drop sampler= and batch_sampler="):
        DataLoader(Numbers(4), sampler=[0, 1], world_size=2, rank=0)
    with pytest.raises(ValueError, match="an IterableDataset shards itself"):
        DataLoader(Stream(), world_size=2, rank=0)
    with pytest.raises(ValueError, match="in_order=False"):
        DataLoader(Numbers(4), world_size=2, rank=0, num_workers=1, in_order=False)
    with pytest.raises(ValueError, match="rank must be an integer in"):
        loader(10, 2, 2)
    with pytest.raises(ValueError, match="give both world_size= and rank="):
        DataLoader(Numbers(4), world_size=2)


def test_worker_seeding_and_random_streams_stay_torchs() -> None:
    torch.manual_seed(0)
    list(loader(10, 2, 0))
    after_elastic = torch.rand(2)
    torch.manual_seed(0)
    list(DataLoader(Numbers(10), batch_size=4))
    assert torch.equal(after_elastic, torch.rand(2))  # one base-seed draw per epoch, as torch


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(5, 40),
    batch_size=st.integers(1, 6),
    worlds=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    gap=st.integers(1, 4),
)
def test_any_resizes_deliver_the_same_global_sequence(n: int, batch_size: int, worlds: list[int], gap: int) -> None:
    schedule = {i * gap: w for i, w in enumerate(worlds)}
    steps = gap * len(worlds) + 2
    resized = run_ranks(n, schedule, steps=steps, batch_size=batch_size)
    reference = run_ranks(n, {0: 1}, steps=len(resized), batch_size=batch_size)
    assert resized == reference
    assert_exactly_once_per_epoch(resized, n, per_epoch=-(-n // batch_size))
