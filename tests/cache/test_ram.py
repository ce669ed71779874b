"""The RAM tier: one shared-memory segment per node, byte-bounded, shared by processes, scan-resistant."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.cache import RamTier, RamTierConfig, entry_key
from omnifeed.cache._ram import _H_DIRTY


def key(i: int) -> bytes:
    return entry_key("test", str(i), "f", "raw")


def value(i: int, size: int) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


@pytest.fixture
def ram_config() -> Iterator[RamTierConfig]:
    config = RamTierConfig(name=f"t-{uuid.uuid4().hex[:12]}", capacity_bytes=256 * 1024)
    yield config
    RamTier.remove(config.name)


def test_round_trip_and_absent(ram_config: RamTierConfig) -> None:
    with RamTier(ram_config) as tier:
        assert tier.get(key(1)) is None
        assert tier.put(key(1), b"hello")
        assert tier.get(key(1)) == b"hello"
        assert tier.contains(key(1)) and not tier.contains(key(2))
        stats = tier.stats()
        assert stats["hits"] == 1 and stats["misses"] == 1 and stats["entries"] == 1


def test_a_lookup_that_may_miss_without_counting_it_counts_only_a_hit(ram_config: RamTierConfig) -> None:
    with RamTier(ram_config) as tier:
        assert tier.get(key(1), count_miss=False) is None
        assert tier.stats()["misses"] == 0
        assert tier.put(key(1), b"decoded", accessed=False)
        assert tier.get(key(1), count_miss=False) == b"decoded"
        stats = tier.stats()
        assert stats["hits"] == 1 and stats["misses"] == 0


def test_entries_over_the_size_limit_are_not_cached(ram_config: RamTierConfig) -> None:
    with RamTier(ram_config) as tier:
        assert not tier.put(key(1), bytes(ram_config.capacity_bytes // 4))
        assert tier.stats()["too_large"] == 1 and tier.get(key(1)) is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 60), st.integers(0, 20_000)), min_size=1, max_size=300))
def test_byte_budget_holds_and_entries_are_never_wrong_under_churn(ops: list[tuple[bool, int, int]]) -> None:
    config = RamTierConfig(name=f"h-{uuid.uuid4().hex[:12]}", capacity_bytes=64 * 1024, max_entry_fraction=0.5)
    tier = RamTier(config)
    sizes: dict[int, int] = {}
    try:
        for is_put, i, size in ops:
            size = sizes.setdefault(i, size)  # an entry's content is fixed by its key
            if is_put:
                tier.put(key(i), value(i, size))
            else:
                got = tier.get(key(i))
                assert got is None or got == value(i, size)
            stats = tier.stats()
            assert stats["bytes_used"] <= stats["capacity_bytes"]
        for i, size in sizes.items():
            got = tier.get(key(i))
            assert got is None or got == value(i, size)
    finally:
        tier.unlink()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "get", "discard"]), st.integers(0, 40), st.integers(0, 12_000)),
        min_size=1,
        max_size=300,
    )
)
def test_a_discarded_entry_never_comes_back_and_its_replacement_outlives_it(ops: list[tuple[str, int, int]]) -> None:
    """A reader that finds an entry unusable discards it; the value stored next is what later reads get."""
    config = RamTierConfig(name=f"d-{uuid.uuid4().hex[:12]}", capacity_bytes=64 * 1024, max_entry_fraction=0.5)
    tier = RamTier(config)
    version: dict[int, int] = {}
    try:
        for op, i, size in ops:
            current = value(i * 1000 + version.get(i, 0), size % 5000 + 8)
            if op == "put":
                tier.put(key(i), current)
            elif op == "discard":
                tier.discard(key(i))
                version[i] = version.get(i, 0) + 1  # the next put stores another value
            got = tier.get(key(i))
            assert got is None or got[:4] == current[:4], (op, i)
            assert tier.stats()["bytes_used"] <= config.capacity_bytes
    finally:
        tier.unlink()


def test_the_ring_reclaiming_a_discarded_entry_keeps_the_value_stored_after_it(ram_config: RamTierConfig) -> None:
    """The discarded entry's bytes stay at the ring's head; reclaiming them must not drop the key's newer entry."""
    with RamTier(ram_config) as tier:
        assert tier.put(key(0), value(0, 16_000))
        tier.discard(key(0))
        assert tier.get(key(0)) is None
        assert tier.put(key(0), value(10_000, 16_000))  # the value decoded again
        for i in range(1, 64):  # fill until the ring reclaims its head: the discarded bytes
            tier.put(key(i), value(i, 16_000))
            if tier.stats()["evicted"]:
                break
        assert tier.stats()["evicted"] == 1
        assert tier.get(key(0)) == value(10_000, 16_000)


