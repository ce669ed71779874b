"""`FeedPosition`: the feed state's dict form at the edges, its checks, its order and the micro-batches left."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.bucketing import BucketingConfig
from omnifeed.loader import Plan, PlanConfig, PlanCursor, StateMismatchError
from omnifeed.loader.feed import FEED_STATE_FORMAT, FeedError, FeedPosition

FP = "index:test"


def _fixed(n: int = 50, batch: int = 4, drop_last: bool = False, seed: int = 1) -> Plan:
    return Plan(n, PlanConfig(seed=seed, batch_size=batch, drop_last=drop_last), index_fingerprint=FP)


def _stepped(plan: Plan, steps: int, world_size: int = 1, grad_accum: int = 1) -> PlanCursor:
    cursor = PlanCursor(plan, world_size=world_size, grad_accum=grad_accum)
    for _ in range(steps):
        cursor.next_step()
    return cursor


def _counted(plan: Plan, cursor: PlanCursor, accum_done: int) -> int:
    """Micro-batches one rank receives from ``cursor`` until its epoch is delivered, by dealing the steps."""
    epoch, count = cursor.epoch, 0
    while not cursor.epoch_delivered(epoch):
        count += len(cursor.next_step().for_rank(0))
    return count - accum_done


def test_a_feed_state_round_trips_to_the_same_dict_and_bytes() -> None:
    plan = _fixed()
    state = {"format": FEED_STATE_FORMAT, "plan": _stepped(plan, 3, 2, 2).state_dict(), "accum_done": 1}
    again = FeedPosition.from_dict(state).to_dict()
    assert again == state and json.dumps(again) == json.dumps(state)
    position = FeedPosition.from_dict(state)
    assert (position.step, position.epoch, position.world_size, position.grad_accum) == (3, 0, 2, 2)
    assert position.topology_version == 0 and position.key == (3, 1)


def test_the_start_is_the_plans_first_position() -> None:
    plan = _fixed()
    start = FeedPosition.start(plan, world_size=2, grad_accum=3)
    assert start.to_dict() == {
        "format": FEED_STATE_FORMAT,
        "plan": PlanCursor(plan, world_size=2, grad_accum=3).state_dict(),
        "accum_done": 0,
    }
    assert start.micro_batches_left(plan) == 3 * -(-13 // 6)  # 13 micro-batches, steps of 2 × 3


@pytest.mark.parametrize(
    "state, message",
    [
        ([1, 2], "not a feed state"),
        ({"format": "other", "plan": {}, "accum_done": 0}, "not a feed state"),
        ({"format": FEED_STATE_FORMAT, "plan": {}}, "not a feed state"),
        ({"format": FEED_STATE_FORMAT, "plan": {}, "accum_done": True}, "accum_done True"),
        ({"format": FEED_STATE_FORMAT, "plan": {}, "accum_done": -1}, "accum_done -1"),
        ({"format": FEED_STATE_FORMAT, "plan": [], "accum_done": 0}, "plan cursor state"),
    ],
)
def test_what_is_not_a_feed_state_is_refused(state: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FeedPosition.from_dict(state)


def test_moving_checks_the_plan_the_progress_and_the_topology() -> None:
    plan = _fixed()
    position = FeedPosition(_stepped(plan, 2, 2, 2).state_dict(), 1)
    with pytest.raises(ValueError, match=r"accum_done 1 outside 0\.\.0"):
        position.moved_to(plan, world_size=2, grad_accum=1)
    with pytest.raises(FeedError, match="middle of a step"):
        position.moved_to(plan, world_size=3, grad_accum=2)
    with pytest.raises(StateMismatchError, match="another batching config"):
        position.moved_to(_fixed(batch=5), world_size=2, grad_accum=2)
    assert position.moved_to(plan, world_size=2, grad_accum=2) == position
    resized = FeedPosition(position.plan_state).moved_to(plan, world_size=3, grad_accum=1)
    assert (resized.world_size, resized.grad_accum, resized.topology_version, resized.step) == (3, 1, 1, 2)


def test_positions_are_ordered_by_step_then_accumulation() -> None:
    plan = _fixed()
    positions = [FeedPosition(_stepped(plan, s, 1, 3).state_dict(), a) for s in range(3) for a in range(3)]
    assert sorted(positions[::-1], key=lambda p: p.key) == positions
    assert positions[4] == FeedPosition.from_dict(positions[4].to_dict()) and positions[4] != positions[5]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    batch=st.integers(1, 7),
    drop_last=st.booleans(),
    world_size=st.integers(1, 4),
    grad_accum=st.integers(1, 3),
    steps=st.integers(0, 30),
    data=st.data(),
)
def test_micro_batches_left_agrees_with_dealing_the_rest_of_the_epoch(
    n: int, batch: int, drop_last: bool, world_size: int, grad_accum: int, steps: int, data: st.DataObject
) -> None:
    if drop_last and n < batch:
        drop_last = False
    plan = _fixed(n, batch, drop_last)
    cursor = _stepped(plan, steps, world_size, grad_accum)
    accum_done = data.draw(st.integers(0, grad_accum - 1))
    position = FeedPosition(cursor.state_dict(), accum_done)
    assert position.micro_batches_left(plan) == _counted(plan, cursor, accum_done)


@pytest.mark.parametrize("steps", [0, 3, 11])
def test_micro_batches_left_with_a_cost_budget_agrees_with_dealing(steps: int) -> None:
    def lengths(positions: np.ndarray) -> dict[str, np.ndarray]:
        text = (np.asarray(positions) * 37 % 200 + 1).astype(np.int64)
        names = ("image_height", "image_width", "video_frames", "video_fps", "video_height", "video_width")
        return {"text_tokens": text, "audio_seconds": np.zeros(len(text)), **{n: np.zeros_like(text) for n in names}}

    config = PlanConfig(seed=2, window_size=120, bucketing=BucketingConfig(budget=600, overlong="alone"))
    plan = Plan(300, config, index_fingerprint=FP, lengths=lengths)
    cursor = _stepped(plan, steps, 2, 2)
    position = FeedPosition(cursor.state_dict(), 1)
    assert position.micro_batches_left(plan) == _counted(plan, cursor, 1)
