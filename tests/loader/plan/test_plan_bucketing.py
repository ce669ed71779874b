"""The plan with bucketing and packing: budgets, pack metadata, memory feedback across resumes, reports."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_plan import FP, synthetic_lengths

from omnifeed.bucketing import BucketingConfig, CostModel, padded_cost
from omnifeed.loader import OmnifeedError, Plan, PlanConfig, PlanCursor
from omnifeed.loader.plan import PlanReport, alone_costs, budget_guidance, suggest_budget

N = 3000


def _plan(window_size: int = 1500, **bucketing: object) -> Plan:
    config = PlanConfig(seed=2, window_size=window_size, bucketing=BucketingConfig(**bucketing))
    return Plan(N, config, index_fingerprint=FP, lengths=synthetic_lengths(N))


def _epoch(plan: Plan, world_size: int = 4) -> list:
    cursor, out = PlanCursor(plan, world_size=world_size), []
    while not cursor.epoch_delivered(0):
        out.extend(mb for mb in cursor.next_step().micro_batches if mb.epoch == 0)
    return out


def test_budgets_are_never_exceeded_and_costs_are_padded_costs() -> None:
    plan = _plan(budget=20000, overlong="alone")
    for mb in _epoch(plan):
        lengths = plan.stream_lengths(mb.positions)
        assert mb.cost == pytest.approx(padded_cost(lengths, plan.bucketing.cost))
        assert mb.cost <= 20000 or len(mb.positions) == 1


def _text_only(positions: np.ndarray) -> dict[str, np.ndarray]:
    columns = synthetic_lengths(N)(positions)
    return {name: values if name == "text_tokens" else np.zeros_like(values) for name, values in columns.items()}


def test_bucketing_pads_far_less_than_fixed_size_batches() -> None:
    budgeted = PlanConfig(seed=2, window_size=N, bucketing=BucketingConfig(budget=4000, overlong="alone"))
    reports = [
        PlanReport(Plan(N, config, index_fingerprint=FP, lengths=_text_only))
        for config in (budgeted, PlanConfig(seed=2, batch_size=16))
    ]
    for report in reports:
        cursor = PlanCursor(report.plan, world_size=4)
        while not cursor.epoch_delivered(0):
            report.add(cursor.next_step())
    bucketed, fixed = (r.stats() for r in reports)
    assert bucketed["padding_fraction"]["text"] < 0.07 < 0.5 < fixed["padding_fraction"]["text"]
    assert bucketed["balance_max_over_mean"]["mean"] < 1.05 < fixed["balance_max_over_mean"]["mean"]


def test_packs_carry_consistent_boundaries_and_never_exceed_capacity() -> None:
    plan = _plan(mode="packing", budget=700, overlong="split")
    tokens = synthetic_lengths(N)(np.arange(N))["text_tokens"]
    covered = np.zeros(N, dtype=np.int64)
    for mb in _epoch(plan):
        pack = mb.pack
        assert pack is not None and pack.length <= 700 and mb.cost == pack.length
        assert pack.cu_seqlens[-1] == pack.length == len(pack.position_ids)
        for segment in pack.segments:
            covered[segment.position] += segment.stop - segment.start
            assert segment.stop <= tokens[segment.position]
    assert np.array_equal(covered, tokens), "every token of every sample is packed exactly once"


def test_an_overlong_sample_is_refused_naming_it() -> None:
    plan = Plan(
        N,
        PlanConfig(bucketing=BucketingConfig(budget=50)),
        index_fingerprint=FP,
        lengths=synthetic_lengths(N),
        describe=lambda p: f"key-{p}",
    )
    with pytest.raises(OmnifeedError, match=r"sample key-\d+ costs .* over the micro-batch budget 50"):
        _epoch(plan)


def test_memory_feedback_replays_identically_after_resume() -> None:
    def run(resume_at: int | None) -> list[tuple[float | None, float, tuple[int, ...]]]:
        config = dict(window_size=200, budget=20000, overlong="alone", min_budget=2000)
        cursor, out = PlanCursor(_plan(**config), world_size=2), []
        for step_number in range(40):
            if step_number == resume_at:
                state = json.loads(json.dumps(cursor.state_dict()))
                cursor = PlanCursor(_plan(**config), world_size=2)
                cursor.load_state_dict(state)
            budget = cursor.budget
            step = cursor.next_step()
            out.extend((budget, mb.cost, tuple(mb.positions.tolist())) for mb in step.micro_batches)
            if step_number % 7 == 3:  # the trainer reports little headroom now and then
                cursor.report_headroom(0.02 if step_number < 20 else 0.5)
        return out

    uninterrupted = run(None)
    budgets = [budget for budget, _, _ in uninterrupted]
    assert min(budgets) < 20000 and budgets[-1] > min(budgets), "feedback lowered, then raised the budget"
    for resume_at in (5, 11, 23):
        assert run(resume_at) == uninterrupted


def test_feedback_stays_within_bounds() -> None:
    cursor = PlanCursor(_plan(budget=20000, min_budget=5000, max_budget=30000))
    for _ in range(50):
        cursor.report_headroom(0.0)
    assert cursor.next_budget == 5000
    for _ in range(50):
        cursor.report_headroom(0.9)
    assert cursor.next_budget == 30000
    assert PlanCursor(Plan(N, PlanConfig(), index_fingerprint=FP)).report_headroom(0.5) is None


def test_cost_model_weights_change_the_budget_accounting() -> None:
    heavy_text = _plan(
        budget=20000, overlong="alone", cost=CostModel(weights={"text": 4.0, "image": 1.0, "video": 1.0, "audio": 1.0})
    )
    light_text = _plan(budget=20000, overlong="alone")
    assert len(_epoch(heavy_text)) > len(_epoch(light_text))


def _balance(plan: Plan, world_size: int) -> dict[str, float]:
    report, cursor = PlanReport(plan), PlanCursor(plan, world_size=world_size)
    while not cursor.epoch_delivered(0):
        report.add(cursor.next_step())
    return report.stats()["balance_max_over_mean"]


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_cost_tiers_make_steps_even_at_any_world_size(world_size: int) -> None:
    tiers = _balance(_plan(budget=20000, overlong="alone", window_size=N), world_size)
    shuffled = _balance(_plan(budget=20000, overlong="alone", window_size=N, tier_width=None), world_size)
    assert tiers["mean"] < 1.05 and tiers["mean"] <= shuffled["mean"] + 0.005


def test_budget_guidance_counts_samples_over_budget_and_the_budgets_that_hold_them() -> None:
    plan = _plan(budget=600, overlong="alone")
    costs, guidance = alone_costs(plan), budget_guidance(plan)
    assert guidance["samples_over_budget"] == int((costs > 600).sum()) > 0
    assert guidance["budget_holding_100"] == np.ceil(costs.max())
    assert (costs <= guidance["budget_holding_99"]).mean() >= 0.99


def test_suggest_budget_hits_the_samples_per_micro_batch_asked_for() -> None:
    suggestion = suggest_budget(_plan(budget=20000, overlong="alone"), 12)
    assert 11 <= suggestion["samples_per_micro_batch"] <= 13
    with pytest.raises(ValueError, match="1 or more"):
        suggest_budget(_plan(budget=20000), 0.5)


def _windows(plan: Plan) -> list:
    """Epoch 0's window plans, each planned with what the one before carried into it."""
    out, window, start, carried = [], 0, 0, np.empty(0, dtype=np.int64)
    while True:
        planned = plan.window(0, window, start, carried=carried)
        out.append((carried, planned))
        if planned.last:
            return out
        window, start, carried = window + 1, planned.next_start, planned.carry


