"""PlanCursor: the run's whole data state (small, strict, never the caller's dict changed), dealing steps to
ranks across resizes with nothing skipped or repeated, the steps left in an epoch, and a dealing stopped midway."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.loader import StateMismatchError
from omnifeed.loader.plan import Plan, PlanConfig, PlanCursor, steps_left_in_epoch
from omnifeed.loader.plan._cursor import DealingStopped

DOCUMENTED_KEYS = {
    "format",
    "index_fingerprint",
    "config_fingerprint",
    "topology_version",
    "world_size",
    "grad_accum",
    "step",
    "epoch",
    "window",
    "window_start",
    "carried",
    "offset",
    "micro_batch",
    "budget",
    "next_budget",
}


def plan(num_samples: int = 50, batch_size: int = 4, fingerprint: str = "index-a", **config: Any) -> Plan:
    return Plan(
        num_samples, PlanConfig(seed=3, batch_size=batch_size, window_size=12, **config), index_fingerprint=fingerprint
    )


def dealt(cursor: PlanCursor, steps: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """(epoch, micro-batch index, positions) of every micro-batch of the next ``steps`` steps, in dealing order."""
    return [
        (mb.epoch, mb.index, tuple(mb.positions.tolist()))
        for _ in range(steps)
        for mb in cursor.next_step().micro_batches
    ]


def test_the_state_is_small_json_with_the_documented_keys_at_every_step() -> None:
    cursor = PlanCursor(plan(num_samples=10_000), world_size=3, grad_accum=2)
    for _ in range(40):
        state = cursor.state_dict()
        assert set(state) == DOCUMENTED_KEYS
        assert json.loads(json.dumps(state)) == state and len(json.dumps(state)) < 600
        cursor.next_step()
    assert cursor.state_dict()["step"] == 40 and cursor.state_dict()["format"] == "omnifeed.plan-state/2"


@pytest.mark.parametrize(
    "change,error,named",
    [
        (lambda s: s | {"shuffle_buffer": []}, ValueError, "unknown keys ['shuffle_buffer']"),
        (
            lambda s: {k: v for k, v in s.items() if k not in ("offset", "epoch")},
            ValueError,
            "missing keys ['epoch', 'offset']",
        ),
        (lambda s: s | {"format": "omnifeed.plan-state/0"}, ValueError, "'omnifeed.plan-state/0'; this omnifeed reads"),
        (
            lambda s: s | {"index_fingerprint": "index-b"},
            StateMismatchError,
            "another index: state index_fingerprint index-b",
        ),
        (lambda s: s | {"config_fingerprint": "0123"}, StateMismatchError, "another batching config"),
        (lambda s: s | {"step": -1}, ValueError, "step must be a non-negative integer, got -1"),
        (lambda s: s | {"window": True}, ValueError, "window must be a non-negative integer, got True"),
        (lambda s: s | {"budget": 512.0}, ValueError, "budget 512.0 does not fit this plan's batching"),
        (lambda s: s | {"window_start": 10**9}, ValueError, "outside this index"),
        (lambda s: s | {"carried": "3,4"}, ValueError, "carried must be a list of sample positions, got 3,4"),
        (lambda s: s | {"carried": [3]}, ValueError, "plan state carries 1 samples; this plan carries at most 0"),
    ],
)
def test_loading_is_strict_names_what_is_wrong_and_never_changes_the_callers_dict(
    change: Any, error: type, named: str
) -> None:
    source = PlanCursor(plan(), world_size=2)
    source.next_step()
    state = change(source.state_dict())
    before = copy.deepcopy(state)
    cursor = PlanCursor(plan(), world_size=2)
    with pytest.raises(error) as raised:
        cursor.load_state_dict(state)
    assert named in str(raised.value)
    assert state == before
    assert cursor.state_dict() == PlanCursor(plan(), world_size=2).state_dict(), "a refused state changes nothing"


def test_a_state_saved_at_another_batch_size_names_both_config_fingerprints() -> None:
    state = PlanCursor(plan(batch_size=4)).state_dict()
    other = plan(batch_size=5)
    with pytest.raises(StateMismatchError) as raised:
        PlanCursor(other).load_state_dict(state)
    assert state["config_fingerprint"] in str(raised.value) and other.config_fingerprint in str(raised.value)


@settings(max_examples=80, deadline=None)
@given(
    num_samples=st.integers(1, 120),
    batch_size=st.integers(1, 9),
    topologies=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(0, 6)), min_size=1, max_size=6),
)
def test_resizes_deal_later_steps_at_the_new_size_with_nothing_skipped_or_repeated(
    num_samples: int, batch_size: int, topologies: list[tuple[int, int, int]]
) -> None:
    cursor = PlanCursor(plan(num_samples, batch_size))
    sequence: list[tuple[int, int, tuple[int, ...]]] = []
    version = 0
    for world_size, grad_accum, steps in topologies:
        changed = (world_size, grad_accum) != (cursor.world_size, cursor.grad_accum)
        assert cursor.resize(world_size, grad_accum) is changed
        version += changed
        for _ in range(steps):
            step = cursor.next_step()
            assert (step.world_size, step.grad_accum, step.topology_version) == (world_size, grad_accum, version)
            assert len(step.micro_batches) == world_size * grad_accum
            by_rank = {(mb.epoch, mb.index) for rank in range(world_size) for mb in step.for_rank(rank)}
            assert by_rank == {(mb.epoch, mb.index) for mb in step.micro_batches}  # the ranks share out the step
            sequence.extend((mb.epoch, mb.index, tuple(mb.positions.tolist())) for mb in step.micro_batches)
    # whatever the topologies, the steps dealt the plan's one sequence of micro-batches, in order
    assert sequence == dealt(PlanCursor(plan(num_samples, batch_size)), len(sequence))


def test_a_state_loaded_at_another_world_size_is_a_resize() -> None:
    saved = PlanCursor(plan(), world_size=4)
    saved.next_step()
    resumed = PlanCursor(plan(), world_size=2, grad_accum=3)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.topology_version == 1 and (resumed.world_size, resumed.grad_accum) == (2, 3)
    expected = dealt(PlanCursor(plan()), 4 + 6)[4:]  # step 0 dealt 4 micro-batches; the next step deals 6
    assert dealt(resumed, 1) == expected


@pytest.mark.parametrize("world_size,grad_accum,steps_dealt", [(1, 1, 0), (2, 1, 3), (3, 2, 1), (5, 1, 2)])
def test_steps_left_in_epoch_counts_the_steps_until_the_epoch_is_delivered(
    world_size: int, grad_accum: int, steps_dealt: int
) -> None:
    cursor = PlanCursor(
        plan(num_samples=50, batch_size=4), world_size=world_size, grad_accum=grad_accum
    )  # 13 micro-batches
    dealt(cursor, steps_dealt)
    state = cursor.state_dict()
    before = copy.deepcopy(state)
    left = steps_left_in_epoch(plan(num_samples=50, batch_size=4), state)
    assert state == before
    assert left == -(-(13 - steps_dealt * world_size * grad_accum) // (world_size * grad_accum))
    for _ in range(left):
        assert not cursor.epoch_delivered(0)
        cursor.next_step()
    assert cursor.epoch_delivered(0)


def test_a_stopped_dealing_leaves_the_cursor_where_it_was() -> None:
    cursor = PlanCursor(plan(), world_size=6)
    dealt(cursor, 1)
    before = cursor.state_dict()
    with pytest.raises(DealingStopped, match="dealing step 1 was stopped"):
        cursor.next_step(stop=lambda: True)  # fixed-size batches: asked once, before anything is dealt
    assert cursor.state_dict() == before
    uninterrupted = PlanCursor(plan(), world_size=6)
    dealt(uninterrupted, 1)
    assert dealt(cursor, 2) == dealt(uninterrupted, 2), "the same steps as if nothing had been stopped"
    assert cursor.next_step(stop=lambda: False).step == 3


def test_worlds_and_accumulation_must_be_positive_integers() -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="must be a positive integer"):
            PlanCursor(plan(), world_size=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="must be a positive integer"):
            PlanCursor(plan()).resize(2, grad_accum=bad)  # type: ignore[arg-type]


def test_a_state_saved_before_issue_29_is_refused_in_one_line_saying_what_to_do() -> None:
    cursor = PlanCursor(plan())
    state = cursor.state_dict() | {"format": "omnifeed.plan-state/1"}  # budget mode formed other micro-batches then
    with pytest.raises(ValueError) as refused:
        PlanCursor(plan()).load_state_dict(state)
    message = str(refused.value)
    assert "\n" not in message and "omnifeed.plan-state/2" in message and "start the run without it" in message
