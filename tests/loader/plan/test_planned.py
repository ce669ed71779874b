"""A budget's epochs written ahead (`write_planned_epochs`) deal what planning them live deals: the same micro-batches
in the same order and the same state after every step, for any world size, accumulation, resize history, resume point
and budget change, and into epochs that were not written; while on them, nothing is planned. Files that do not check
out are set aside with a warning, never trusted."""

from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_mixture import synthetic_lengths as mixture_lengths
from test_plan import FP, synthetic_lengths

from omnifeed.bucketing import BucketingConfig
from omnifeed.loader.plan import (
    MicroBatch,
    MixtureConfig,
    Plan,
    PlanConfig,
    PlanCursor,
    PlannedEpochs,
    mixture_stream,
    planned_epochs,
    steps_left_in_epoch,
    write_planned_epochs,
)
from omnifeed.loader.plan._planned import plans_directory


def _view(micro_batches: list[MicroBatch] | tuple[MicroBatch, ...]) -> list[tuple[Any, ...]]:
    return [(mb.epoch, mb.index, mb.window, mb.positions.tolist(), mb.cost, mb.ends_epoch) for mb in micro_batches]


def _plans(num_samples: int, config: PlanConfig, folder: Path, epochs: range) -> tuple[Plan, Plan]:
    """The plan planned live, and the same plan over ``folder`` with ``epochs`` written ahead there."""
    lengths = synthetic_lengths(num_samples)
    writer = Plan(num_samples, config, index_fingerprint=FP, lengths=lengths, index_path=folder)
    write_planned_epochs(writer, folder, epochs)
    return (
        Plan(num_samples, config, index_fingerprint=FP, lengths=lengths),
        Plan(num_samples, config, index_fingerprint=FP, lengths=lengths, index_path=folder),
    )


def _budget(window: int, budget: float, carry: int = 256, tiers: bool = True) -> PlanConfig:
    bucketing = BucketingConfig(
        budget=budget,
        overlong="alone",
        carry=carry,
        tier_width=0.02 if tiers else None,
        min_budget=budget / 4,
        max_budget=budget * 2,
    )
    return PlanConfig(seed=7, window_size=window, bucketing=bucketing)


_TOPOLOGIES = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 10)), min_size=1, max_size=4)

Cursors = tuple[PlanCursor, PlanCursor]
AfterStep = Callable[[int, int, int, PlanCursor, PlanCursor], Cursors]


def _deal_alongside(
    live: PlanCursor,
    planned: PlanCursor,
    topologies: list[tuple[int, int, int]],
    after: AfterStep,
    *,
    every_rank: bool = False,
    view: Callable[[Any], Any] = _view,
) -> Cursors:
    """Deal both cursors through ``topologies`` (world size, accumulation, steps), asserting after each step that
    they dealt the same (every rank's share, or the last rank's) and stand in the same state; ``after(dealt, world
    size, accumulation, live, planned)`` may then change or replace either cursor."""
    dealt = 0
    for world_size, grad_accum, steps in topologies:
        live.resize(world_size, grad_accum)
        planned.resize(world_size, grad_accum)
        for _ in range(steps):
            expected, step = live.next_step(), planned.next_step()
            assert _view(step.micro_batches) == _view(expected.micro_batches)
            for rank in range(world_size) if every_rank else (world_size - 1,):
                assert view(step.for_rank(rank)) == view(expected.for_rank(rank))
            assert planned.state_dict() == live.state_dict()
            dealt += 1
            live, planned = after(dealt, world_size, grad_accum, live, planned)
    return live, planned


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_samples=st.integers(30, 500),
    window=st.integers(15, 200),
    budget=st.sampled_from([3000.0, 8000.0, 20000.0]),
    carry=st.sampled_from([0, 3, 256]),
    tiers=st.booleans(),
    written=st.sampled_from([range(0, 1), range(0, 2), range(1, 3)]),
    topologies=_TOPOLOGIES,
    resume_at=st.integers(0, 14),
    feedback_at=st.one_of(st.none(), st.integers(0, 14)),
)
def test_written_epochs_deal_what_live_planning_deals(
    tmp_path_factory: pytest.TempPathFactory,
    num_samples: int,
    window: int,
    budget: float,
    carry: int,
    tiers: bool,
    written: range,
    topologies: list[tuple[int, int, int]],
    resume_at: int,
    feedback_at: int | None,
) -> None:
    live_plan, planned_plan = _plans(
        num_samples, _budget(window, budget, carry, tiers), tmp_path_factory.mktemp("planned"), written
    )

    def after(dealt: int, world_size: int, grad_accum: int, live: PlanCursor, planned: PlanCursor) -> Cursors:
        assert steps_left_in_epoch(planned_plan, planned.state_dict()) == steps_left_in_epoch(
            live_plan, live.state_dict()
        )
        if dealt == feedback_at:  # memory feedback: the budget changes from the next window on, then back
            for cursor in (live, planned):
                cursor.report_headroom(0.9)
        if feedback_at is not None and dealt == feedback_at + 3:
            for cursor in (live, planned):
                cursor.next_budget = cursor.plan.budget
        if dealt == resume_at:
            resumed = PlanCursor(
                planned_plan.with_config(planned_plan.config), world_size=world_size, grad_accum=grad_accum
            )
            resumed.load_state_dict(planned.state_dict())
            planned = resumed
        return live, planned

    _deal_alongside(PlanCursor(live_plan), PlanCursor(planned_plan), topologies, after, every_rank=True)


