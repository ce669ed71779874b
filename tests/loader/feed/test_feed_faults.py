"""The feed under bad input and slow decoders: replaced and counted, never a crash; modalities isolated."""

from __future__ import annotations

import shutil
import struct
import time
import zlib
from pathlib import Path

import pytest

from omnifeed.loader import Feed, FeedConfig, FeedError, IndexConfig, Plan, PlanConfig, SampleIndex, build_index
from omnifeed.loader.feed._config import PoolConfig


def _png_header(width: int, height: int, size: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", b"")
    )
    return (png + chunk(b"IEND", b"")).ljust(size, b"\0")


def _corrupt(data: bytes, how: str) -> bytes:
    """The same number of bytes, damaged the way a real file gets damaged."""
    n = len(data)
    if how == "truncated":
        return data[: n // 3].ljust(n, b"\0")
    if how == "garbage":
        return bytes((i * 37 + 11) % 251 for i in range(n))
    if how == "broken_moov":
        at = data.find(b"moov")
        return data[:at] + b"\xff" * min(64, n - at) + data[at + 64 :] if at >= 0 else b"\0" * n
    if how == "bomb":
        return _png_header(30000, 30000, n)
    if how == "bad_utf8":
        return (b"\xff\xfe\xfa" * n)[:n]
    raise ValueError(how)


@pytest.fixture()
def damaged(demo_shards: list[Path], tmp_path: Path) -> tuple[SampleIndex, dict[str, str]]:
    """An index over good shards whose bytes are then damaged in place (storage corruption)."""
    shards = [Path(shutil.copy(p, tmp_path / p.name)) for p in demo_shards]
    index = SampleIndex(
        build_index([str(p) for p in shards], tmp_path / "index", IndexConfig(workers=1), progress=False).path
    )
    # (a JPEG cut short and zero-filled still decodes, grey at the bottom, as libjpeg does: the
    # decoder tests cover truly truncated files; here the JPEG gets garbage)
    plan = {"jpg": "garbage", "png": "bomb", "mp4": "broken_moov", "flac": "truncated", "txt": "bad_utf8"}
    damaged_keys: dict[str, str] = {}
    for position in range(index.num_samples):
        sample = index.sample(position)
        for location in sample.fields:
            how = plan.get(location.name)
            if how and location.name not in damaged_keys.values() and sample.key not in damaged_keys:
                with open(sample.shard.url, "r+b") as f:
                    f.seek(location.offset)
                    original = f.read(location.size)
                    f.seek(location.offset)
                    f.write(_corrupt(original, how))
                damaged_keys[sample.key] = location.name
    return index, damaged_keys


def test_every_kind_of_damaged_sample_is_replaced_and_counted(damaged: tuple[SampleIndex, dict[str, str]]) -> None:
    index, damaged_keys = damaged
    assert set(damaged_keys.values()) == {"jpg", "png", "mp4", "flac", "txt"}
    config = FeedConfig(plan=PlanConfig(seed=1, batch_size=4), error_budget=0.5)
    with Feed(index, config) as feed:
        batches = list(feed)
        metrics = feed.metrics()
    replaced = {key for batch in batches for _, key, _ in batch["__info__"]["replaced"]}
    delivered = {key for batch in batches for key in batch["__key__"]}
    assert replaced == set(damaged_keys), "each damaged sample was noticed and replaced"
    assert not replaced & delivered, "no damaged sample reached the trainer"
    assert metrics["bad_samples"] == len(damaged_keys)
    bad = {m: v["bad"] for m, v in metrics["modalities"].items() if v["bad"]}
    assert set(bad) >= {"image", "video", "text"}


def test_a_broken_dataset_stops_with_an_error_naming_its_files(damaged: tuple[SampleIndex, dict[str, str]]) -> None:
    index, _ = damaged
    config = FeedConfig(plan=PlanConfig(seed=1, batch_size=4), error_budget=0.01, error_budget_min_samples=8)
    with Feed(index, config) as feed, pytest.raises(FeedError, match=r"over the error budget.*shard-000\d\.tar"):
        list(feed)


def test_a_slow_video_decoder_does_not_hold_images_back(index_for_faults: SampleIndex) -> None:
    """Counts, not seconds: how many images were decoded by the time the third video decode started."""
    from omnifeed.loader.decode._config import DecodeConfig
    from omnifeed.loader.decode._registry import make_decoder

    video = make_decoder("video", DecodeConfig())

    def images_decoded_while_videos_decode(config: FeedConfig) -> int:
        seen: list[int] = []
        holder: dict[str, Feed] = {}

        def slow_video(data: bytes, key: str):  # noqa: ANN202
            seen.append(holder["feed"].metrics()["modalities"].get("image", {}).get("decoded", 0))
            time.sleep(0.5)
            return video(data, key)

        with Feed(index_for_faults, config, decoders={"video": slow_video}) as feed:
            holder["feed"] = feed
            for _ in feed:
                if len(seen) >= 3:
                    return seen[2]
        raise AssertionError("fewer than three videos in the epoch")

    plan = PlanConfig(seed=0, batch_size=4)
    pools = {
        "image": PoolConfig(workers=1, buffer_samples=64),
        "video": PoolConfig(workers=1, buffer_samples=8),
        "text": PoolConfig(workers=1),
        "audio": PoolConfig(workers=1),
        "meta": PoolConfig(workers=0),
    }
    config = FeedConfig(plan=plan, pools=pools, shared_workers=0, prefetch_steps=16)
    prefetched = Plan.from_index(index_for_faults, plan).stream(0, 0, min(64, index_for_faults.num_samples))
    prefetched_images = sum(
        1
        for position in prefetched.tolist()
        if any(f.modality == "image" for f in index_for_faults.sample(position).fields)
    )
    # Stated bound: a second into the (0.5 s each) videos, at least 3/4 of the images of the 16
    # prefetched micro-batches are decoded: the image pool never waited for the video pool.
    assert images_decoded_while_videos_decode(config) >= 0.75 * prefetched_images


@pytest.fixture(scope="module")
def index_for_faults(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    out = tmp_path_factory.mktemp("faults") / "index"
    build_index([str(p) for p in demo_shards], out, IndexConfig(workers=1), progress=False)
    return SampleIndex(out)


def test_in_a_mixture_a_damaged_sample_is_replaced_by_one_of_its_own_source(
    damaged: tuple[SampleIndex, dict[str, str]], index_dir: Path
) -> None:
    from omnifeed.loader.index import MixtureIndex

    bad, damaged_keys = damaged
    mixture = {
        "sources": {"bad": {"index": str(bad.path), "weight": 1}, "good": {"index": str(index_dir), "weight": 1}}
    }
    config = FeedConfig(plan=PlanConfig(seed=1, batch_size=4, mixture=mixture), error_budget=0.5)
    index = MixtureIndex([("bad", bad, None), ("good", SampleIndex(index_dir), None)])
    with Feed(index, config) as feed:
        batches = list(feed)
    replaced = [(batch["__key__"][i], key) for batch in batches for i, key, _ in batch["__info__"]["replaced"]]
    assert {key for _, key in replaced} == {f"bad/{key}" for key in damaged_keys}
    assert all(by.split("/")[0] == key.split("/")[0] for by, key in replaced), replaced  # the shares stay as planned


def test_a_stand_in_for_a_mixture_sample_comes_from_its_own_source() -> None:
    from omnifeed.loader.feed._healing import fallback_positions, replacement_slot

    assert replacement_slot(0, [False, True, True], [7, 3, 7]) == 2  # the next healthy one of source 7
    assert replacement_slot(0, [False, True, False], [7, 3, 7]) is None  # none of its source: a stand-in
    assert all(100 <= p < 150 for p in fallback_positions(120, 50, start=100))