def test_light_leftovers_are_carried_to_the_next_window_and_only_the_epochs_last_keeps_any() -> None:
    budget = 20000
    plan = _plan(budget=budget, overlong="alone", window_size=400)
    windows = _windows(plan)
    assert any(p.carry.size for _, p in windows), "this mix leaves light leftovers to carry"
    assert windows[-1][1].carry.size == 0
    for carried, planned in windows:
        dealt = np.concatenate([mb.positions for mb in planned.micro_batches] + [planned.carry])
        assert set(carried.tolist()) <= set(dealt.tolist()), "what is carried in is dealt or carried on"
        if not planned.last:  # no leftover with room for another sample stays behind
            assert all(
                mb.cost >= 0.75 * budget or mb.cost * (mb.positions.size + 1) / mb.positions.size > budget
                for mb in planned.micro_batches
            )
    seen = np.concatenate([mb.positions for _, p in windows for mb in p.micro_batches])
    assert sorted(seen.tolist()) == list(range(N))


def test_carrying_evens_the_steps_and_off_restores_the_old_plan() -> None:
    carried = _balance(_plan(budget=20000, overlong="alone", window_size=400), 4)
    kept = _balance(_plan(budget=20000, overlong="alone", window_size=400, carry=0), 4)
    assert carried["worst"] < kept["worst"]
    assert all(p.carry.size == 0 for _, p in _windows(_plan(budget=20000, overlong="alone", window_size=400, carry=0)))