def test_on_written_epochs_nothing_is_planned_at_any_world_size(tmp_path: Path) -> None:
    """Steps, a resize to a world whose step is half an epoch, a resume and `len`: look-ups (no stream evaluated)."""
    _, plan = _plans(6000, _budget(600, 8000.0), tmp_path, range(0, 3))
    found = planned_epochs(plan)
    assert found is not None
    written = found.epoch(0)
    assert written is not None
    world = written.size // 4
    cursor = PlanCursor(plan, world_size=64, grad_accum=2)
    for _ in range(3):
        cursor.next_step().for_rank(5)
    cursor.resize(world, 2)
    start = cursor.micro_batch
    step = cursor.next_step()
    assert [mb.index for mb in step.for_rank(world - 1)] == [start + world - 1, start + 2 * world - 1]
    resumed = PlanCursor(plan, world_size=7)
    resumed.load_state_dict(cursor.state_dict())
    resumed.next_step()
    assert steps_left_in_epoch(plan, resumed.state_dict()) >= 1
    assert plan.work == 0


def test_epochs_past_the_written_ones_are_planned_live_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live_plan, plan = _plans(600, _budget(150, 8000.0), tmp_path, range(0, 1))
    live, cursor = PlanCursor(live_plan, world_size=3), PlanCursor(plan, world_size=3)
    with caplog.at_level(logging.INFO):
        while cursor.epoch < 2:
            assert _view(cursor.next_step().micro_batches) == _view(live.next_step().micro_batches)
    assert plan.work > 0 and cursor.state_dict() == live.state_dict()
    assert "epochs [0] of this budget written ahead" in caplog.text
    assert caplog.text.count("epoch 1 of this budget was not written ahead") == 1 and "--epoch 1" in caplog.text


def _damage_costs(folder: Path) -> None:
    np.save(folder / "costs.npy", np.load(folder / "costs.npy")[:-1])


def _other_budget(folder: Path) -> None:
    header = json.loads((folder / "epoch.json").read_text())
    (folder / "epoch.json").write_text(json.dumps({**header, "budget": 1.0}))


def _missing_array(folder: Path) -> None:
    (folder / "bounds.npy").unlink()


def _truncated_positions(folder: Path) -> None:
    path = folder / "positions.npy"
    path.write_bytes(path.read_bytes()[:-8])


def _not_json(folder: Path) -> None:
    (folder / "epoch.json").write_text("{")


