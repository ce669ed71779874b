"""Fuzzing the sources: damaged tar shards, Parquet files and member names give samples or a SourceError, nothing else.

Seeds are the generated demo dataset (tests/conftest.py). Whatever scans is then read back field by field
(`read_field`) and decoded (`make_decoder`): bytes, a value, or the project's own error.
"""

from __future__ import annotations

import datetime
import io
import tarfile
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnifeed.loader import IndexConfig
from omnifeed.loader._errors import SourceError
from omnifeed.loader.decode._common import DecodeError
from omnifeed.loader.decode._config import DecodeConfig
from omnifeed.loader.decode._registry import make_decoder
from omnifeed.loader.index._records import ShardScan, ShardSpec
from omnifeed.loader.index._scan import scan_shard
from omnifeed.loader.index._sources import read_field

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
CONFIG = IndexConfig(workers=1)
DECODERS = {m: make_decoder(m, DecodeConfig()) for m in ("image", "video", "audio", "text", "meta")}
# damage: (where as a fraction of the file, new byte value); then keep a leading fraction of the file
FLIPS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=16)
KEEP = st.one_of(st.just(1.0), st.floats(0.0, 1.0))


def _damage(data: bytes, flips: list[tuple[float, int]], keep: float) -> bytes:
    damaged = bytearray(data)
    for where, value in flips:
        damaged[int(where * len(damaged))] = value
    return bytes(damaged[: int(len(damaged) * keep)])


def _scan_or_source_error(shard: ShardSpec) -> ShardScan | None:
    try:
        return scan_shard(shard, CONFIG)
    except SourceError as exc:
        assert exc.url == shard.url and shard.url in str(exc)
        return None


def _read_and_decode_everything(scan: ShardScan) -> None:
    """Every field of every sample: its bytes (or a SourceError), then a value (or a DecodeError)."""
    for sample in scan.samples:
        for field in sample.fields:
            try:
                data = read_field(scan.shard, field, row_group=sample.row_group, row=sample.row)
            except SourceError:
                continue
            assert len(data) == field.size
            try:
                DECODERS[field.modality](data, sample.key)
            except DecodeError as exc:
                assert exc.key == sample.key


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-sources")


@pytest.fixture(scope="module")
def small_tar(demo_shards: list[Path]) -> bytes:
    return min(demo_shards, key=lambda p: p.stat().st_size).read_bytes()