def test_a_state_with_carried_ids_resumes_exactly_and_bad_carried_ids_are_refused_in_one_line() -> None:
    plan = _plan(budget=20000, overlong="alone", window_size=400, carry=64)
    cursor = PlanCursor(plan, world_size=2)
    while not cursor.carried.size:
        cursor.next_step()
    state = json.loads(json.dumps(cursor.state_dict()))
    assert 0 < len(state["carried"]) <= 64
    resumed = PlanCursor(_plan(budget=20000, overlong="alone", window_size=400, carry=64), world_size=3)
    resumed.load_state_dict(state)
    first, second = [], []
    for source, out in ((cursor, first), (resumed, second)):
        while not source.epoch_delivered(0):
            out.extend(mb.positions.tolist() for mb in source.next_step().micro_batches if mb.epoch == 0)
    assert first == second
    for bad, named in (
        (state["carried"][:1] * 2, "repeated positions"),
        ([N], "outside this index"),
        (list(range(65)), "carries at most 64"),
        ([True], "list of sample positions"),
    ):
        with pytest.raises(ValueError, match=named) as raised:
            PlanCursor(plan).load_state_dict(state | {"carried": bad})
        assert "\n" not in str(raised.value)


def _report(plan: Plan, world_size: int) -> dict:
    report, cursor = PlanReport(plan), PlanCursor(plan, world_size=world_size)
    while not cursor.epoch_delivered(0):
        report.add(cursor.next_step())
    return report.stats()


def _columns(n: int, seed: int = 0, speech: float = 0.0, long_documents: int = 0) -> dict[str, np.ndarray]:
    """Documents (a few ``long_documents`` far over the budget), or a share of short speech with transcripts."""
    from omnifeed.bucketing import INDEX_COLUMNS

    rng = np.random.default_rng(seed)
    columns = {name: np.zeros(n) for name in INDEX_COLUMNS}
    talk = rng.random(n) < speech
    columns["audio_seconds"] = np.where(talk, np.clip(rng.lognormal(1.0, 0.8, n), 0.3, 30), 0)
    tokens = np.where(talk, columns["audio_seconds"] * 3, rng.lognormal(5.0, 0.8, n))
    tokens[:long_documents] = 12000 + 3000 * np.arange(long_documents)
    columns["text_tokens"] = np.maximum(tokens, 1).astype(np.int64)
    return columns


def _plan_of(columns: dict[str, np.ndarray], budget: float, **config: object) -> Plan:
    bucketing = BucketingConfig(budget=budget, overlong="alone")
    cfg = PlanConfig(seed=2, bucketing=bucketing, **config)  # type: ignore[arg-type]
    return Plan(
        len(columns["text_tokens"]), cfg, index_fingerprint=FP, lengths=lambda p: {k: v[p] for k, v in columns.items()}
    )


def test_stats_report_the_worst_step_apart_from_the_final_one_and_no_limit_when_targets_are_met() -> None:
    plan = _plan_of(_columns(6000), 4000)
    stats, costs = _report(plan, 3), []
    cursor = PlanCursor(plan, world_size=3)
    while not cursor.epoch_delivered(0):
        step = cursor.next_step()
        if not any(mb.ends_epoch for mb in step.micro_batches):
            costs.append([mb.cost for mb in step.micro_batches])
    assert stats["balance_worst_before_final_step"] == pytest.approx(max(max(c) / np.mean(c) for c in costs), rel=1e-5)
    assert stats["final_step_balance"] is not None and len(stats["worst_step"]) == 3
    assert stats["limits"] == [] and stats["padding_fraction"]["text"] <= stats["targets"]["padding_fraction"]
    assert stats["padding_estimate"]["text"] <= 0.03


def test_stats_name_overlong_samples_when_they_unbalance_a_step() -> None:
    stats = _report(_plan_of(_columns(6000, long_documents=3), 4000), 4)
    assert stats["balance_worst_before_final_step"] > 1.15
    assert any(line.startswith("overlong samples") for line in stats["limits"]), stats["limits"]


def test_stats_name_the_rare_stream_a_small_window_cannot_make_tight() -> None:
    stats = _report(_plan_of(_columns(6000, speech=0.02), 4000, window_size=600), 2)
    assert stats["padding_fraction"]["audio"] > 0.03
    assert any(line.startswith("window too small for stream audio") for line in stats["limits"]), stats["limits"]
    whole = _report(_plan_of(_columns(3000, speech=0.01), 4000), 2)
    assert any(line.startswith("epoch too small for stream audio") for line in whole["limits"]), whole["limits"]
