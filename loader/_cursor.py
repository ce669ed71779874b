"""The cursor: the whole data state of a run, and how steps are dealt to data-parallel ranks.

A step at world size ``W`` with ``A`` gradient-accumulation micro-steps takes the
next ``W * A`` micro-batches of the plan. Accumulation micro-step ``a`` of rank
``r`` gets global micro-batch ``first + a * W + r``, so every accumulation
micro-step is ``W`` consecutive micro-batches (balanced when micro-batches cost
the same). The cursor is a handful of integers: resuming, at the same or another
world size, costs the work of the next micro-batch, never a replay.

State keys (``state_dict``): ``format``, ``index_fingerprint``,
``config_fingerprint``, ``topology_version``, ``world_size``, ``grad_accum``,
``step`` (steps dealt since training began), ``epoch`` and ``micro_batch`` (the
next micro-batch to deal: its epoch and its place in that epoch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import StateMismatchError
from ._plan import Plan

STATE_FORMAT = "omnifeed.plan-state/1"
_STATE_KEYS = frozenset(
    {"format", "index_fingerprint", "config_fingerprint", "topology_version", "world_size", "grad_accum",
     "step", "epoch", "micro_batch"}
)


@dataclass(frozen=True)
class Step:
    """One training step: which global micro-batches each rank receives."""

    step: int
    world_size: int
    grad_accum: int
    topology_version: int
    first: int

    def global_indices(self, rank: int) -> list[int]:
        """Global micro-batch indices of ``rank``, one per accumulation micro-step, in order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return [self.first + a * self.world_size + rank for a in range(self.grad_accum)]

    @property
    def stop(self) -> int:
        """Global index just past this step's last micro-batch."""
        return self.first + self.world_size * self.grad_accum


def _check_positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class PlanCursor:
    """Deals the plan's micro-batches step by step; holds the run's entire data state."""

    def __init__(self, plan: Plan, *, world_size: int = 1, grad_accum: int = 1, epoch: int = 0) -> None:
        self.plan = plan
        self.world_size = _check_positive("world_size", world_size)
        self.grad_accum = _check_positive("grad_accum", grad_accum)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.topology_version = 0
        self.step = 0
        self.next_global = plan.global_index(epoch, 0)

    @property
    def epoch(self) -> int:
        """Epoch of the next micro-batch to deal."""
        return self.plan.locate(self.next_global)[0]

    def epoch_delivered(self, epoch: int) -> bool:
        """True once every micro-batch of ``epoch`` has been dealt."""
        return self.next_global >= self.plan.global_index(epoch + 1, 0)

    def next_step(self) -> Step:
        """Deal the next step at the current topology and advance past it."""
        step = Step(self.step, self.world_size, self.grad_accum, self.topology_version, self.next_global)
        self.next_global = step.stop
        self.step += 1
        return step

    def resize(self, world_size: int, grad_accum: int | None = None) -> bool:
        """Deal later steps to ``world_size`` ranks (and ``grad_accum``); True if the topology changed."""
        world_size = _check_positive("world_size", world_size)
        grad_accum = self.grad_accum if grad_accum is None else _check_positive("grad_accum", grad_accum)
        if (world_size, grad_accum) == (self.world_size, self.grad_accum):
            return False
        self.world_size, self.grad_accum = world_size, grad_accum
        self.topology_version += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        """The whole data state: a small JSON-serializable dict of constant size."""
        epoch, micro_batch = self.plan.locate(self.next_global)
        return {
            "format": STATE_FORMAT,
            "index_fingerprint": self.plan.index_fingerprint,
            "config_fingerprint": self.plan.config_fingerprint,
            "topology_version": self.topology_version,
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
            "step": self.step,
            "epoch": epoch,
            "micro_batch": micro_batch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; a world size or accumulation other than this cursor's is a resize.

        Raises ``StateMismatchError`` for a state of another index or batching config,
        and ``ValueError`` for a malformed state. ``state`` is not modified.
        """
        keys = set(state)
        if keys != _STATE_KEYS:
            missing, unknown = sorted(_STATE_KEYS - keys), sorted(keys - _STATE_KEYS)
            raise ValueError(f"not a plan state: missing keys {missing}, unknown keys {unknown}")
        if state["format"] != STATE_FORMAT:
            raise ValueError(f"plan state format {state['format']!r}; this omnifeed reads {STATE_FORMAT!r}")
        for what in ("index_fingerprint", "config_fingerprint"):
            mine = getattr(self.plan, what)
            if state[what] != mine:
                raise StateMismatchError(
                    f"the saved state belongs to another {'index' if what == 'index_fingerprint' else 'batching config'}: "
                    f"state {what} {state[what]} != {mine}. Resume with the index and plan config the state "
                    "was saved with, or start a new run without the state"
                )
        for name in ("topology_version", "step", "epoch", "micro_batch", "world_size", "grad_accum"):
            value = state[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"plan state {name} must be a non-negative integer, got {value!r}")
        if state["micro_batch"] >= self.plan.micro_batches_per_epoch:
            raise ValueError(
                f"plan state micro_batch {state['micro_batch']} outside the epoch's "
                f"{self.plan.micro_batches_per_epoch} micro-batches"
            )
        self.step = state["step"]
        self.next_global = self.plan.global_index(state["epoch"], state["micro_batch"])
        self.topology_version = state["topology_version"]
        if (state["world_size"], state["grad_accum"]) != (self.world_size, self.grad_accum):
            self.topology_version += 1
