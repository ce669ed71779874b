"""Mixtures (issue 31): the schedule's shares and exactly once per source epoch, through resizes, budgets and
packing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.bucketing import BucketingConfig, CostModel
from omnifeed.loader import StateMismatchError
from omnifeed.loader.plan import MixtureConfig, Plan, PlanConfig, PlanCursor, mixture_stream
from omnifeed.loader.plan._mixture import MixturePhase, MixtureSchedule

COST = CostModel(video_fps=2.0, video_max_frames=16)


@st.composite
def schedules(draw: st.DrawFn) -> MixtureSchedule:
    """1–5 sources of 1–300 samples, 1–3 phases of random weights (some 0, not all)."""
    count = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 300), min_size=count, max_size=count))
    phases, start = [], 0
    for _ in range(draw(st.integers(1, 3))):
        weights = draw(st.lists(st.sampled_from([0.0, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5]), min_size=count, max_size=count))
        if not sum(weights):
            weights[draw(st.integers(0, count - 1))] = 1.0
        phases.append(MixturePhase(start, tuple(weights)))
        start += draw(st.integers(1, 900))
    return MixtureSchedule(sizes, phases, draw(st.integers(0, 2**32)), list(range(100, 100 + count)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(schedule=schedules(), cuts=st.lists(st.integers(0, 2500), min_size=1, max_size=6))
def test_any_slice_of_the_schedule_is_the_same_on_its_own_and_each_source_epoch_is_dealt_once(
    schedule: MixtureSchedule, cuts: list[int]
) -> None:
    whole_sources, whole = schedule.slice(0, 2500)
    bounds = sorted({0, 2500, *cuts})
    for a, b in zip(bounds, bounds[1:]):
        sources, samples = schedule.slice(a, b)
        assert sources.tolist() == whole_sources[a:b].tolist() and samples.tolist() == whole[a:b].tolist()
        assert schedule.counts(b).tolist() == np.bincount(whole_sources[:b], minlength=schedule.sizes.size).tolist()
    for s, size in enumerate(schedule.sizes.tolist()):
        mine = whole[whole_sources == s]
        for epoch in range(mine.size // size):  # every complete source epoch: each of its samples once
            assert sorted(mine[epoch * size : (epoch + 1) * size].tolist()) == list(range(size))
        assert len(set(mine[(mine.size // size) * size :].tolist())) == mine.size % size  # the current one: no repeat


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    weights=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=8),
    start=st.integers(0, 10**9),
    length=st.integers(1, 3000),
)
def test_every_run_of_the_mixed_stream_holds_each_source_at_its_weight_within_two_samples(
    weights: list[float], start: int, length: int
) -> None:
    schedule = MixtureSchedule([10**6] * len(weights), [MixturePhase(0, tuple(weights))], 0, list(range(len(weights))))
    sources, _ = schedule.slice(start, start + length)
    share = np.asarray(weights) / sum(weights)
    assert np.abs(np.bincount(sources, minlength=len(weights)) - length * share).max() <= 2.0


def test_phases_switch_the_weights_at_their_sample_and_each_source_goes_on_from_where_it_was() -> None:
    mixture = MixtureConfig(
        sources={"a": {"index": "a", "weight": 1}, "b": {"index": "b", "weight": 1}},
        phases=[{"until_samples": 1000, "weights": {"a": 0.8, "b": 0.2}}, {"weights": {"a": 0.1, "b": 0.9}}],
    )
    stream = mixture_stream(mixture, [5000, 5000], seed=1)
    first, second = stream.sources(0, 0, 1000), stream.sources(0, 1000, 3000)
    assert np.bincount(first, minlength=2).tolist() == [800, 200]  # exact at the phase's end
    assert np.bincount(second, minlength=2).tolist() == [200, 1800]
    b = stream.slice(0, 0, 3000)[np.concatenate([first, second]) == 1]
    assert len(set(b.tolist())) == b.size  # source b's 2,000 samples: one source epoch, none twice across phases


def test_repeat_weights_sources_by_passes_per_epoch_as_mosaic_streaming_does() -> None:
    mixture = MixtureConfig(sources={"big": {"index": "x", "repeat": 1}, "small": {"index": "y", "repeat": 3}})
    stream = mixture_stream(mixture, [900, 100], seed=2)
    assert stream.num_samples == 1200
    sources = stream.sources(0, 0, 1200)
    assert np.bincount(sources).tolist() == [900, 300]
    small = stream.slice(0, 0, 1200)[sources == 1] - 900
    assert [sorted(small[i * 100 : (i + 1) * 100].tolist()) for i in range(3)] == [list(range(100))] * 3


def synthetic_lengths(sizes: list[int], seed: int) -> dict[str, np.ndarray]:
    """Index length columns of sources one after another: captions with photos, documents, speech, by source."""
    rng = np.random.default_rng(seed)
    kinds = np.concatenate([np.full(n, i % 3) for i, n in enumerate(sizes)])
    total = kinds.size
    columns = {name: np.zeros(total) for name in ("text_tokens", "image_width", "image_height", "audio_seconds")}
    columns["image_width"] = np.where(kinds == 0, rng.integers(64, 2000, total), 0)
    columns["image_height"] = np.where(kinds == 0, rng.integers(64, 2000, total), 0)
    talk = np.clip(rng.lognormal(2.0, 0.7, total), 0.5, 300)
    columns["audio_seconds"] = np.where(kinds == 2, talk, 0)
    text = np.where(
        kinds == 1, rng.lognormal(5.5, 1.0, total), np.where(kinds == 2, talk * 3, rng.lognormal(2.5, 0.5, total))
    )
    columns["text_tokens"] = np.maximum(text, 1).astype(np.int64)
    for name in ("video_frames", "video_fps", "video_width", "video_height"):
        columns[name] = np.zeros(total)
    return columns


def mixture_plan(sizes: list[int], weights: list[float], mode: str, budget: float, seed: int = 3) -> Plan:
    names = [f"s{i}" for i in range(len(sizes))]
    mixture = MixtureConfig(sources={n: {"index": n, "weight": w} for n, w in zip(names, weights)})
    overlong = "alone" if mode == "budget" else "split"
    bucketing = BucketingConfig(budget=budget, cost=COST, overlong=overlong, mode=mode, pack_stream="text")
    config = PlanConfig(seed=seed, mixture=mixture, bucketing=bucketing, window_size=2000)
    columns = synthetic_lengths(sizes, seed)
    stream = mixture_stream(mixture, sizes, seed)
    return Plan(
        stream.num_samples,
        config,
        index_fingerprint="synthetic",
        lengths=lambda p: {k: v[p] for k, v in columns.items()},
        mixture=stream,
    )


def planned(plan: Plan, epoch: int) -> list[int]:
    assert plan.mixture is not None
    return sorted(plan.mixture.slice(epoch, 0, plan.num_samples).tolist())


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    sizes=st.lists(st.integers(200, 3000), min_size=2, max_size=4),
    weights=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4),
    mode=st.sampled_from(["budget", "packing"]),
    stops=st.lists(st.integers(1, 25), min_size=2, max_size=2),
)
def test_a_mixture_resized_4_3_6_mid_epoch_delivers_each_source_epoch_exactly_as_planned(
    sizes: list[int], weights: list[float], mode: str, stops: list[int]
) -> None:
    budget = 16384.0 if mode == "budget" else 4096.0
    plan = mixture_plan(sizes, weights[: len(sizes)], mode, budget)
    cursor, dealt = PlanCursor(plan, world_size=4), []
    for world, stop in ((3, stops[0]), (6, stops[1])):
        for _ in range(stop):
            dealt.extend(mb for mb in cursor.next_step().micro_batches if mb.epoch == 0)
        state = json.loads(json.dumps(cursor.state_dict()))
        cursor = PlanCursor(mixture_plan(sizes, weights[: len(sizes)], mode, budget), world_size=world)
        cursor.load_state_dict(state)
    while not cursor.epoch_delivered(0):
        dealt.extend(mb for mb in cursor.next_step().micro_batches if mb.epoch == 0)
    delivered = np.concatenate([mb.positions for mb in dealt]).tolist()
    if mode == "packing":  # a sample split over packs is in each of them: count it once per pass
        delivered = [p for mb in dealt for p, s in zip(mb.positions.tolist(), mb.pack.segments) if s.start == 0]
    assert sorted(delivered) == planned(plan, 0)


def test_the_state_of_a_hundred_source_mixture_is_a_few_integers() -> None:
    names = [f"source-{i:03d}" for i in range(100)]
    mixture = MixtureConfig(sources={n: {"index": n, "weight": 1 + i % 7} for i, n in enumerate(names)})
    stream = mixture_stream(mixture, [10_000_000] * 100, seed=0)
    plan = Plan(stream.num_samples, PlanConfig(mixture=mixture), index_fingerprint="big", mixture=stream)
    cursor = PlanCursor(plan, world_size=8)
    for _ in range(3):
        cursor.next_step()
    assert len(json.dumps(cursor.state_dict())) <= 1024 + 32 * 100


def test_realised_shares_hold_within_half_a_point_over_any_1000_micro_batches_with_a_budget() -> None:
    sizes, weights = [20_000, 20_000, 20_000], [0.5, 0.3, 0.2]
    plan = mixture_plan(sizes, weights, "budget", 16384.0)
    plan = plan.with_config(plan.config.model_copy(update={"window_size": None}))
    cursor, dealt = PlanCursor(plan, world_size=8), []
    while not cursor.epoch_delivered(0):
        dealt.extend(mb for mb in cursor.next_step().micro_batches if mb.epoch == 0)
    starts = np.cumsum([0, *sizes])
    per = np.array([np.bincount(np.searchsorted(starts, mb.positions, side="right") - 1, minlength=3) for mb in dealt])
    assert len(dealt) > 1000
    for a in range(0, len(dealt) - 1000 + 1, 25):
        counts = per[a : a + 1000].sum(axis=0)
        assert np.abs(counts / counts.sum() - weights).max() <= 0.005, (a, counts / counts.sum())


@pytest.mark.parametrize(
    ("mixture", "says"),
    [
        ({"sources": {"a": {"index": "x"}}}, "have no weight"),
        ({"sources": {"a": {"index": "x", "weight": 1}, "b": {"index": "y", "repeat": 2}}}, "not both"),
        ({"sources": {"a/b": {"index": "x", "weight": 1}}}, "no '/'"),
        ({"sources": {"a": {"index": "x", "weight": 1}}, "phases": [{"weights": {"c": 1}}]}, "not sources"),
        (
            {"sources": {"a": {"index": "x", "weight": 1}}, "phases": [{"weights": {"a": 1}}, {"weights": {"a": 1}}]},
            "only the last phase",
        ),
    ],
)
def test_a_mixture_that_cannot_be_dealt_is_refused_saying_what_to_change(mixture: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        MixtureConfig.model_validate(mixture)


def source_sequence(plan: Plan, source: int, count: int) -> list[int]:
    """Source ``source``'s first ``count`` samples in its own order (source epochs one after another), as global
    positions: what any history of weights delivers of it once it has delivered ``count``."""
    assert plan.mixture is not None
    schedule = plan.mixture.schedule
    k = np.arange(count)
    samples = schedule._samples(np.full(count, source), k)  # noqa: SLF001
    return sorted((plan.mixture.offsets[source] + samples).tolist())


@pytest.mark.parametrize("mode", ["budget", "fixed"])
def test_a_weight_change_is_refused_unless_allowed_then_each_source_goes_on_from_its_position(mode: str) -> None:
    sizes = [1500, 700, 400]

    def make(weights: list[float]) -> Plan:
        if mode == "fixed":
            names = [f"s{i}" for i in range(3)]
            mixture = MixtureConfig(sources={n: {"index": n, "weight": w} for n, w in zip(names, weights)})
            stream = mixture_stream(mixture, sizes, 3)
            config = PlanConfig(seed=3, batch_size=8, mixture=mixture, window_size=400)
            return Plan(stream.num_samples, config, index_fingerprint="synthetic", mixture=stream)
        return mixture_plan(sizes, weights, mode, 16384.0)

    before, after = [0.6, 0.3, 0.1], [0.1, 0.2, 0.7]
    cursor, dealt = PlanCursor(make(before), world_size=4), []
    for _ in range(7):
        dealt.extend(cursor.next_step().micro_batches)
    state = json.loads(json.dumps(cursor.state_dict()))
    changed = PlanCursor(make(after), world_size=3)
    with pytest.raises(StateMismatchError, match="allow_mixture_change"):
        changed.load_state_dict(state)
    changed.load_state_dict(state, allow_mixture_change=True)
    pending = json.loads(json.dumps(changed.state_dict()))
    assert (
        pending["mixture"]["until"] is not None and pending["mixture"]["schedule"] == changed.plan.mixture.fingerprint
    )
    tail = []
    while not changed.epoch_delivered(0):
        tail.extend(mb for mb in changed.next_step().micro_batches if mb.epoch == 0)
    delivered = np.concatenate([mb.positions for mb in dealt + tail])
    starts = np.cumsum([0, *sizes])
    owner = np.searchsorted(starts, delivered, side="right") - 1
    plan = make(after)
    for s in range(3):  # the epoch holds the first samples of each source's own sequence, whatever the weights were
        mine = delivered[owner == s]
        assert sorted(mine.tolist()) == source_sequence(plan, s, mine.size)
    at = changed.plan.mixture.change_at if changed.plan.mixture is not None else None
    assert at is not None and 0 < at < plan.num_samples
    late = changed.plan.mixture.sources(0, at, plan.num_samples)
    assert np.abs(np.bincount(late, minlength=3) / late.size - after).max() < 0.01  # the new weights from there
    # a state saved while the change was still ahead resumes into the same sequence, with no flag: the event is in it
    resumed = PlanCursor(make(after), world_size=3)
    resumed.load_state_dict(pending)
    again = []
    while not resumed.epoch_delivered(0):
        again.extend(mb for mb in resumed.next_step().micro_batches if mb.epoch == 0)
    assert [mb.positions.tolist() for mb in again] == [mb.positions.tolist() for mb in tail]


def test_a_state_carrying_a_source_s_sample_twice_resumes() -> None:
    """A small source passed twice within a window can carry the same sample twice into the next: its state
    resumes (a mixture's carried ids are positions of all its sources, repeats allowed), dealing what went on."""
    plan = mixture_plan([84, 126], [1.0, 1.0], "budget", 8000.0)
    plan = plan.with_config(
        plan.config.model_copy(
            update={"window_size": 70, "bucketing": plan.config.bucketing.model_copy(update={"carry": 256})}
        )
    )
    cursor, seen_repeat = PlanCursor(plan, world_size=5, grad_accum=2), False
    for _ in range(12):
        cursor.next_step()
        state = json.loads(json.dumps(cursor.state_dict()))
        seen_repeat |= len(set(state["carried"])) < len(state["carried"])
        resumed = PlanCursor(plan.with_config(plan.config), world_size=5, grad_accum=2)
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
    assert seen_repeat