@pytest.mark.parametrize("damage", [_damage_costs, _other_budget, _missing_array, _truncated_positions, _not_json])
def test_files_that_do_not_check_out_are_set_aside_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any
) -> None:
    live_plan, plan = _plans(500, _budget(120, 8000.0), tmp_path, range(0, 1))
    damage(plans_directory(tmp_path, plan) / "epoch-0")
    live, cursor = PlanCursor(live_plan, world_size=2), PlanCursor(plan, world_size=2)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            assert _view(cursor.next_step().micro_batches) == _view(live.next_step().micro_batches)
    assert "epoch-0: planned epoch not used" in caplog.text and "--write-epochs" in caplog.text
    assert plan.work > 0


def test_a_state_of_another_budget_history_is_planned_live(tmp_path: Path) -> None:
    """A state saved while memory feedback had the budget elsewhere is off the written path: planned live."""
    live_plan, plan = _plans(900, _budget(150, 8000.0), tmp_path, range(0, 1))
    source = PlanCursor(live_plan, world_size=2)
    source.report_headroom(0.9)
    for _ in range(12):
        source.next_step()
    source.next_budget = live_plan.budget
    live, cursor = PlanCursor(live_plan, world_size=2), PlanCursor(plan, world_size=2)
    live.load_state_dict(source.state_dict())
    cursor.load_state_dict(source.state_dict())
    while cursor.epoch < 1:
        assert _view(cursor.next_step().micro_batches) == _view(live.next_step().micro_batches)
        assert cursor.state_dict() == live.state_dict()


def test_fixed_size_batches_are_not_written(tmp_path: Path) -> None:
    fixed = Plan(100, PlanConfig(batch_size=4), index_fingerprint=FP, index_path=tmp_path)
    with pytest.raises(ValueError, match="only a cost budget's or packing's epochs are planned ahead"):
        write_planned_epochs(fixed, tmp_path, range(1))
    assert PlannedEpochs.find(tmp_path, fixed) is None and not (tmp_path / "plans").exists()


def _packs(micro_batches: list[MicroBatch] | tuple[MicroBatch, ...]) -> list[Any]:
    return [None if mb.pack is None else mb.pack.segments for mb in micro_batches]


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_samples=st.integers(30, 400),
    window=st.integers(15, 200),
    capacity=st.sampled_from([64, 256, 1024, 4096]),
    written=st.sampled_from([range(0, 1), range(0, 2), range(1, 3)]),
    topologies=_TOPOLOGIES,
    resume_at=st.integers(0, 14),
)
def test_packing_s_written_epochs_deal_the_same_packs(
    tmp_path_factory: pytest.TempPathFactory,
    num_samples: int,
    window: int,
    capacity: int,
    written: range,
    topologies: list[tuple[int, int, int]],
    resume_at: int,
) -> None:
    """Packs (each sample's slice of its sequence: ``cu_seqlens``, ``position_ids``) looked up as planned live."""
    bucketing = BucketingConfig(mode="packing", budget=capacity, overlong="split", pack_stream="text")
    live_plan, planned_plan = _plans(
        num_samples, PlanConfig(seed=3, window_size=window, bucketing=bucketing), tmp_path_factory.mktemp("p"), written
    )

    def after(dealt: int, world_size: int, grad_accum: int, live: PlanCursor, planned: PlanCursor) -> Cursors:
        if dealt == resume_at:
            resumed = PlanCursor(planned_plan.with_config(planned_plan.config), world_size=world_size)
            resumed.resize(world_size, grad_accum)
            resumed.load_state_dict(planned.state_dict())
            planned = resumed
        return live, planned

    _deal_alongside(PlanCursor(live_plan), PlanCursor(planned_plan), topologies, after, view=_packs)
    if 0 in written:
        assert planned_epochs(planned_plan) is not None and planned_plan.work < live_plan.work


def test_another_config_finds_no_written_epochs(tmp_path: Path) -> None:
    _, plan = _plans(300, _budget(100, 8000.0), tmp_path, range(0, 1))
    assert planned_epochs(plan) is not None and planned_epochs(plan).epoch(0) is not None
    other = plan.with_config(_budget(100, 9000.0))
    assert planned_epochs(other) is None