def _small_tar(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 946684800
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


TEXT_TAR = _small_tar([("a.txt", b"hello"), ("a.json", b'{"x": 1}'), ("b.txt", b"x" * 700), ("c/d.txt", b"yo")])
HEADERS = (0, 1024, 1536, 3072)  # where TEXT_TAR's member headers start
TAR_FIELDS = {
    "name": (0, 100),
    "mode": (100, 108),
    "size": (124, 136),
    "type": (156, 157),
    "link": (157, 257),
    "magic": (257, 265),
    "prefix": (345, 500),
    "anywhere": (0, 512),
}


def _with_checksum(header: bytearray) -> None:
    """Recompute a tar header's checksum, so that tarfile parses the damaged fields instead of stopping."""
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(
    header=st.sampled_from(HEADERS),
    field=st.sampled_from(sorted(TAR_FIELDS)),
    data=st.data(),
    checksum=st.booleans(),
    keep=KEEP,
)
def test_damaged_tar_headers_scan_or_raise_a_source_error(
    work: Path, header: int, field: str, data: st.DataObject, checksum: bool, keep: float
) -> None:
    tar = bytearray(TEXT_TAR)
    start, end = TAR_FIELDS[field]
    special = st.sampled_from(b"\0 /.7LKxgSD5\xff\x80")
    for _ in range(data.draw(st.integers(1, 6))):
        tar[header + data.draw(st.integers(start, end - 1))] = data.draw(special | st.integers(0, 255))
    if checksum:
        block = tar[header : header + 512]
        _with_checksum(block)
        tar[header : header + 512] = block
    path = work / "header.tar"
    path.write_bytes(bytes(tar[: int(len(tar) * keep)]))
    scan = _scan_or_source_error(ShardSpec(str(path), "tar"))
    if scan is not None:
        _read_and_decode_everything(scan)


def test_a_member_name_that_is_not_utf8_is_a_source_error_naming_it(work: Path) -> None:
    tar = bytearray(TEXT_TAR)
    tar[0:2] = b"\xff\xfe"  # "a.txt" -> b"\xff\xfetxt" (tarfile decodes it to lone surrogates)
    header = tar[0:512]
    _with_checksum(header)
    tar[0:512] = header
    (work / "latin.tar").write_bytes(bytes(tar))
    with pytest.raises(SourceError, match=r"not valid UTF-8.*re-create the shard") as caught:
        scan_shard(ShardSpec(str(work / "latin.tar"), "tar"), CONFIG)
    assert r"\udcff\udcfetxt" in str(caught.value)


NAME_PARTS = st.sampled_from(
    ["a", "B", "..", ".", "", "x.txt", "y.JPG", ".hidden", "__key__", "é", "文", "a.b.c", "\\", " ", "z.tar"]
)
MEMBER_NAMES = st.lists(NAME_PARTS, min_size=1, max_size=4).map("/".join) | st.text(max_size=30)


@pytest.mark.timeout(120)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(names=st.lists(MEMBER_NAMES, min_size=1, max_size=5), absolute=st.booleans())
def test_any_member_names_scan_to_relative_keys_or_raise_a_source_error(
    work: Path, names: list[str], absolute: bool
) -> None:
    names = [("/" + n if absolute and i == 0 else n) for i, n in enumerate(names)]
    try:
        data = _small_tar([(name, name.encode("utf-8", "surrogatepass")[:40]) for name in names])
    except (ValueError, UnicodeError):  # tarfile cannot even write such a name (NUL, lone surrogates)
        return
    path = work / "names.tar"
    path.write_bytes(data)
    scan = _scan_or_source_error(ShardSpec(str(path), "tar"))
    for sample in scan.samples if scan is not None else []:
        parts = sample.key.split("/")
        assert sample.key and not sample.key.startswith("/") and ".." not in parts
        for field in sample.fields:
            assert field.member.startswith(sample.key + ".") and field.name == field.name.lower()


def test_a_member_declaring_gigabytes_in_a_small_file_is_refused_without_reading_them(work: Path) -> None:
    tar = bytearray(TEXT_TAR)
    header = tar[0:512]
    header[124:136] = b"%011o\0" % (8 * 2**30 - 1)  # 'a.txt' now claims 8 GiB
    _with_checksum(header)
    tar[0:512] = header
    (work / "huge.tar").write_bytes(bytes(tar))
    tracemalloc.start()
    try:
        with pytest.raises(SourceError, match="huge.tar"):
            scan_shard(ShardSpec(str(work / "huge.tar"), "tar"), CONFIG)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20


# -- Parquet ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_parquet(demo_parquet: Path, work: Path) -> bytes:
    """The demo table's first 12 rows, in row groups of 4."""
    path = work / "seed.parquet"
    pq.write_table(pq.read_table(demo_parquet).slice(0, 12), path, row_group_size=4)
    return path.read_bytes()


# -- a tar shard or a Parquet file, damaged before or after indexing ---------------------------------------


@pytest.fixture(scope="module")
def seeds(small_tar: bytes, small_parquet: bytes) -> dict[str, bytes]:
    return {"tar": small_tar, "parquet": small_parquet}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tar", "parquet"])
@FUZZ
@given(flips=FLIPS, keep=KEEP)
def test_a_damaged_shard_scans_or_raises_a_source_error(
    work: Path, seeds: dict[str, bytes], kind: str, flips: list[tuple[float, int]], keep: float
) -> None:
    path = work / f"damaged.{kind}"
    path.write_bytes(_damage(seeds[kind], flips, keep))
    scan = _scan_or_source_error(ShardSpec(str(path), kind))
    if scan is not None:
        _read_and_decode_everything(scan)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tar", "parquet"])
@FUZZ
@given(flips=FLIPS, keep=KEEP)
def test_a_shard_damaged_after_indexing_reads_back_or_raises_a_source_error(
    work: Path, seeds: dict[str, bytes], kind: str, flips: list[tuple[float, int]], keep: float
) -> None:
    path = work / f"indexed.{kind}"
    path.write_bytes(seeds[kind])
    scan = scan_shard(ShardSpec(str(path), kind), CONFIG)
    path.write_bytes(_damage(seeds[kind], flips, keep))
    _read_and_decode_everything(scan)


_INVALID_UTF8 = pa.Array.from_buffers(
    pa.string(), 2, [None, pa.py_buffer(b"\0\0\0\0\2\0\0\0\4\0\0\0"), pa.py_buffer(b"a\xffcd")]
)
COLUMNS = st.sampled_from(
    [
        pa.array([b"\x00\xff", None]),
        pa.array(["naïve", None]),
        _INVALID_UTF8,
        pa.array([1, 2**62]),
        pa.array([1.5, float("nan")]),
        pa.array([[1, 2], None]),
        pa.array([{"a": "x"}, {"a": None}]),
        pa.array([2**62, 0], pa.timestamp("ms")),
        pa.array([datetime.date(2000, 1, 1), None]),
        pa.array([True, False]),
        pa.array(["x", "y"]).dictionary_encode(),
        pa.array([None, None], pa.null()),
        pa.array([2**40, 1], pa.duration("s")),
        pa.array([[("k", 1)], []], pa.map_(pa.string(), pa.int32())),
    ]
)


@pytest.mark.timeout(120)
@FUZZ
@given(
    key=COLUMNS,
    columns=st.dictionaries(st.sampled_from(["txt", "json", "jpg", "flac", "cls", "TXT"]), COLUMNS, max_size=3),
)
def test_parquet_columns_of_any_type_scan_or_raise_a_source_error(
    work: Path, key: pa.Array, columns: dict[str, pa.Array]
) -> None:
    path = work / "typed.parquet"
    pq.write_table(pa.table({"__key__": key, **columns}), path)
    scan = _scan_or_source_error(ShardSpec(str(path), "parquet"))
    if scan is not None:
        _read_and_decode_everything(scan)


def test_parquet_text_that_is_not_utf8_is_a_damaged_row_naming_the_key(work: Path) -> None:
    pq.write_table(pa.table({"__key__": ["k1", "k2"], "txt": _INVALID_UTF8}), work / "latin.parquet")
    scan = scan_shard(ShardSpec(str(work / "latin.parquet"), "parquet"), CONFIG)
    assert [s.key for s in scan.samples] == ["k2"]  # the damaged row is left out, the rest indexed
    [damaged] = scan.damaged
    assert damaged.key == "k1" and damaged.reason == "encoding" and damaged.member == "txt"
    with pytest.raises(SourceError, match=r"'txt'.*sample 'k1'.*not valid UTF-8") as caught:
        scan_shard(ShardSpec(str(work / "latin.parquet"), "parquet"), CONFIG.model_copy(update={"strict": True}))
    assert caught.value.key == "k1"
    pq.write_table(pa.table({"__key__": _INVALID_UTF8, "txt": ["a", "b"]}), work / "latin-key.parquet")
    with pytest.raises(SourceError, match=r"'__key__' holds a key that cannot be converted \(UnicodeDecodeError"):
        scan_shard(ShardSpec(str(work / "latin-key.parquet"), "parquet"), CONFIG)


def test_a_parquet_value_python_cannot_represent_is_a_source_error_naming_the_column(work: Path) -> None:
    pq.write_table(pa.table({"__key__": ["k"], "when": pa.array([2**62], pa.timestamp("ms"))}), work / "t.parquet")
    with pytest.raises(SourceError, match=r"t\.parquet: row group 0: column 'when'.*cannot be converted"):
        scan_shard(ShardSpec(str(work / "t.parquet"), "parquet"), CONFIG)
