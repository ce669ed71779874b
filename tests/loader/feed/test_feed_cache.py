"""The feed through the cache tiers: later epochs from RAM/NVMe, the source gone, stale-free decoded entries,
per-tier metrics, and remote storage that degrades and recovers (a real HTTP server)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from range_http import RangeServer

from omnifeed.cache import CacheConfig, NvmeTierConfig, RamTier, RamTierConfig, RemoteTierConfig
from omnifeed.loader import Feed, FeedConfig, IndexConfig, PlanConfig, SampleIndex, build_index
from omnifeed.loader.decode._config import DecodeConfig, ImageDecodeConfig


@pytest.fixture
def moved_dataset(demo_shards: list[Path], tmp_path: Path) -> tuple[SampleIndex, Path]:
    """An index over a private copy of the demo shards (the test may move the copy away)."""
    source = tmp_path / "source"
    source.mkdir()
    for shard in demo_shards:
        shutil.copy(shard, source / shard.name)
    build_index([str(source / s.name) for s in demo_shards], tmp_path / "index", IndexConfig(workers=1), progress=False)
    return SampleIndex(tmp_path / "index"), source


@pytest.fixture
def ram_name() -> Iterator[str]:
    name = f"feed-{uuid.uuid4().hex[:12]}"
    yield name
    RamTier.remove(name)


def epoch(feed: Feed) -> list[dict]:
    return list(iter(feed))


def fingerprint(batches: list[dict]) -> tuple:
    """What an epoch delivered, whatever its order: the keys, and sums over every decoded tensor."""
    keys = sorted(k for b in batches for k in b["__key__"])
    sums = {
        name: round(sum(b[m][name].double().sum().item() for b in batches if m in b), 2)
        for m, name in (("image", "pixels"), ("text", "tokens"), ("video", "frames"), ("audio", "samples"))
    }
    return keys, sums, sum(len(b["__info__"]["replaced"]) for b in batches)


@pytest.mark.parametrize("entries", ["raw", "decoded"])
def test_a_second_epoch_runs_from_the_caches_with_the_source_gone(
    moved_dataset: tuple[SampleIndex, Path], tmp_path: Path, ram_name: str, entries: str
) -> None:
    index, source = moved_dataset
    cache = CacheConfig(
        ram=RamTierConfig(name=ram_name, capacity_bytes=64 * 2**20),
        nvme=NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=256 * 2**20),
        entries=entries,
    )
    config = FeedConfig(plan=PlanConfig(seed=1, batch_size=4), cache=cache)
    with Feed(index, config) as feed:
        first = epoch(feed)
        after_first = feed.metrics()["cache"]
        assert after_first["remote"]["reads"] > 0 and after_first["nvme"]["entries"] > 0
        source.rename(tmp_path / "gone")
        second = epoch(feed)
        metrics = feed.metrics()["cache"]
    assert fingerprint(second) == fingerprint(first)
    assert all(not b["__info__"]["replaced"] for b in second)
    assert metrics["remote"]["reads"] == after_first["remote"]["reads"]  # nothing more from the origin
    assert metrics["ram"]["hits"] > 0 and metrics["ram"]["bytes_hit"] > 0
    # a new process on the node (new RAM tier handle, same NVMe) is fed too, from NVMe alone
    RamTier.remove(ram_name)
    with Feed(index, config) as fresh:
        third = epoch(fresh)
        assert fresh.metrics()["cache"]["nvme"]["hits"] > 0
    assert fingerprint(third) == fingerprint(first)


@pytest.mark.parametrize("when_room", [True, False])
def test_from_the_second_epoch_fields_come_decoded_from_ram_when_it_has_room(
    moved_dataset: tuple[SampleIndex, Path], ram_name: str, when_room: bool
) -> None:
    index, _ = moved_dataset
    cache = CacheConfig(ram=RamTierConfig(name=ram_name, capacity_bytes=64 * 2**20), decoded_when_room=when_room)
    media = ("text", "image", "video", "audio")

    def counts(feed: Feed) -> dict[str, tuple[int, int]]:
        modalities = feed.metrics()["modalities"]
        return {m: (modalities[m]["decoded"], modalities[m]["from_decoded_cache"]) for m in media if m in modalities}

    with Feed(index, FeedConfig(plan=PlanConfig(seed=1, batch_size=4), cache=cache)) as feed:
        first = epoch(feed)
        after_first = counts(feed)
        second = epoch(feed)
        after_second = counts(feed)
    assert fingerprint(second) == fingerprint(first)
    assert set(after_second) == set(media)
    for modality, (fetched, cached) in after_second.items():
        ran_first = after_first[modality][0] - after_first[modality][1]  # the feed reads ahead into epoch 2
        assert fetched > after_first[modality][0] and ran_first > 0
        if when_room:  # every field was decoded once, in epoch 1; since then, all from the RAM tier
            assert fetched - cached == ran_first, modality
        else:
            assert cached == 0, modality


def test_a_changed_decode_setting_never_serves_stale_decoded_entries(
    moved_dataset: tuple[SampleIndex, Path], tmp_path: Path
) -> None:
    index, _ = moved_dataset
    cache = CacheConfig(nvme=NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=256 * 2**20), entries="decoded")
    plan = PlanConfig(seed=1, batch_size=4)
    sizes = {}
    for size in (64, 32, 64):
        config = FeedConfig(
            plan=plan, cache=cache, decode=DecodeConfig(image=ImageDecodeConfig(resize="fixed", size=size, crop="none"))
        )
        with Feed(index, config) as feed:
            batches = [b for b in epoch(feed) if "image" in b]
            sizes[size] = {tuple(b["image"]["pixels"].shape[-2:]) for b in batches}
            hits = feed.metrics()["cache"]["nvme"]["hits"]
    assert sizes[64] == {(64, 64)} and sizes[32] == {(32, 32)}
    assert hits > 0  # the third run found the 64-pixel entries of the first


def test_remote_errors_are_retried_and_degraded_latency_reads_further_ahead(
    demo_shards: list[Path], tmp_path: Path
) -> None:
    pytest.importorskip("aiohttp")
    root = tmp_path / "served"
    root.mkdir()
    for shard in demo_shards:
        shutil.copy(shard, root / shard.name)
    with RangeServer(root).running() as server:
        build_index(
            [f"{server.url}/{s.name}" for s in demo_shards], tmp_path / "index", IndexConfig(workers=1), progress=False
        )
        index = SampleIndex(tmp_path / "index")
        remote = RemoteTierConfig(
            timeout_s=10, retries=10, backoff_s=0.001, latency_window=16, degraded_latency_s=0.3, io_threads=8
        )
        config = FeedConfig(plan=PlanConfig(seed=1, batch_size=4), cache=CacheConfig(remote=remote), prefetch_steps=2)
        server.fail_fraction = 0.2
        with Feed(index, config) as feed:
            batches = epoch(feed)
            assert all(not b["__info__"]["replaced"] for b in batches)
            assert feed.metrics()["cache"]["remote"]["retries"] > 0
            assert not feed.metrics()["storage_degraded"]
            server.fail_fraction, server.delay_s = 0.0, 0.6
            slow = [feed.next_batch() for _ in range(6)]
            metrics = feed.metrics()
            assert metrics["storage_degraded"] and metrics["read_ahead"] == remote.degraded_read_ahead
            assert all(not b["__info__"]["replaced"] for b in slow)
            server.delay_s = 0.0
            for _ in range(12):
                feed.next_batch()
            assert not feed.metrics()["storage_degraded"] and feed.metrics()["read_ahead"] == 1
    assert sum(len(b["__key__"]) for b in batches) == index.num_samples
