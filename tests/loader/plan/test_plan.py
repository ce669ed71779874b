"""The plan's invariants: exactly-once under resumes and resizes, determinism, O(1) state and resume."""

from __future__ import annotations

import copy
import functools
import json
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.bucketing import INDEX_COLUMNS, BucketingConfig
from omnifeed.loader import Plan, PlanConfig, PlanCursor, StateMismatchError
from omnifeed.loader.plan._permutation import KeyedPermutation
from omnifeed.loader.plan._plan import LengthSource

FP = "index-fingerprint"


@functools.lru_cache(maxsize=1)  # the same large index is planned several times by a test: generated once
def _shards(num_samples: int, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """Shard sizes and a by-shard order for a synthetic index of ``num_samples`` rows (read-only arrays)."""
    rng = np.random.default_rng(num_samples * 31 + num_shards)
    shard_of = np.sort(rng.integers(0, num_shards, num_samples))
    rng.shuffle(shard_of)  # positions are hash-ordered, not shard-ordered
    sizes, by_shard = np.bincount(shard_of, minlength=num_shards), np.argsort(shard_of, kind="stable")
    sizes.flags.writeable = by_shard.flags.writeable = False  # shared between plans: none may change them
    return sizes, by_shard


@functools.lru_cache(maxsize=1)
def _length_columns(num_samples: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(num_samples)
    kind = rng.integers(0, 4, num_samples)
    columns = {name: np.zeros(num_samples, dtype=np.float64) for name in INDEX_COLUMNS}
    columns["text_tokens"] = np.clip(rng.lognormal(3.5, 1.0, num_samples), 1, 3000).astype(np.int64)
    columns["image_width"] = np.where(kind == 1, rng.integers(32, 1200, num_samples), 0)
    columns["image_height"] = np.where(kind == 1, rng.integers(32, 1200, num_samples), 0)
    columns["audio_seconds"] = np.where(kind == 2, rng.uniform(0.5, 20, num_samples), 0)
    for values in columns.values():
        values.flags.writeable = False
    return columns


def synthetic_lengths(num_samples: int) -> LengthSource:
    """Index-like length columns with long-tailed text and a mix of images, video and audio."""
    columns = _length_columns(num_samples)
    return lambda positions: {name: values[positions] for name, values in columns.items()}


@pytest.fixture(scope="module", autouse=True)
def _free_synthetic_indexes() -> Iterator[None]:
    """The cached columns of a 10-million-row index are large: let them go with this module."""
    yield
    _shards.cache_clear()
    _length_columns.cache_clear()


def _config(batching: str, **config: object) -> PlanConfig:
    if batching.startswith("budget"):  # dealt in cost tiers (the default), or shuffled across the window
        # light leftovers carried to the next window (the default: up to 256 samples; "budget_carry_few": 3)
        config["bucketing"] = BucketingConfig(
            budget=4096,
            num_buckets=4,
            lookahead=16,
            overlong="alone",
            tier_width=None if batching == "budget_shuffled" else 0.02,
            carry=3 if batching == "budget_carry_few" else 256,
        )
    elif batching == "packing":
        config["bucketing"] = BucketingConfig(mode="packing", budget=512, overlong="split", lookahead=16)
    return PlanConfig(**config)


def _plan(num_samples: int, num_shards: int = 7, batching: str = "fixed", **config: object) -> Plan:
    cfg = _config(batching, **config)
    sizes, by_shard = _shards(num_samples, num_shards) if cfg.shuffle == "shard_block" else (None, None)
    lengths = synthetic_lengths(num_samples) if cfg.bucketing else None
    return Plan(num_samples, cfg, index_fingerprint=FP, shard_sizes=sizes, by_shard=by_shard, lengths=lengths)


Delivered = list[tuple[int, int, int, tuple[int, ...], tuple[tuple[int, int], ...]]]


def _deal(plan: Plan, cursor: PlanCursor, steps: int, out: Delivered) -> None:
    """Deal ``steps`` steps, recording (step, rank, epoch, positions, segments) per micro-batch."""
    for _ in range(steps):
        step = cursor.next_step()
        for rank in range(step.world_size):
            for mb in step.for_rank(rank):
                assert mb.positions.size > 0, "no rank ever gets an empty micro-batch"
                segments = tuple((s.start, s.stop) for s in mb.pack.segments) if mb.pack else ()
                out.append((step.step, rank, mb.epoch, tuple(mb.positions.tolist()), segments))
        assert len(cursor.carried) <= plan.carry_limit


def _epoch_positions(plan: Plan, epoch: int) -> list[int]:
    cursor = PlanCursor(plan, epoch=epoch)
    out: Delivered = []
    while not cursor.epoch_delivered(epoch):
        _deal(plan, cursor, 1, out)
    return [
        p
        for _, _, e, positions, segments in out
        if e == epoch
        for i, p in enumerate(positions)
        if not segments or segments[i][0] == 0
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 1000, 4097])
def test_keyed_permutation_is_a_bijection(n: int) -> None:
    images = KeyedPermutation(n, [7, 1])(np.arange(n))
    assert sorted(images.tolist()) == list(range(n))


def test_keyed_permutation_depends_on_key_only() -> None:
    a, b = KeyedPermutation(1000, [1, 2]), KeyedPermutation(1000, [1, 2])
    assert np.array_equal(a(np.arange(1000)), b(np.arange(1000)))
    assert not np.array_equal(a(np.arange(1000)), KeyedPermutation(1000, [1, 3])(np.arange(1000)))


@pytest.mark.parametrize("batching", ["fixed", "budget", "packing"])
@pytest.mark.parametrize("shuffle", ["permutation", "shard_block", "none"])
@pytest.mark.parametrize("num_samples,batch_size,window_size", [(1, 1, 1), (10, 3, 4), (97, 8, 30), (256, 16, 64)])
def test_each_epoch_covers_every_sample_once(
    batching: str, shuffle: str, num_samples: int, batch_size: int, window_size: int
) -> None:
    plan = _plan(
        num_samples, batching=batching, shuffle=shuffle, batch_size=batch_size, window_size=window_size, seed=3
    )
    for epoch in range(2):
        assert sorted(_epoch_positions(plan, epoch)) == list(range(num_samples))


def test_the_sequence_is_a_pure_function_of_seed_and_epoch() -> None:
    first, again = _plan(500, seed=1), _plan(500, seed=1)
    other_seed = _plan(500, seed=2)
    assert _epoch_positions(first, 0) == _epoch_positions(again, 0)
    assert _epoch_positions(first, 0) != _epoch_positions(other_seed, 0)
    assert _epoch_positions(first, 0) != _epoch_positions(first, 1), "each epoch reshuffles"


def test_shard_block_windows_read_few_shards_at_a_time() -> None:
    sizes, by_shard = _shards(700, 7)
    plan = Plan(
        700,
        PlanConfig(shuffle="shard_block", shards_per_window=2, batch_size=10),
        index_fingerprint=FP,
        shard_sizes=sizes,
        by_shard=by_shard,
    )
    shard_of = np.empty(700, dtype=int)
    for shard, start in enumerate(np.concatenate([[0], np.cumsum(sizes)])[:-1]):
        shard_of[by_shard[start : start + sizes[shard]]] = shard
    first_window = plan.stream(0, 0, int(sizes.max()))
    assert len(set(shard_of[first_window].tolist())) <= 4


ops = st.lists(
    st.tuples(st.integers(1, 8), st.integers(1, 3), st.integers(1, 4), st.booleans()), min_size=1, max_size=6
)


@settings(max_examples=150, deadline=None)
@given(
    num_samples=st.integers(1, 300),
    batch_size=st.integers(1, 16),
    shuffle=st.sampled_from(["permutation", "shard_block", "none"]),
    batching=st.sampled_from(["fixed", "budget", "budget_shuffled", "budget_carry_few", "packing"]),
    window_size=st.integers(1, 80),
    start_epoch=st.integers(0, 2),
    schedule=ops,
)
def test_any_resumes_and_resizes_deliver_each_sample_exactly_once(
    num_samples: int,
    batch_size: int,
    shuffle: str,
    batching: str,
    window_size: int,
    start_epoch: int,
    schedule: list[tuple[int, int, int, bool]],
) -> None:
    config = dict(shuffle=shuffle, batch_size=batch_size, seed=11, batching=batching, window_size=window_size)
    plan = _plan(num_samples, **config)
    cursor = PlanCursor(plan, world_size=schedule[0][0], grad_accum=schedule[0][1], epoch=start_epoch)
    delivered: list[tuple[int, int, int, tuple[int, ...]]] = []
    for world_size, grad_accum, steps, restart in schedule:
        if restart:  # a new process: fresh plan object, state through JSON, possibly another world size
            state = json.loads(json.dumps(cursor.state_dict()))
            plan = _plan(num_samples, **config)
            cursor = PlanCursor(plan, world_size=world_size, grad_accum=grad_accum)
            cursor.load_state_dict(state)
        else:
            cursor.resize(world_size, grad_accum)
        _deal(plan, cursor, steps, delivered)
    while not cursor.epoch_delivered(start_epoch):
        _deal(plan, cursor, 1, delivered)
    counts = Counter(
        p
        for _, _, epoch, positions, segments in delivered
        if epoch == start_epoch
        for i, p in enumerate(positions)
        if not segments or segments[i][0] == 0
    )
    assert sorted(counts) == list(range(num_samples))
    assert set(counts.values()) == {1}
    assert all(epoch >= start_epoch for _, _, epoch, _, _ in delivered)


@settings(max_examples=100, deadline=None)
@given(
    num_samples=st.integers(1, 400),
    batch_size=st.integers(1, 12),
    world_size=st.integers(1, 6),
    grad_accum=st.integers(1, 3),
    stop_after=st.integers(0, 20),
    total=st.integers(1, 30),
    batching=st.sampled_from(["fixed", "budget", "budget_shuffled", "budget_carry_few", "packing"]),
    window_size=st.integers(1, 80),
)
def test_a_resumed_run_emits_exactly_what_an_uninterrupted_run_would(
    num_samples: int,
    batch_size: int,
    world_size: int,
    grad_accum: int,
    stop_after: int,
    total: int,
    batching: str,
    window_size: int,
) -> None:
    config = dict(batch_size=batch_size, seed=5, batching=batching, window_size=window_size)
    uninterrupted: list = []
    plan = _plan(num_samples, **config)
    _deal(plan, PlanCursor(plan, world_size=world_size, grad_accum=grad_accum), total, uninterrupted)

    resumed: list = []
    first = PlanCursor(plan, world_size=world_size, grad_accum=grad_accum)
    _deal(plan, first, min(stop_after, total), resumed)
    fresh_plan = _plan(num_samples, **config)
    second = PlanCursor(fresh_plan, world_size=world_size, grad_accum=grad_accum)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    _deal(fresh_plan, second, total - min(stop_after, total), resumed)
    assert resumed == uninterrupted


def test_the_last_step_of_an_epoch_continues_into_the_next() -> None:
    plan = _plan(10, batch_size=3)  # 4 micro-batches: 3, 3, 3, 1
    cursor = PlanCursor(plan, world_size=3)
    delivered: Delivered = []
    _deal(plan, cursor, 2, delivered)
    by_step = sorted(delivered, key=lambda d: (d[0], d[1]))
    assert [epoch for _, _, epoch, _, _ in by_step] == [0, 0, 0, 0, 1, 1]
    assert [len(p) for _, _, _, p, _ in by_step[:4]] == [3, 3, 3, 1]


def test_drop_last_drops_only_the_short_tail_and_says_how_many() -> None:
    plan = _plan(10, batch_size=3, drop_last=True)
    assert plan.dropped_per_epoch == 1
    seen = _epoch_positions(plan, 0)
    assert len(seen) == len(set(seen)) == 9
    with pytest.raises(ValueError, match="drops the whole epoch"):
        _plan(2, batch_size=3, drop_last=True)


def test_state_is_the_same_small_size_for_ten_and_ten_million_samples() -> None:
    sizes = []
    for n in (10, 10_000_000):
        plan = _plan(n, batch_size=4)
        cursor = PlanCursor(plan, world_size=8, grad_accum=4)
        for _ in range(3):
            cursor.next_step()
        encoded = json.dumps(cursor.state_dict())
        assert len(encoded.encode()) < 1024
        sizes.append(set(cursor.state_dict()))
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("batching", ["fixed", "budget"])
@pytest.mark.parametrize("shuffle", ["permutation", "shard_block"])
def test_resuming_far_into_a_run_does_one_windows_work(shuffle: str, batching: str) -> None:
    """Work is counted in positions computed, not timed; it must not grow with the position."""
    num_samples, num_shards, world_size, grad_accum = 10_000_000, 1000, 8, 2
    config = dict(shuffle=shuffle, batching=batching, batch_size=32, seed=9, shards_per_window=1, window_size=4096)
    near = _plan(num_samples, num_shards, **config)
    start = PlanCursor(near, world_size=world_size, grad_accum=grad_accum).state_dict()
    windows = near.windows_per_epoch(5)
    # far: the last window of epoch 5, so the step runs on into epoch 6
    far = start | {
        "epoch": 5,
        "window": windows - 1,
        "window_start": near._nominal_end(5, windows - 2),
        "micro_batch": 10**5,
        "step": 10**6,
    }
    largest_window = int(np.diff(near._shard_starts).max()) if shuffle == "shard_block" else 4096
    for state in (start, far):
        plan = _plan(num_samples, num_shards, **config)
        resumed = PlanCursor(plan, world_size=world_size, grad_accum=grad_accum)
        resumed.load_state_dict(state)
        resumed.next_step()
        shard_tables = 2 * num_shards if shuffle == "shard_block" else 0  # one pass per epoch touched
        lookahead = 256 if batching == "budget" else 32
        assert plan.work <= shard_tables + 3 * (largest_window + lookahead)


def test_a_state_from_another_index_or_config_is_refused_naming_both_fingerprints() -> None:
    plan = _plan(100, batch_size=4)
    state = PlanCursor(plan).state_dict()
    other_index = Plan(100, PlanConfig(batch_size=4), index_fingerprint="another-index")
    with pytest.raises(StateMismatchError) as err:
        PlanCursor(other_index).load_state_dict(state)
    assert FP in str(err.value) and "another-index" in str(err.value)
    with pytest.raises(StateMismatchError, match="batching config"):
        PlanCursor(_plan(100, batch_size=5)).load_state_dict(state)


def test_loading_is_strict_and_leaves_the_callers_state_alone() -> None:
    plan = _plan(100)
    state = PlanCursor(plan, world_size=2).state_dict()
    before = copy.deepcopy(state)
    cursor = PlanCursor(plan, world_size=4)
    cursor.load_state_dict(state)
    assert state == before
    assert cursor.topology_version == 1, "another world size is a resize"
    with pytest.raises(ValueError, match="unknown keys"):
        cursor.load_state_dict(state | {"extra": 1})
    with pytest.raises(ValueError, match="missing keys"):
        cursor.load_state_dict({k: v for k, v in state.items() if k != "step"})


def test_resize_bumps_the_topology_version_only_on_change() -> None:
    cursor = PlanCursor(_plan(50), world_size=4)
    assert not cursor.resize(4)
    assert cursor.resize(3) and cursor.topology_version == 1
    assert cursor.next_step().topology_version == 1
    with pytest.raises(ValueError):
        cursor.resize(0)
