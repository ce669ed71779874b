"""The cursor deals what the dealer before issue 32 dealt: every micro-batch of a step, one at a time, walking the
planned windows. Fixed-size batches are now dealt in closed form (a step costs the micro-batches a rank asks for)
and a budget's steps as runs of planned windows; both must give the same micro-batches, in the same order, and the
same state after every step, for any index size, batch, window, shuffle, drop_last, world size, accumulation,
resize history and resume point."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import FP, synthetic_lengths

from omnifeed.bucketing import BucketingConfig
from omnifeed.loader.plan import MicroBatch, Plan, PlanConfig, PlanCursor


def reference_step(cursor: PlanCursor) -> list[MicroBatch]:
    """The pre-issue-32 dealer: ``W × A`` times, the next micro-batch of the current window's plan."""
    dealt = []
    for _ in range(cursor.world_size * cursor.grad_accum):
        current = cursor._window_plan()
        while cursor.offset >= len(current.micro_batches):  # a window left empty by its predecessor's borrowing
            cursor._advance(current)
            current = cursor._window_plan()
        dealt.append(current.micro_batches[cursor.offset])
        cursor.offset += 1
        cursor.micro_batch += 1
        if cursor.offset == len(current.micro_batches):
            cursor._advance(current)
    cursor.step += 1
    return dealt


def _view(micro_batches: list[MicroBatch] | tuple[MicroBatch, ...], ends: bool = True) -> list[tuple[Any, ...]]:
    return [
        (mb.epoch, mb.index, mb.window, mb.positions.tolist(), mb.cost, mb.ends_epoch if ends else None, mb.pack)
        for mb in micro_batches
    ]


def _fixed_plan(num_samples: int, batch: int, window: int, shuffle: str, drop_last: bool, shards: list[int]) -> Plan:
    config = PlanConfig(
        seed=5,
        batch_size=batch,
        window_size=None if shuffle == "shard_block" else window,
        shuffle=shuffle,
        shards_per_window=2,
        drop_last=drop_last,
    )
    sizes = np.asarray(shards, dtype=np.int64)
    return Plan(
        num_samples, config, index_fingerprint=FP, shard_sizes=sizes, by_shard=np.arange(num_samples, dtype=np.int64)
    )


def _compare(plan: Plan, topologies: list[tuple[int, int, int]], resume_at: int) -> None:
    """Deal the topologies' steps with both dealers; resume the new one from its own state after step
    ``resume_at``."""
    new, old = PlanCursor(plan), PlanCursor(plan)
    dealt = 0
    for world_size, grad_accum, steps in topologies:
        new.resize(world_size, grad_accum)
        old.resize(world_size, grad_accum)
        for _ in range(steps):
            step = new.next_step()
            # one difference, a fix: with drop_last, when the epoch's short last batch was alone in its window,
            # walking the windows never marked the epoch's last micro-batch (that window dealt none)
            fixed = plan.bucketing is None
            assert _view(step.micro_batches, ends=not fixed) == _view(reference_step(old), ends=not fixed)
            if fixed:
                per_epoch = new._form.per_epoch
                assert [mb.ends_epoch for mb in step.micro_batches] == [
                    mb.index == per_epoch - 1 for mb in step.micro_batches
                ]
            for rank in range(world_size):
                assert _view(step.for_rank(rank)) == _view(step.micro_batches[rank::world_size])
            assert new.state_dict() == old.state_dict()
            dealt += 1
            if dealt == resume_at:
                resumed = PlanCursor(plan.with_config(plan.config), world_size=world_size, grad_accum=grad_accum)
                resumed.load_state_dict(new.state_dict())
                new = resumed


@st.composite
def _shards(draw: st.DrawFn) -> tuple[int, list[int]]:
    sizes = draw(st.lists(st.integers(0, 9), min_size=1, max_size=12).filter(lambda s: sum(s) > 0))
    return sum(sizes), sizes


_TOPOLOGIES = st.lists(st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 8)), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    shards=_shards(),
    batch=st.integers(1, 7),
    window_batches=st.integers(1, 4),
    shuffle=st.sampled_from(["permutation", "shard_block", "none"]),
    drop_last=st.booleans(),
    topologies=_TOPOLOGIES,
    resume_at=st.integers(0, 12),
)
def test_fixed_batches_in_closed_form_deal_what_walking_the_windows_deals(
    shards: tuple[int, list[int]],
    batch: int,
    window_batches: int,
    shuffle: str,
    drop_last: bool,
    topologies: list[tuple[int, int, int]],
    resume_at: int,
) -> None:
    num_samples, sizes = shards
    if drop_last and num_samples < batch:
        batch = num_samples  # the plan refuses an epoch that drop_last would drop whole
    _compare(_fixed_plan(num_samples, batch, window_batches * batch, shuffle, drop_last, sizes), topologies, resume_at)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    num_samples=st.integers(40, 400),
    window=st.integers(20, 200),
    budget=st.sampled_from([3000.0, 8000.0, 20000.0]),
    mode=st.sampled_from(["budget", "packing"]),
    topologies=_TOPOLOGIES,
    resume_at=st.integers(0, 12),
)
def test_a_budget_s_steps_as_runs_of_windows_deal_what_walking_them_deals(
    num_samples: int, window: int, budget: float, mode: str, topologies: list[tuple[int, int, int]], resume_at: int
) -> None:
    bucketing = BucketingConfig(mode=mode, budget=budget, overlong="alone" if mode == "budget" else "split")
    config = PlanConfig(seed=5, window_size=window, bucketing=bucketing)
    plan = Plan(num_samples, config, index_fingerprint=FP, lengths=synthetic_lengths(num_samples))
    _compare(plan, topologies, resume_at)


def test_a_step_of_a_large_world_computes_only_what_a_rank_asks_for() -> None:
    """dp 4,096 × accum 16 over a billion samples: one rank's 16 micro-batches, the stream evaluated for them
    alone."""
    plan = Plan(10**9, PlanConfig(seed=1, batch_size=8), index_fingerprint=FP)
    cursor = PlanCursor(plan, world_size=4096, grad_accum=16)
    cursor.next_step()
    work = plan.work
    mine = cursor.next_step().for_rank(4095)
    assert [mb.index for mb in mine] == [65536 + a * 4096 + 4095 for a in range(16)]
    assert plan.work - work == 16 * 8