def test_training_epochs_keep_a_stable_resident_set(ram_config: RamTierConfig) -> None:
    """Every sample once per epoch in a new order: the resident set must not churn (LRU would hit ~3 %)."""
    n, size = 200, 4096
    rng = random.Random(0)
    with RamTier(ram_config) as tier:  # holds about 60 of the 200 entries
        hits = 0
        for epoch in range(4):
            order = list(range(n))
            rng.shuffle(order)
            for i in order:
                got = tier.get(key(i))
                if got is None:
                    tier.put(key(i), value(i, size))
                elif epoch:
                    hits += 1
        resident = tier.stats()["entries"] / n
        assert hits / (3 * n) >= 0.8 * resident


def _reader(name: str, capacity: int, start: int, queue: multiprocessing.Queue) -> None:
    tier = RamTier(RamTierConfig(name=name, capacity_bytes=capacity))
    seen = [tier.get(key(i)) == value(i, 1000) for i in range(start, start + 10)]
    for i in range(100, 110):
        tier.put(key(i), value(i, 1000))
    queue.put(seen)
    tier.close()


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_processes_share_one_segment(ram_config: RamTierConfig, method: str) -> None:
    with RamTier(ram_config) as tier:
        for i in range(10):
            tier.put(key(i), value(i, 1000))
        context = multiprocessing.get_context(method)
        queue = context.Queue()
        child = context.Process(target=_reader, args=(ram_config.name, ram_config.capacity_bytes, 0, queue))
        child.start()
        assert queue.get(timeout=60) == [True] * 10
        child.join(60)
        assert child.exitcode == 0
        assert all(tier.get(key(i)) == value(i, 1000) for i in range(100, 110))


def _hammer(name: str, capacity: int, seed: int) -> None:
    tier = RamTier(RamTierConfig(name=name, capacity_bytes=capacity))
    rng = random.Random(seed)
    for _ in range(2000):
        i = rng.randrange(300)
        got = tier.get(key(i))
        if got is None:
            tier.put(key(i), value(i, 100 + i * 13))
        elif got != value(i, 100 + i * 13):
            os._exit(3)
    tier.close()
    os._exit(0)


def test_concurrent_processes_never_see_a_wrong_entry(ram_config: RamTierConfig) -> None:
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_hammer, args=(ram_config.name, ram_config.capacity_bytes, s)) for s in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    with RamTier(ram_config) as tier:
        assert tier.stats()["bytes_used"] <= ram_config.capacity_bytes


def _die_mid_write(name: str, capacity: int) -> None:
    tier = RamTier(RamTierConfig(name=name, capacity_bytes=capacity))
    with tier._locked():
        tier._header[_H_DIRTY] = 1  # as put() sets it while it changes the ring
        tier._slots["offset"] = 12345  # half-updated table
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_process_killed_mid_write_leaves_no_wrong_entry(ram_config: RamTierConfig) -> None:
    with RamTier(ram_config) as tier:
        for i in range(10):
            tier.put(key(i), value(i, 1000))
        child = multiprocessing.get_context("fork").Process(
            target=_die_mid_write, args=(ram_config.name, ram_config.capacity_bytes)
        )
        child.start()
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
        assert all(tier.get(key(i)) is None for i in range(10))  # emptied, not served half-written
        assert tier.stats()["resets"] >= 1
        assert tier.put(key(1), value(1, 1000)) and tier.get(key(1)) == value(1, 1000)


def test_a_segment_survives_its_creator_and_can_be_removed(ram_config: RamTierConfig) -> None:
    tier = RamTier(ram_config)
    tier.put(key(7), b"kept")
    tier.close()
    with RamTier(ram_config) as again:
        assert again.get(key(7)) == b"kept"
    RamTier.remove(ram_config.name)
    with RamTier(ram_config) as fresh:
        assert fresh.get(key(7)) is None


def test_a_tier_bigger_than_the_nodes_shared_memory_is_refused_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    from omnifeed.cache import CacheChain, CacheConfig, CacheError
    from omnifeed.cache._ram import _segment_path

    name = f"big-{uuid.uuid4().hex[:12]}"
    too_big = shutil.disk_usage(_segment_path("x").parent).total * 2
    with pytest.raises(CacheError, match="capacity_bytes"):
        RamTier(RamTierConfig(name=name, capacity_bytes=too_big))
    assert not _segment_path(f"omnifeed-ram-{name}").exists()
    with (
        caplog.at_level("WARNING"),
        CacheChain(CacheConfig(ram=RamTierConfig(name=name, capacity_bytes=too_big))) as chain,
    ):
        assert "ram" not in chain.tiers and chain.get(key(1), lambda: b"origin") == b"origin"
    assert "running without the RAM tier" in caplog.text
    RamTier.remove(name)
