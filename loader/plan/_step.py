"""`Step`: one training step's ``W × A`` micro-batches, each computed when a rank asks for it.

A step of a large world deals many micro-batches (65,536 at dp 4,096 × accum 16) and a node needs a
handful of them: its own ranks' ``A`` each. A step therefore holds how to find its ``i``-th
micro-batch (the closed form of fixed-size batches, or the planned windows it spans), not the
micro-batches themselves; ``for_rank`` computes ``A`` of them, ``micro_batches`` all (reports and
audits that look at the whole step).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from functools import cached_property
from typing import Protocol

from ._micro_batch import MicroBatch, WindowPlan


class MicroBatchesAt(Protocol):
    """A step's micro-batches by place in dealing order (``0 <= i < W × A``), one or several computed together."""

    def __call__(self, i: int) -> MicroBatch: ...

    def many(self, places: list[int]) -> list[MicroBatch]: ...


class Step:
    """One training step: the ``W × A`` micro-batches it deals, in dealing order (each computed on demand)."""

    def __init__(
        self,
        step: int,
        world_size: int,
        grad_accum: int,
        topology_version: int,
        micro_batches_at: MicroBatchesAt | None = None,
    ) -> None:
        self.step, self.world_size, self.grad_accum, self.topology_version = (
            step,
            world_size,
            grad_accum,
            topology_version,
        )
        self._at = micro_batches_at  # None: the step's numbers only

    def __repr__(self) -> str:
        return f"Step({self.step}, world_size={self.world_size}, grad_accum={self.grad_accum})"

    @property
    def size(self) -> int:
        """Micro-batches the step deals: world size × accumulation."""
        return self.world_size * self.grad_accum

    def _source(self) -> MicroBatchesAt:
        if self._at is None:
            raise ValueError(f"step {self.step} keeps its numbers only, not its micro-batches")
        return self._at

    def micro_batch(self, i: int) -> MicroBatch:
        """The step's ``i``-th micro-batch in dealing order (accumulation micro-step ``i // W`` of rank ``i % W``)."""
        if not 0 <= i < self.size:
            raise IndexError(f"micro-batch {i} outside step {self.step}'s {self.size}")
        dealt = self.__dict__.get("micro_batches")  # computed once already (`micro_batches`)
        return dealt[i] if dealt is not None else self._source()(i)

    @cached_property
    def micro_batches(self) -> tuple[MicroBatch, ...]:
        """All ``W × A`` micro-batches, in dealing order (computed once; a rank needs only `for_rank`)."""
        return tuple(self._source().many(list(range(self.size))))

    def for_rank(self, rank: int) -> list[MicroBatch]:
        """The micro-batches of ``rank``, one per accumulation micro-step, in order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        places = [a * self.world_size + rank for a in range(self.grad_accum)]
        dealt = self.__dict__.get("micro_batches")
        return [dealt[i] for i in places] if dealt is not None else self._source().many(places)

    def numbers(self) -> Step:
        """This step without its micro-batches (what a delivered batch keeps of its step)."""
        return Step(self.step, self.world_size, self.grad_accum, self.topology_version)


class WindowSpans:
    """A step's micro-batches as consecutive runs: of planned windows, or of a planned epoch's numbered ones."""

    def __init__(self) -> None:
        self._spans: list[tuple[Callable[[int], MicroBatch], int]] = []  # (micro-batch by number, first number)
        self._ends: list[int] = []  # cumulative counts

    def add(self, window: WindowPlan, offset: int, count: int) -> None:
        """The next ``count`` micro-batches are ``window``'s from ``offset`` on."""
        self.add_run(window.micro_batches.__getitem__, offset, count)

    def add_run(self, at: Callable[[int], MicroBatch], first: int, count: int) -> None:
        """The next ``count`` micro-batches are ``at(first)``, ``at(first + 1)``, ..."""
        self._spans.append((at, first))
        self._ends.append((self._ends[-1] if self._ends else 0) + count)

    def __call__(self, i: int) -> MicroBatch:
        span = bisect_right(self._ends, i)
        at, first = self._spans[span]
        return at(first + i - (self._ends[span - 1] if span else 0))

    def many(self, places: list[int]) -> list[MicroBatch]:
        """The micro-batches at ``places`` (planned already: nothing to compute together)."""
        return [self(i) for i in places]