def test_a_plan_that_fails_leaves_no_epoch_behind(tmp_path: Path) -> None:
    from omnifeed.loader import OmnifeedError

    config = PlanConfig(seed=1, window_size=50, bucketing=BucketingConfig(budget=100.0, overlong="reject"))
    plan = Plan(200, config, index_fingerprint=FP, lengths=synthetic_lengths(200), index_path=tmp_path)
    with pytest.raises(OmnifeedError, match="over the micro-batch budget"):
        write_planned_epochs(plan, tmp_path, range(1))
    assert list(plans_directory(tmp_path, plan).iterdir()) == []


def _mixture(
    sizes: list[int], weights: list[float], config: PlanConfig, folder: Path | None, until: int | None = None
) -> Plan:
    """A budgeted mixture of ``sizes`` sources (captions, documents, speech) at ``weights``, its written epochs in
    ``folder`` (None: none); ``until``: the weights hold until that mixed sample, then the sources' reversed."""
    names = [f"s{i}" for i in range(len(sizes))]
    phases = [] if until is None else [{"until_samples": until, "weights": dict(zip(names, weights))}]
    mixture = MixtureConfig(
        sources={n: {"index": n, "weight": w} for n, w in zip(names, weights[::-1] if until else weights)},
        phases=phases,
        plans=None if folder is None else str(folder),
    )
    columns = mixture_lengths(sizes, 5)
    stream = mixture_stream(mixture, sizes, config.seed)
    return Plan(
        stream.num_samples,
        config.model_copy(update={"mixture": mixture}),
        index_fingerprint="synthetic",
        lengths=lambda p: {k: v[p] for k, v in columns.items()},
        mixture=stream,
    )


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(60, 400), min_size=2, max_size=3),
    weights=st.lists(st.sampled_from([0.1, 0.3, 0.5, 1.0]), min_size=3, max_size=3),
    until=st.one_of(st.none(), st.integers(50, 900)),
    window=st.integers(40, 300),
    budget=st.sampled_from([8000.0, 20000.0]),
    carry=st.sampled_from([0, 256]),
    written=st.sampled_from([range(0, 2), range(1, 3)]),
    topologies=_TOPOLOGIES,
    resume_at=st.integers(0, 14),
    change_at=st.one_of(st.none(), st.integers(1, 14)),
    rewrite=st.booleans(),
)
def test_a_mixture_s_written_epochs_deal_what_live_planning_deals_through_a_weight_change(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    weights: list[float],
    until: int | None,
    window: int,
    budget: float,
    carry: int,
    written: range,
    topologies: list[tuple[int, int, int]],
    resume_at: int,
    change_at: int | None,
    rewrite: bool,
) -> None:
    """Phases, resizes, resumes and a mid-run weight change (`allow_mixture_change`): the files are followed while
    the schedule is theirs; after the change the new weights' epochs written from scratch are not (each source goes
    on from its count), those written from the changed state (``rewrite``) are."""
    folder = tmp_path_factory.mktemp("planned")
    config = _budget(window, budget, carry)
    weights = weights[: len(sizes)]
    write_planned_epochs(_mixture(sizes, weights, config, folder, until), None, written)
    live_plan, planned_plan = (
        _mixture(sizes, weights, config, None, until),
        _mixture(sizes, weights, config, folder, until),
    )

    def after(dealt: int, world_size: int, grad_accum: int, live: PlanCursor, planned: PlanCursor) -> Cursors:
        if dealt not in (resume_at, change_at):
            return live, planned
        changed = dealt == change_at
        others = weights[::-1] if changed else weights
        state = planned.state_dict()
        live = PlanCursor(_mixture(sizes, others, config, None, until), world_size=world_size, grad_accum=grad_accum)
        live.load_state_dict(state, allow_mixture_change=changed)
        plan = _mixture(sizes, others, config, folder, until)
        if changed:  # the new weights' epochs, from scratch or from the changed state
            writer = _mixture(sizes, others, config, folder, until)
            if rewrite:
                PlanCursor(writer).load_state_dict(state, allow_mixture_change=True)
            write_planned_epochs(writer, None, range(live.epoch + 1, live.epoch + 3) if rewrite else written)
        planned = PlanCursor(plan, world_size=world_size, grad_accum=grad_accum)
        planned.load_state_dict(state, allow_mixture_change=changed)
        return live, planned

    live, planned = _deal_alongside(PlanCursor(live_plan), PlanCursor(planned_plan), topologies, after)
    assert steps_left_in_epoch(planned.plan, planned.state_dict()) == steps_left_in_epoch(live.plan, live.state_dict())


