"""Steps dealt once for every pipeline that shares them: the same steps each rank's own cursor would deal."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnifeed.loader import PlanConfig, PlanCursor, SampleIndex
from omnifeed.loader.feed import DealtSteps
from omnifeed.loader.plan import Plan
from omnifeed.loader.plan._cursor import DealingStopped


@pytest.fixture(scope="module")
def plan(index_dir: Path) -> Plan:
    return Plan.from_index(SampleIndex(index_dir), PlanConfig(seed=5, batch_size=3, window_size=32))


def alone(plan: Plan, steps: int, world_size: int = 2) -> list[list[list[int]]]:
    """What one cursor deals by itself: each step's micro-batch positions."""
    cursor = PlanCursor(plan, world_size=world_size)
    return [[mb.positions.tolist() for mb in cursor.next_step().micro_batches] for _ in range(steps)]


def test_ranks_sharing_dealt_steps_get_the_steps_their_own_cursors_deal_and_each_is_dealt_once(plan: Plan) -> None:
    dealt, steps = DealtSteps(plan), 40  # past an epoch and several shuffle windows
    states = [PlanCursor(plan, world_size=2).state_dict() for _ in range(2)]
    seen: list[list[list[list[int]]]] = [[], []]
    for _ in range(steps):
        for rank in (1, 0):  # either rank may reach a state first
            step, states[rank] = dealt.next_step(states[rank])
            seen[rank].append([mb.positions.tolist() for mb in step.micro_batches])
    assert seen[0] == seen[1] == alone(plan, steps)
    assert (dealt.dealt, dealt.shared) == (steps, steps)


def test_a_rank_far_behind_the_kept_steps_is_dealt_its_own(plan: Plan) -> None:
    dealt = DealtSteps(plan, keep=4, cursors=2)
    ahead = behind = PlanCursor(plan, world_size=2).state_dict()
    for _ in range(30):
        _, ahead = dealt.next_step(ahead)
    got = []
    for _ in range(30):
        step, behind = dealt.next_step(behind)
        got.append([mb.positions.tolist() for mb in step.micro_batches])
    assert got == alone(plan, 30) and behind == ahead


def test_steps_kept_are_bounded_by_their_micro_batches(plan: Plan) -> None:
    dealt = DealtSteps(plan, keep=64, max_micro_batches=10)
    state = PlanCursor(plan, world_size=4).state_dict()
    first = state
    for _ in range(8):
        _, state = dealt.next_step(state)
    dealt.next_step(first)  # long evicted (10 micro-batches hold 2 steps of 4): dealt again
    assert (dealt.dealt, dealt.shared) == (9, 0)


def test_a_stopped_step_leaves_the_next_call_where_it_was(plan: Plan) -> None:
    dealt = DealtSteps(plan)
    state = PlanCursor(plan, world_size=3).state_dict()
    with pytest.raises(DealingStopped):
        dealt.next_step(state, stop=lambda: True)
    step, _ = dealt.next_step(state)
    assert [mb.positions.tolist() for mb in step.micro_batches] == alone(plan, 1, world_size=3)[0]
