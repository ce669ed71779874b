"""`ElasticBatchSampler`: a map-style dataset dealt across data-parallel ranks by omnifeed's plan.

The global sequence of micro-batches is the plan's (``loader/plan/_plan.py``): a keyed permutation of
``range(len(dataset))`` seeded by ``(seed, epoch)`` (or index order without shuffle), cut into
micro-batches of ``batch_size``. Global micro-batch ``g`` goes to rank ``g % world_size`` within step
``g // world_size``; every rank's state is the same plan cursor (``loader/plan/_cursor.py``), whose count of
dealt micro-batches is the whole data state. ``resize`` re-deals what is left to another world size:
over any sequence of resizes every sample is delivered exactly once per epoch. The last step of an
epoch takes its missing micro-batches from the next epoch, so no rank is ever short of a batch.

Iterating yields this rank's micro-batches (lists of dataset indices) until the epoch in progress has
been dealt; the next iteration continues with the next epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils.data import Sampler

from ..feed import FeedPosition
from ..plan import Plan, PlanConfig, PlanCursor


def check_rank(world_size: int, rank: int) -> None:
    """Raise ``ValueError`` unless ``world_size`` is a positive int and ``0 <= rank < world_size``."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")


class ElasticBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches of a plan shared by every rank, with exact resume and resize."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        world_size: int,
        rank: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        fingerprint: str | None = None,
    ) -> None:
        check_rank(world_size, rank)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        config = PlanConfig(
            seed=seed, batch_size=batch_size, shuffle="permutation" if shuffle else "none", drop_last=drop_last
        )
        self.plan = Plan(num_samples, config, index_fingerprint=fingerprint or f"samples:{num_samples}")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.world_size = world_size
        self.rank = rank
        self.cursor = PlanCursor(self.plan, world_size=world_size)
        self._iterating: int | None = None  # the epoch the iteration in progress delivers
        self._resume_epoch: int | None = None  # that of a loaded state, for the next __iter__

    @property
    def micro_batches_per_epoch(self) -> int:
        """Global micro-batches in one epoch."""
        n, b = self.plan.num_samples, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    @property
    def epoch(self) -> int:
        """The epoch of the next micro-batch to deal."""
        return self.cursor.epoch

    def steps_left(self, state: Mapping[str, Any] | None = None) -> int:
        """This rank's batches left in the epoch in progress at ``state`` (default: now)."""
        state = state or self.state_dict()
        position = FeedPosition(state["plan"]).moved_to(self.plan, world_size=self.world_size, grad_accum=1)
        if state["epoch"] is not None and position.epoch > state["epoch"]:
            return 0
        return position.micro_batches_left(self.plan)

    def __len__(self) -> int:
        return self.steps_left()

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.cursor.epoch if self._resume_epoch is None else self._resume_epoch
        self._resume_epoch = None
        self._iterating = epoch
        return _EpochSteps(self, epoch)

    def state_dict(self) -> dict[str, Any]:
        """``plan``: the plan cursor's state, the same on every rank (see ``PlanCursor.state_dict``);
        ``epoch``: the epoch the iteration in progress delivers (None between iterations)."""
        return {"plan": self.cursor.state_dict(), "epoch": self._iterating}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at this sampler's world size (another one than the state's is a resize)."""
        self.check_state(state)
        cursor = PlanCursor(self.plan, world_size=self.world_size)
        cursor.load_state_dict(state["plan"])
        self.cursor = cursor
        self._resume_epoch = state["epoch"]
        self._iterating = state["epoch"]

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ``StateMismatchError`` (another dataset length or batching) or ``ValueError`` unless
        ``load_state_dict(state)`` would succeed."""
        if set(state) != {"plan", "epoch"}:
            raise ValueError(f"not an ElasticBatchSampler state (keys plan, epoch), found keys {sorted(state)}")
        PlanCursor(self.plan, world_size=self.world_size).load_state_dict(state["plan"])

    def rewind(self, state: Mapping[str, Any]) -> None:
        """Put the iteration in progress back to ``state`` (prefetching ran ahead of delivery), at this
        sampler's world size; unlike ``load_state_dict`` it changes no later iteration."""
        cursor = PlanCursor(self.plan, world_size=self.world_size)
        cursor.load_state_dict(state["plan"])
        self.cursor = cursor
        self._iterating = state["epoch"]

    def resize(self, world_size: int, rank: int) -> None:
        """Deal the micro-batches not yet dealt to ``world_size`` ranks, this one being ``rank``."""
        check_rank(world_size, rank)
        self.cursor.resize(world_size)
        self.world_size, self.rank = world_size, rank


class _EpochSteps:
    """This rank's micro-batch of each step until the epoch in progress at creation is dealt.

    Reads the sampler's cursor at every step, so a resize or a rewind applies to it at once.
    """

    def __init__(self, sampler: ElasticBatchSampler, epoch: int) -> None:
        self._sampler = sampler
        self._epoch = epoch

    def __iter__(self) -> _EpochSteps:
        return self

    def __next__(self) -> list[int]:
        cursor = self._sampler.cursor
        if cursor.epoch > self._epoch:
            self._sampler._iterating = None
            raise StopIteration
        self._sampler._iterating = self._epoch
        micro_batch = cursor.next_step().for_rank(self._sampler.rank)[0]
        return [int(p) for p in micro_batch.positions]