def test_a_mixture_s_written_epochs_are_dealt_by_look_up_until_its_weights_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing planned on the written epochs at any world size; a weight change goes live (the files are of the old
    schedule), and the new weights' epochs written from the changed state are looked up again."""
    sizes, weights, config = [900, 400, 300], [0.5, 0.3, 0.2], _budget(300, 8000.0)
    write_planned_epochs(_mixture(sizes, weights, config, tmp_path), None, range(0, 3))
    plan = _mixture(sizes, weights, config, tmp_path)
    found = planned_epochs(plan)
    assert found is not None and (epoch := found.epoch(0)) is not None and epoch.schedule is not None
    cursor = PlanCursor(plan, world_size=epoch.size // 4, grad_accum=2)
    cursor.next_step()
    cursor.resize(3)
    for _ in range(4):
        cursor.next_step().for_rank(2)
    assert plan.work == 0 and cursor.epoch == 0
    state = cursor.state_dict()
    other = _mixture(sizes, weights[::-1], config, tmp_path)
    changed = PlanCursor(other, world_size=3)
    changed.load_state_dict(state, allow_mixture_change=True)
    while changed.epoch < 1:
        changed.next_step()
    assert other.work > 0  # the old weights' files do not hold; the new weights' are not written
    write_planned_epochs(_mixture(sizes, weights[::-1], config, tmp_path), None, range(1, 2))  # from scratch
    stale = _mixture(sizes, weights[::-1], config, tmp_path)
    resumed = PlanCursor(stale, world_size=3)
    resumed.load_state_dict(changed.state_dict())
    with caplog.at_level(logging.WARNING):
        resumed.next_step()
    assert stale.work > 0 and "written under another history of this mixture's weights" in caplog.text
    writer = _mixture(sizes, weights[::-1], config, tmp_path)
    PlanCursor(writer).load_state_dict(state, allow_mixture_change=True)
    write_planned_epochs(writer, None, range(1, 2))
    again = _mixture(sizes, weights[::-1], config, tmp_path)
    resumed = PlanCursor(again, world_size=3)
    resumed.load_state_dict(changed.state_dict())
    while resumed.epoch < 2:
        resumed.next_step()
    assert again.work == 0


def test_a_mixture_without_a_plans_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    plan = _mixture([300, 200], [0.5, 0.5], _budget(100, 8000.0), None)
    with pytest.raises(ValueError, match="set plan.mixture.plans"):
        write_planned_epochs(plan, None, range(1))
    assert planned_epochs(plan) is None


def test_a_long_run_keeps_a_few_epochs_files_open(tmp_path: Path) -> None:
    """Epoch after epoch, the files of old ones are closed again (a run of many epochs runs out of no descriptors)."""
    _, plan = _plans(200, _budget(100, 20000.0), tmp_path, range(0, 12))
    before = len(os.listdir("/proc/self/fd"))
    cursor = PlanCursor(plan, world_size=4)
    while cursor.epoch < 12:
        cursor.next_step()
    assert plan.work == 0
    del cursor
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) - before <= 4 * 6


def test_steps_spanning_windows_planned_live_say_once_how_to_write_the_epochs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A world whose step spans whole windows, with nothing written: one warning naming the command; a small world
    whose steps stay within a window: none."""
    lengths = synthetic_lengths(3000)
    plan = Plan(3000, _budget(100, 8000.0), index_fingerprint=FP, lengths=lengths, index_path=tmp_path)
    with caplog.at_level(logging.WARNING):
        small = PlanCursor(plan, world_size=1)
        for _ in range(5):
            small.next_step()
        assert "planned" not in caplog.text
        large = PlanCursor(plan, world_size=64, grad_accum=4)
        for _ in range(3):
            large.next_step()
    assert caplog.text.count("windows live") == 1 and "--write-epochs" in caplog.text
