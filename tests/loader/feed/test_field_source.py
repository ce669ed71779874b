"""A field's bytes through a real cache chain (RAM segment + NVMe tier): raw or decoded entries, keyed so
that a changed decode setting or another index never meets an old entry, and a bad entry read again."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from omnifeed.cache import CacheConfig, NvmeTierConfig, RamTier, RamTierConfig
from omnifeed.loader import SampleIndex
from omnifeed.loader.decode._config import DecodeConfig, ImageDecodeConfig
from omnifeed.loader.feed import FieldSource
from omnifeed.loader.index import FieldLocation, IndexedSample, read_field

Field = tuple[str, IndexedSample, FieldLocation]
DECODED = (np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5),)  # what an image decoder returns, as a 1-tuple


@pytest.fixture
def ram_name() -> Iterator[str]:
    name = f"field-source-{uuid.uuid4().hex[:12]}"
    yield name
    RamTier.remove(name)


def tiers(tmp_path: Path, ram_name: str, entries: str = "raw") -> CacheConfig:
    return CacheConfig(
        ram=RamTierConfig(name=ram_name, capacity_bytes=8 * 2**20),
        nvme=NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=64 * 2**20),
        entries=entries,
    )


@pytest.fixture(scope="module")
def image(index_dir: Path) -> Field:
    """The index fingerprint, and the first sample with an image, with that image's location."""
    index = SampleIndex(index_dir)
    sample = next(
        s for s in map(index.sample, range(index.num_samples)) if any(f.modality == "image" for f in s.fields)
    )
    return index.fingerprint, sample, next(f for f in sample.fields if f.modality == "image")


def stored(sample: IndexedSample, location: FieldLocation) -> bytes:
    return read_field(sample.shard, location, row_group=sample.row_group, row=sample.row)


def reads(source: FieldSource) -> int:
    """Reads from the origin so far."""
    return int(source.stats()["remote"]["reads"])


def test_raw_entries_come_from_the_origin_once_then_from_ram_then_from_nvme(
    image: Field, tmp_path: Path, ram_name: str
) -> None:
    fingerprint, sample, location = image
    cache = tiers(tmp_path, ram_name)
    with closing(FieldSource(cache, fingerprint, DecodeConfig())) as source:
        assert source.load(sample, location) == ("raw", stored(sample, location))
        assert source.load(sample, location) == ("raw", stored(sample, location))
        assert reads(source) == 1 and source.stats()["ram"]["hits"] == 1
    RamTier.remove(ram_name)  # a new job on the node, the RAM segment gone: the disk tier still has the field
    with closing(FieldSource(cache, fingerprint, DecodeConfig())) as again:
        assert again.load(sample, location) == ("raw", stored(sample, location))
        assert reads(again) == 0 and again.stats()["nvme"]["hits"] == 1
        assert again.stats()["ram"]["entries"] == 1, "an NVMe hit fills the RAM tier"


def test_decoded_entries_hold_the_decoders_output_and_skip_the_origin(
    image: Field, tmp_path: Path, ram_name: str
) -> None:
    fingerprint, sample, location = image
    with closing(FieldSource(tiers(tmp_path, ram_name, "decoded"), fingerprint, DecodeConfig())) as source:
        assert source.load(sample, location) == ("raw", stored(sample, location))  # nothing decoded yet
        source.remember(sample, location, DECODED)
        kind, value = source.load(sample, location)
        assert kind == "decoded" and np.array_equal(value[0], DECODED[0]) and value[0].dtype == np.uint8
        assert reads(source) == 1
        assert source.raw_key(sample, location) != source.decoded_key(sample, location)


def test_raw_entries_keep_decoded_values_in_ram_while_it_has_room_and_never_on_disk(
    image: Field, tmp_path: Path, ram_name: str
) -> None:
    fingerprint, sample, location = image
    cache = tiers(tmp_path, ram_name)  # entries: raw, decoded_when_room by default
    with closing(FieldSource(cache, fingerprint, DecodeConfig())) as source:
        assert source.load(sample, location) == ("raw", stored(sample, location))
        source.remember(sample, location, DECODED)
        kind, value = source.load(sample, location)
        assert kind == "decoded" and np.array_equal(value[0], DECODED[0])
        assert source.stats()["nvme"]["entries"] == 1, "the raw entry only"
    RamTier.remove(ram_name)
    with RamTier(cache.ram) as ram:  # another job fills the node's RAM tier to within an eighth of its capacity
        for i in range(16):
            assert ram.put(b"filler-%02d-------" % i, bytes(470_000))
        assert ram.stats()["bytes_used"] > 7 / 8 * ram.capacity
        with closing(FieldSource(cache, fingerprint, DecodeConfig())) as full:
            full.remember(sample, location, DECODED)
            assert full.load(sample, location) == ("raw", stored(sample, location)), "no room: not kept"
            entries = ram.stats()["entries"]
    assert entries == 17, "the fillers and the raw entry: nothing evicted for a decoded one"
    off = cache.model_copy(update={"decoded_when_room": False})
    with closing(FieldSource(off, fingerprint, DecodeConfig())) as source:
        assert source.decoded_key(sample, location) is None


