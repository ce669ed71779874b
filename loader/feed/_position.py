"""`FeedPosition`: where a rank is in its share of the plan — the plan cursor at the step in progress and the
micro-batches of that step already delivered.

Feeds, the service's streams and clients hold positions; the dict form (``to_dict`` / ``from_dict``, the
``Feed.state_dict()`` format: ``format``, ``plan`` — the plan cursor's state, ``accum_done``) exists only at
the two edges, the wire and checkpoints. Nothing else reads its keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..plan import Plan, PlanCursor, change_mixture, steps_left_in_epoch
from ._healing import FeedError

FEED_STATE_FORMAT = "omnifeed.feed-state/1"
_KEYS = frozenset({"format", "plan", "accum_done"})


@dataclass(frozen=True)
class FeedPosition:
    """The plan cursor's state at the start of the step in progress (``plan_state``, a ``PlanCursor.state_dict()``,
    never edited) and the micro-batches of that step delivered (``accum_done``). Equal positions are the same place;
    ``key`` orders the positions of one stream. ``checked``: a cursor of the plan it names made it (`start`,
    `moved_to`, a feed's progress), so `Feed.seek` takes it as it is; one read `from_dict` is checked there."""

    plan_state: Mapping[str, Any]
    accum_done: int = 0
    checked: bool = field(default=False, compare=False, repr=False)

    @classmethod
    def start(cls, plan: Plan, *, world_size: int = 1, grad_accum: int = 1) -> FeedPosition:
        """The plan's first position at this topology."""
        return cls(PlanCursor(plan, world_size=world_size, grad_accum=grad_accum).state_dict(), checked=True)

    @classmethod
    def from_dict(cls, state: Any) -> FeedPosition:
        """``state`` (the ``to_dict`` format, from the wire or a checkpoint) read; ``ValueError`` when it is not one.

        Its plan state is checked against a plan by `moved_to`.
        """
        if not isinstance(state, Mapping) or set(state) != _KEYS or state["format"] != FEED_STATE_FORMAT:
            raise ValueError(
                f"not a feed state (expected keys format, plan, accum_done with format {FEED_STATE_FORMAT!r})"
            )
        accum_done = state["accum_done"]
        if not isinstance(accum_done, int) or isinstance(accum_done, bool) or accum_done < 0:
            raise ValueError(f"feed state accum_done {accum_done!r} is not a count of micro-batches")
        if not isinstance(state["plan"], Mapping):
            raise ValueError("feed state 'plan' must be a plan cursor state")
        return cls(dict(state["plan"]), accum_done)

    def with_mixture_changed(self, plan: Plan) -> FeedPosition:
        """This position with its plan state carried over to ``plan``'s mixture weights (`change_mixture`; the same
        position when they are its own). Raises ValueError for a plan state without a mixture position."""
        return FeedPosition(change_mixture(self.plan_state, plan), self.accum_done)

    def to_dict(self) -> dict[str, Any]:
        """The position as a feed state (``Feed.state_dict()``'s format): what travels and what checkpoints hold."""
        return {"format": FEED_STATE_FORMAT, "plan": dict(self.plan_state), "accum_done": self.accum_done}

    def moved_to(self, plan: Plan, *, world_size: int, grad_accum: int) -> FeedPosition:
        """This position checked against ``plan`` and moved to this topology (another one than its own is a resize).

        Raises ``StateMismatchError`` for another index or batching config, ``ValueError`` for a malformed
        position, ``FeedError`` for one in the middle of a step at another topology.
        """
        if not self.accum_done < grad_accum:
            raise ValueError(f"feed state accum_done {self.accum_done!r} outside 0..{grad_accum - 1}")
        cursor = PlanCursor(plan, world_size=world_size, grad_accum=grad_accum)
        cursor.load_state_dict(self.plan_state)
        if self.accum_done and cursor.topology_version != self.plan_state["topology_version"]:
            raise FeedError("the state is in the middle of a step; resume it at the world size it was saved with")
        return FeedPosition(cursor.state_dict(), self.accum_done, checked=True)

    def of(self, plan: Plan) -> bool:
        """Whether the position's plan state names ``plan``'s index and batching config (nothing more is checked)."""
        return (self.plan_state.get("index_fingerprint"), self.plan_state.get("config_fingerprint")) == (
            plan.index_fingerprint,
            plan.config_fingerprint,
        )

    @property
    def step(self) -> int:
        """Steps dealt before the step in progress (since training began)."""
        return int(self.plan_state["step"])

    @property
    def epoch(self) -> int:
        """Epoch of the next micro-batch delivered from here."""
        return int(self.plan_state["epoch"])

    @property
    def world_size(self) -> int:
        """Data-parallel ranks the position's steps are dealt to."""
        return int(self.plan_state["world_size"])

    @property
    def grad_accum(self) -> int:
        """Accumulation micro-steps per step at this position."""
        return int(self.plan_state["grad_accum"])

    @property
    def topology_version(self) -> int:
        """Topology changes (world size, accumulation) since training began."""
        return int(self.plan_state["topology_version"])

    @property
    def key(self) -> tuple[int, int]:
        """Where the position is in its stream: (steps dealt, micro-batches of the step in progress delivered)."""
        return self.step, self.accum_done

    def micro_batches_left(self, plan: Plan) -> int:
        """Micro-batches a rank at this position (at its topology) receives until its epoch is delivered.

        Fixed-size batches: counted; a cost budget: the rest of the epoch planned (no data read).
        """
        steps = steps_left_in_epoch(plan, self.plan_state) if plan.bucketing is not None else self._fixed_steps(plan)
        return steps * self.grad_accum - self.accum_done

    def _fixed_steps(self, plan: Plan) -> int:
        """Steps left in the epoch with fixed-size batches: a step takes world size × accumulation micro-batches."""
        n, batch = plan.num_samples, plan.config.batch_size
        per_epoch = n // batch if plan.config.drop_last else -(-n // batch)
        left = per_epoch - int(self.plan_state["micro_batch"])
        return -(-left // (self.world_size * self.grad_accum))
