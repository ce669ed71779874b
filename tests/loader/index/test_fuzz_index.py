"""Fuzzing index loading: a damaged, truncated or missing index file opens and reads, or raises IndexFormatError.

Never another exception, and never a crash: a damaged memory-mapped Arrow file used to end the process
with SIGBUS or SIGSEGV when a row was read (offsets pointing outside the mapping).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnifeed.loader import IndexConfig, IndexFormatError, SampleIndex, build_index
from omnifeed.loader.index._sample_index import ROW_SCHEMA

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
FLIPS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=8)
KEEP = st.one_of(st.just(1.0), st.floats(0.0, 1.0))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def index_dir(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuzz-index") / "index"
    build_index([str(p) for p in demo_shards], out, IndexConfig(workers=1, partitions=2), progress=False)
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-index-work")


def _fresh_copy(index_dir: Path, work: Path) -> Path:
    copy = work / "index"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(index_dir, copy)
    return copy


def _opens_and_reads_or_index_format_error(path: Path) -> None:
    """Open the index and read every row every way there is; or IndexFormatError."""
    try:
        index = SampleIndex(path)
        positions = np.arange(len(index))
        keys = index.keys(positions)
        assert len(keys) == len(index) == len(index.samples(positions))
        index.length_columns(positions)
        for position in positions[::7]:
            index.sample(int(position))
        index.column("text_tokens")
        index.positions_of(keys[:3] + ["no-such-key"])
        assert index.by_shard.shape == (len(index),)
    except IndexFormatError as exc:
        assert str(path) in str(exc)


def _damage(path: Path, flips: list[tuple[float, int]], keep: float, start: int = 0) -> None:
    data = bytearray(path.read_bytes())
    for where, value in flips:
        data[start + int(where * (len(data) - start))] = value
    path.write_bytes(bytes(data[: int(len(data) * keep)]))


@pytest.mark.timeout(120)
@FUZZ
@given(
    file=st.sampled_from(["manifest.json", "part-00000.arrow", "part-00001.arrow", "shards.parquet"]),
    flips=FLIPS,
    keep=KEEP,
)
def test_a_damaged_index_file_opens_or_raises_index_format_error(
    index_dir: Path, work: Path, file: str, flips: list[tuple[float, int]], keep: float
) -> None:
    copy = _fresh_copy(index_dir, work)
    _damage(copy / file, flips, keep)
    _opens_and_reads_or_index_format_error(copy)


@pytest.mark.timeout(120)
@FUZZ
@given(flips=FLIPS, keep=KEEP)
def test_a_damaged_parquet_partition_without_its_arrow_copy_opens_or_raises_index_format_error(
    index_dir: Path, work: Path, flips: list[tuple[float, int]], keep: float
) -> None:
    copy = _fresh_copy(index_dir, work)
    (copy / "part-00000.arrow").unlink()  # re-created from the damaged Parquet file
    _damage(copy / "part-00000.parquet", flips, keep)
    _opens_and_reads_or_index_format_error(copy)
    assert not (copy / "part-00000.arrow.tmp").exists()


@pytest.mark.timeout(120)
@FUZZ
@given(flips=FLIPS, keep=KEEP)
def test_a_damaged_by_shard_header_or_a_truncated_by_shard_raises_index_format_error(
    index_dir: Path, work: Path, flips: list[tuple[float, int]], keep: float
) -> None:
    copy = _fresh_copy(index_dir, work)
    header = 128  # .npy header; the values after it are positions, not checked at open (docs/security.md)
    data = bytearray((copy / "by_shard.npy").read_bytes())
    for where, value in flips:
        data[int(where * header)] = value
    (copy / "by_shard.npy").write_bytes(bytes(data[: header + int((len(data) - header) * keep)]))
    _opens_and_reads_or_index_format_error(copy)


def _mutated(value: Any, data: st.DataObject) -> Any:
    """``value`` with one nested entry replaced by random JSON (or removed, for a map entry)."""
    if isinstance(value, dict) and value and data.draw(st.booleans()):
        name = data.draw(st.sampled_from(sorted(value)))
        if data.draw(st.integers(0, 4)) == 0:
            return {k: v for k, v in value.items() if k != name}
        return {**value, name: _mutated(value[name], data)}
    if isinstance(value, list) and value and data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(value) - 1))
        return [*value[:at], _mutated(value[at], data), *value[at + 1 :]]
    return data.draw(JSON)


@pytest.mark.timeout(120)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(data=st.data())
def test_a_manifest_with_wrong_types_or_missing_entries_opens_or_raises_index_format_error(
    index_dir: Path, work: Path, data: st.DataObject
) -> None:
    copy = _fresh_copy(index_dir, work)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps(_mutated(manifest, data)))
    _opens_and_reads_or_index_format_error(copy)


@pytest.mark.parametrize("missing", ["manifest.json", "shards.parquet", "by_shard.npy", "part-00001.parquet"])
def test_a_missing_index_file_is_an_index_format_error_naming_it(index_dir: Path, work: Path, missing: str) -> None:
    copy = _fresh_copy(index_dir, work)
    (copy / "part-00001.arrow").unlink()
    (copy / missing).unlink()
    with pytest.raises(IndexFormatError, match="no manifest" if missing == "manifest.json" else re.escape(missing)):
        SampleIndex(copy)


def test_an_arrow_copy_whose_offsets_leave_the_mapping_is_an_error_when_read_not_a_crash(
    index_dir: Path, work: Path
) -> None:
    copy = _fresh_copy(index_dir, work)
    table = pa.ipc.open_file(pa.BufferReader((copy / "part-00000.arrow").read_bytes())).read_all().combine_chunks()
    keys = table["key"].chunk(0)
    offsets = np.frombuffer(keys.buffers()[1], dtype=np.int32)[: len(keys) + 1].copy()
    offsets[1] = 2**30  # the first and last offsets stay plausible: only a full validation sees this one
    damaged = pa.Array.from_buffers(pa.string(), len(keys), [None, pa.py_buffer(offsets.tobytes()), keys.buffers()[2]])
    with pa.OSFile(str(copy / "part-00000.arrow"), "wb") as sink, pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
        writer.write_table(table.set_column(0, "key", damaged))
    index = SampleIndex(copy)  # opening stays cheap: rows are checked when first read
    with pytest.raises(IndexFormatError, match=r"column 'key' of rows 0\.\..*damaged.*rebuild the index"):
        index.keys(np.arange(len(index)))
    with pytest.raises(IndexFormatError, match="damaged"):
        index.sample(0)


def test_an_arrow_copy_with_a_null_key_is_an_error_naming_the_index_when_read(index_dir: Path, work: Path) -> None:
    copy = _fresh_copy(index_dir, work)
    _null_key(copy)
    index = SampleIndex(copy)  # opening reads no row (a billion-row index opens in the time of its footers)
    with pytest.raises(IndexFormatError, match=re.escape(str(copy)) + r".*column 'key' of rows 0\.\..*null values"):
        index.keys(np.arange(len(index)))


def test_a_row_naming_a_shard_the_index_does_not_list_is_an_error_naming_its_position(
    index_dir: Path, work: Path
) -> None:
    copy = _fresh_copy(index_dir, work)
    table = pa.ipc.open_file(pa.BufferReader((copy / "part-00000.arrow").read_bytes())).read_all()
    shards = pa.array([99] + table["shard"].to_pylist()[1:], pa.int32())
    with pa.OSFile(str(copy / "part-00000.arrow"), "wb") as sink, pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
        writer.write_table(table.set_column(table.schema.get_field_index("shard"), "shard", shards))
    index = SampleIndex(copy)
    expected = re.escape(str(copy)) + r": the row at position 0 names shard 99, but shards.parquet lists \d+"
    with pytest.raises(IndexFormatError, match=expected + ".*rebuild the index"):
        index.sample(0)
    with pytest.raises(IndexFormatError, match=expected):
        index.samples([1, 0])
    assert index.sample(1).key == index.samples([1])[0].key  # the other rows still read


def _replace_manifest(path: Path, value: Any) -> None:
    (path / "manifest.json").write_text(json.dumps(value))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _null_key(path: Path) -> None:
    table = pa.ipc.open_file(pa.BufferReader((path / "part-00000.arrow").read_bytes())).read_all()
    keys = pa.array([None] + table["key"].to_pylist()[1:], pa.string())
    with pa.OSFile(str(path / "part-00000.arrow"), "wb") as sink, pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
        writer.write_table(table.set_column(0, "key", keys))


# each of these raised something else before (AttributeError, TypeError, ArrowInvalid, OSError, TokenError, ...)
KNOWN_DAMAGE = {
    "manifest-is-a-list": lambda p: _replace_manifest(p, [1, 2]),
    "num-samples-null": lambda p: _replace_manifest(
        p, {**json.loads((p / "manifest.json").read_text()), "num_samples": None}
    ),
    "partitions-missing": lambda p: _replace_manifest(
        p, {**json.loads((p / "manifest.json").read_text()), "partitions": None}
    ),
    "arrow-copy-truncated": lambda p: _truncate(p / "part-00000.arrow"),
    "shards-table-truncated": lambda p: _truncate(p / "shards.parquet"),
    "shards-table-without-urls": lambda p: pq.write_table(
        pa.table({"kind": ["tar"], "num_samples": [48]}), p / "shards.parquet"
    ),
    "by-shard-header-unbalanced": lambda p: (p / "by_shard.npy").write_bytes(
        (p / "by_shard.npy").read_bytes().replace(b"(48,)", b"(48,(")
    ),
    "by-shard-truncated": lambda p: _truncate(p / "by_shard.npy"),
}


@pytest.mark.parametrize("damage", sorted(KNOWN_DAMAGE))
def test_known_damage_is_an_index_format_error_naming_the_file(index_dir: Path, work: Path, damage: str) -> None:
    copy = _fresh_copy(index_dir, work)
    KNOWN_DAMAGE[damage](copy)
    with pytest.raises(IndexFormatError, match=re.escape(str(copy))):
        SampleIndex(copy)