def test_a_changed_decode_setting_never_meets_the_old_decoded_entry(
    image: Field, tmp_path: Path, ram_name: str
) -> None:
    fingerprint, sample, location = image
    cache = tiers(tmp_path, ram_name, "decoded")
    small, large = (DecodeConfig(image=ImageDecodeConfig(resize="fixed", size=n, crop="none")) for n in (32, 64))
    with closing(FieldSource(cache, fingerprint, small)) as first:
        first.remember(sample, location, DECODED)
    with closing(FieldSource(cache, fingerprint, large)) as other:
        assert other.load(sample, location)[0] == "raw"
    with closing(FieldSource(cache, fingerprint, small)) as same_settings_again:
        assert same_settings_again.load(sample, location)[0] == "decoded"


def test_keys_follow_the_index_the_field_and_the_transform_version_of_its_modality_only(image: Field) -> None:
    fingerprint, sample, location = image
    audio = dataclasses.replace(location, name="flac", modality="audio")
    decoded = CacheConfig(entries="decoded")
    base = FieldSource(decoded, fingerprint, DecodeConfig())
    resized = FieldSource(decoded, fingerprint, DecodeConfig(image=ImageDecodeConfig(size=128)))
    reindexed = FieldSource(decoded, "another-index", DecodeConfig())
    assert base.decoded_key(sample, location) != resized.decoded_key(sample, location)
    assert base.decoded_key(sample, audio) == resized.decoded_key(sample, audio), "an image setting leaves audio alone"
    assert base.raw_key(sample, location) == resized.raw_key(sample, location), "decode settings leave raw bytes alone"
    assert base.raw_key(sample, location) != base.raw_key(sample, audio)
    assert {reindexed.raw_key(sample, location), reindexed.decoded_key(sample, location)}.isdisjoint(
        {base.raw_key(sample, location), base.decoded_key(sample, location)}
    )
    assert FieldSource(CacheConfig(), fingerprint, DecodeConfig()).decoded_key(sample, location) is None, "raw mode"
    custom = FieldSource(decoded, fingerprint, DecodeConfig(), custom=frozenset({"image"}))
    assert custom.decoded_key(sample, location) is None, "a user's decoder has no version to key its output by"
    for source in (base, resized, reindexed, custom):
        source.close()


def test_an_unreadable_decoded_entry_is_read_again_from_the_origin(
    image: Field, tmp_path: Path, ram_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    fingerprint, sample, location = image
    with closing(FieldSource(tiers(tmp_path, ram_name, "decoded"), fingerprint, DecodeConfig())) as source:
        key = source.decoded_key(sample, location)
        assert key is not None
        source.chain.store(key, b"OFD1T\x03|u1\x01" + b"\xff" * 8)  # an array header whose data is cut short
        with caplog.at_level(logging.WARNING, logger="omnifeed.loader.feed._field_source"):
            assert source.load(sample, location) == ("raw", stored(sample, location))
        assert reads(source) == 1
        assert f"cached decoded entry of {sample.key!r} field {location.name!r} is unreadable" in caplog.text


def test_an_unreadable_decoded_entry_is_replaced_by_the_value_decoded_again(
    image: Field, tmp_path: Path, ram_name: str
) -> None:
    fingerprint, sample, location = image
    with closing(FieldSource(tiers(tmp_path, ram_name, "decoded"), fingerprint, DecodeConfig())) as source:
        key = source.decoded_key(sample, location)
        assert key is not None
        source.chain.store(key, b"OFD1 not an entry")
        assert source.load(sample, location)[0] == "raw"
        source.remember(sample, location, DECODED)
        assert source.load(sample, location)[0] == "decoded"
