"""Hostile sources and outputs: sparse tar members, Parquet decompression bombs, FIFOs, link loops
and linked folders, a link swapped in while fields are read, `index --out` over foreign files,
ranges with holes, and `build_index` in a script without a main guard (docs/security.md §3, §4; issues 16 and 23)."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tarfile
import textwrap
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omnifeed.loader import IndexConfig, SampleIndex, build_index
from omnifeed.loader._errors import OmnifeedError, SourceError
from omnifeed.loader.index._parquet_pages import _Thrift
from omnifeed.loader.index._records import FieldLocation, ShardSpec
from omnifeed.loader.index._scan import scan_shard
from omnifeed.loader.index._sources import read_field

CONFIG = IndexConfig(workers=1, partitions=2)
DECLARED = 1500 * 2**20  # what a 10 KB shard declares (issue 23: 3.3 GB peak at scan time before)


def _tar(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> Path:
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _checksum(header: bytearray) -> None:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)


def _scan_peak(path: Path) -> tuple[SourceError, int]:
    """The SourceError scanning ``path`` raises, and the peak of Python allocations meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(SourceError) as info:
            scan_shard(ShardSpec(str(path), "tar"), CONFIG)
        return info.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- tar: sparse members and declared sizes -----------------------------------------------------------


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar makes the sparse archives")
@pytest.mark.parametrize(
    "options", [["--format=gnu"], *(["--format=posix", f"--sparse-version={v}"] for v in ("0.0", "0.1", "1.0"))]
)
def test_a_sparse_member_made_by_gnu_tar_is_refused_without_expanding_it(tmp_path: Path, options: list[str]) -> None:
    (tmp_path / "a.txt").write_bytes(b"fine")
    with open(tmp_path / "big.txt", "wb") as f:  # 1.5 GB of holes around one block of data
        f.truncate(DECLARED)
        f.seek(10**6)
        f.write(b"data")
    run = subprocess.run(
        ["tar", "--sparse", *options, "-cf", "sparse.tar", "a.txt", "big.txt"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        pytest.skip(f"this tar cannot write {options}: {run.stderr.strip()}")
    assert (tmp_path / "sparse.tar").stat().st_size < 64 * 1024
    error, peak = _scan_peak(tmp_path / "sparse.tar")
    assert str(tmp_path / "sparse.tar") in str(error) and error.url == str(tmp_path / "sparse.tar")
    assert "member 'big.txt' is a GNU sparse file" in str(error) and "without --sparse" in str(error)
    assert peak < 16 * 2**20


def test_a_hand_made_sparse_header_declaring_gigabytes_is_refused_before_its_map_is_read(tmp_path: Path) -> None:
    tar = bytearray(_tar(tmp_path / "x.tar", [("big.txt", b"x" * 512)]).read_bytes())
    header = tar[0:512]
    header[156:157] = b"S"  # GNU sparse: one extent of 512 bytes at 0, expanded size 1.5 GB
    header[386:398], header[398:410] = b"%011o\0" % 0, b"%011o\0" % 512
    header[482:483], header[483:495] = b"\0", b"%011o\0" % DECLARED
    _checksum(header)
    tar[0:512] = header
    (tmp_path / "sparse.tar").write_bytes(bytes(tar))
    error, peak = _scan_peak(tmp_path / "sparse.tar")
    assert f"member 'big.txt' is a GNU sparse file (declaring {DECLARED} bytes)" in str(error)
    assert peak < 16 * 2**20


def test_sizes_declared_by_headers_are_checked_before_anything_of_that_size_is_read(tmp_path: Path) -> None:
    tar = bytearray(_tar(tmp_path / "x.tar", [("a.txt", b"small"), ("b.txt", b"two")]).read_bytes())
    header = tar[0:512]
    header[124:136] = b"%011o\0" % DECLARED  # a member claiming 1.5 GB in a 10 KB shard
    _checksum(header)
    (tmp_path / "member.tar").write_bytes(bytes(header + tar[512:]))
    error, peak = _scan_peak(tmp_path / "member.tar")
    assert f"member 'a.txt' declares {DECLARED} bytes at byte 512, past the end of the shard" in str(error)
    assert peak < 16 * 2**20
    # a pax header (here for a long name) is read whole by tarfile: one declaring 1.5 GB is refused first
    pax = bytearray(_tar(tmp_path / "p.tar", [("d/" * 80 + "a.txt", b"x")], tarfile.PAX_FORMAT).read_bytes())
    assert pax[156:157] == tarfile.XHDTYPE
    header = pax[0:512]
    header[124:136] = b"%011o\0" % DECLARED
    _checksum(header)
    (tmp_path / "pax.tar").write_bytes(bytes(header + pax[512:]))
    error, peak = _scan_peak(tmp_path / "pax.tar")
    assert f"has an extended header declaring {DECLARED} bytes" in str(error)
    assert peak < 16 * 2**20


def _base256(size: int) -> bytes:
    return bytes([0x80]) + size.to_bytes(11, "big")  # GNU tar's size field for sizes past 8 GB


def _pax(kind: bytes, records: dict[str, str]) -> bytes:
    data = b"".join(
        b"%d %s=%s\n" % (len(f" {k}={v}\n") + len(str(len(f" {k}={v}\n") + 2)), k.encode(), v.encode())
        for k, v in records.items()
    )
    header = bytearray(tarfile.TarInfo("pax_header").tobuf(format=tarfile.USTAR_FORMAT))
    header[156:157], header[124:136] = kind, b"%011o\0" % len(data)
    _checksum(header)
    return bytes(header) + data + b"\0" * (-len(data) % 512)


@pytest.mark.timeout(60)  # before: tarfile skipped 2^62 declared bytes a buffer at a time, forever
def test_a_member_of_any_type_declaring_data_past_the_shard_is_refused_before_tarfile_skips_it(tmp_path: Path) -> None:
    tar = bytearray(
        _tar(tmp_path / "x.tar", [("a.txt", b"small"), ("b.txt", b"x" * 100), ("c.txt", b"y")]).read_bytes()
    )
    header = tar[1024:1536]
    header[156:157], header[124:136] = b"V", _base256(2**62)  # a type tarfile does not know: skipped by its size
    _checksum(header)
    (tmp_path / "volume.tar").write_bytes(bytes(tar[:1024] + header + tar[1536:]))
    error, peak = _scan_peak(tmp_path / "volume.tar")
    assert "member 'b.txt' (type 'V') declares data up to byte 461168601842738" in str(error), error
    assert "past the end of the shard" in str(error) and peak < 16 * 2**20
    # a global pax header's size replaces a regular member's, after tarfile has skipped by the header's
    header = tar[1024:1536]
    header[124:136] = _base256(2**62)
    _checksum(header)
    (tmp_path / "global.tar").write_bytes(_pax(b"g", {"size": "100"}) + bytes(tar[:1024] + header + tar[1536:]))
    error, peak = _scan_peak(tmp_path / "global.tar")
    assert "member 'b.txt' (type '0') declares data up to byte" in str(error) and peak < 16 * 2**20


@pytest.mark.parametrize("kind", [b"x", b"g", b"L"])
def test_a_chain_of_extended_headers_is_a_source_error_not_a_recursion_error(tmp_path: Path, kind: bytes) -> None:
    if kind == b"L":
        header = bytearray(tarfile.TarInfo("././@LongLink").tobuf(format=tarfile.USTAR_FORMAT))
        header[156:157], header[124:136] = kind, b"%011o\0" % 6
        _checksum(header)
        one = bytes(header) + b"n.txt\0".ljust(512, b"\0")
    else:
        one = _pax(kind, {"comment": "x"})
    (tmp_path / "chain.tar").write_bytes(one * 2000 + _tar(tmp_path / "x.tar", [("a.txt", b"small")]).read_bytes())
    error, _ = _scan_peak(tmp_path / "chain.tar")  # tarfile recurses once per header: 2,000 raised RecursionError
    assert "follows 16 extended headers in a row" in str(error), error


# -- folders: FIFOs, link loops, linked folders ---------------------------------------------------------


# -- Parquet: decompression bombs -------------------------------------------------------------------

BOMB = 300 * 2**20  # a 300 MiB cell of zeros in a 16 KB file (issue: 1.67 GB peak at index time before)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >> 7:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _zstd_bomb(
    path: Path, size: int = BOMB, page_declares: int | None = None, footer_declares: int | None = None
) -> Path:
    """A Parquet file, column ``img``, whose one cell is ``size`` zeros: 1 MiB zstd frames, made without holding them.

    ``page_declares``/``footer_declares``: the decompressed size its page header / footer claim instead (a lie).
    """
    mib = 2**20
    pq.write_table(
        pa.table({"img": [bytes(mib)]}), path, compression="zstd", use_dictionary=False, write_statistics=False
    )
    data = path.read_bytes()
    start = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    reader = _Thrift(data[start : start + 4096])
    fields = reader.struct()
    head, old_u, old_c = data[start : start + reader.pos], fields[2], fields[3]
    raw = pa.decompress(data[start + len(head) : start + len(head) + old_c], old_u, codec="zstd").to_pybytes()
    prefix = raw[: -mib - 4] + struct.pack("<I", size)  # the definition levels, then the value's length
    frame = pa.compress(bytes(mib), codec="zstd").to_pybytes()
    body = pa.compress(prefix, codec="zstd").to_pybytes() + frame * (size // mib)  # zstd frames concatenate
    new_u = len(prefix) + size
    new_head = head.replace(_varint(old_u * 2), _varint((page_declares or new_u) * 2), 1)
    new_head = new_head.replace(_varint(old_c * 2), _varint(len(body) * 2), 1)
    footer = data[start + len(head) + old_c : -8]
    for old, new in (
        (old_u + len(head), footer_declares or new_u + len(new_head)),
        (old_c + len(head), len(body) + len(new_head)),
    ):
        assert footer.count(_varint(old * 2)) >= 1
        footer = footer.replace(_varint(old * 2), _varint(new * 2))
    path.write_bytes(data[:start] + new_head + body + footer + struct.pack("<I", len(footer)) + b"PAR1")
    return path


_PEAK = """
import json, re, sys
import pyarrow as pa
from omnifeed.loader._errors import SourceError
from omnifeed.loader.index._records import FieldLocation, ShardSpec
from omnifeed.loader.index._scan import scan_shard
from omnifeed.loader.index._sources import read_field
from omnifeed.loader import IndexConfig
shard = ShardSpec(sys.argv[1], "parquet")
errors = []
try:
    scan_shard(shard, IndexConfig(workers=1, partitions=2))
except SourceError as exc:
    errors.append(str(exc))
try:
    read_field(shard, FieldLocation("img", "image", "img", -1, 1), row_group=0, row=0)
except SourceError as exc:
    errors.append(str(exc))
hwm = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
print(json.dumps({"errors": errors, "arrow_peak": pa.default_memory_pool().max_memory(), "hwm": hwm}))
"""


def _scan_and_read(path: Path) -> tuple[list[str], int, int]:
    """Index- and read-time errors for ``path``, the peak Arrow allocation and resident memory (in a child)."""
    run = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, check=True)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    return out["errors"], out["arrow_peak"], out["hwm"]


@pytest.mark.parametrize("lie", ["honest", "footer_declares_1_kb"])
def test_a_parquet_decompression_bomb_is_refused_from_its_page_headers_before_arrow_decompresses_it(
    tmp_path: Path, lie: str
) -> None:
    bomb = _zstd_bomb(tmp_path / "bomb.parquet", footer_declares=1024 if lie != "honest" else None)
    assert bomb.stat().st_size < 64 * 1024
    chunk = pq.ParquetFile(bomb).metadata.row_group(0).column(0)
    assert chunk.total_uncompressed_size == (1024 if lie != "honest" else BOMB + 35)  # Arrow never uses it
    errors, arrow_peak, hwm = _scan_and_read(bomb)
    assert len(errors) == 2  # index time (scan_shard) and read time (read_field)
    for error in errors:
        assert f"{bomb}: row group 0 column 'img': its pages declare {BOMB + 10:,} bytes decompressed from" in error
        assert "refused as a decompression bomb before anything was decompressed" in error
        assert "re-write the file in smaller row groups" in error
    assert arrow_peak < 2**20  # Arrow decompressed nothing (unchecked: 600 MB; the whole index: 1.67 GB)
    assert hwm < 400 * 2**20  # the interpreter, pyarrow and omnifeed, nothing of the cell's size


def test_a_page_header_declaring_less_than_its_data_holds_fails_in_arrow_without_decompressing_it(
    tmp_path: Path,
) -> None:
    bomb = _zstd_bomb(tmp_path / "bomb.parquet", page_declares=2**20)  # passes the bound: 1 MiB declared
    errors, arrow_peak, _ = _scan_and_read(bomb)
    assert len(errors) == 2
    assert all(f"{bomb}" in error and "unreadable Parquet file" in error for error in errors)
    assert all("Destination buffer is too small" in error for error in errors)  # Arrow stops at what is declared
    assert arrow_peak < 4 * 2**20


def test_real_columns_and_a_compressible_cell_under_the_bound_are_read(tmp_path: Path) -> None:
    path = tmp_path / "fine.parquet"
    rows = 200
    table = pa.table(
        {
            "__key__": [f"k{i}" for i in range(rows)],
            "blob": [os.urandom(64 * 1024) for _ in range(rows)],
            "text": [("a caption about a cat " * 40) for _ in range(rows)],
        }
    )
    for options in (
        {"compression": "zstd"},
        {"compression": "gzip", "data_page_version": "2.0"},
        {"compression": "snappy", "use_dictionary": False, "write_page_index": True},
    ):
        pq.write_table(table, path, **options)
        scan = scan_shard(ShardSpec(str(path), "parquet"), CONFIG)
        assert len(scan.samples) == rows
    small = ShardSpec(str(_zstd_bomb(tmp_path / "small.parquet", size=8 * 2**20)), "parquet")  # 1000x, but 8 MiB
    scan = scan_shard(small, IndexConfig(workers=1, partitions=2, modalities={"img": "meta"}))
    assert [s.key for s in scan.samples] == ["small/0"]
    assert read_field(small, FieldLocation("img", "meta", "img", -1, 8 * 2**20), row_group=0, row=0) == bytes(8 * 2**20)


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_bytes(b"mine")
    (folder / "sub" / "b.txt").write_bytes(b"also mine")
    return folder


@pytest.mark.timeout(120)  # opening the FIFO would wait for a writer forever
def test_a_fifo_in_a_folder_is_skipped_with_a_warning_naming_it_and_never_opened(tmp_path: Path, caplog) -> None:
    folder = _folder(tmp_path)
    os.mkfifo(folder / "sub" / "c.txt")
    scan = scan_shard(ShardSpec(str(folder), "folder"), CONFIG)
    assert [s.key for s in scan.samples] == ["a", "sub/b"]
    assert "skipping 'sub/c.txt': a FIFO, not a regular file" in caplog.text
    report = build_index([str(folder)], tmp_path / "index", CONFIG, progress=False)
    assert report.ok and report.num_samples == 2
    # a FIFO put where an indexed file was: refused at read time, without waiting for a writer
    (folder / "a.txt").unlink()
    os.mkfifo(folder / "a.txt")
    with pytest.raises(SourceError, match=r"member 'a\.txt' \(field 'txt'\): a FIFO, not a regular file"):
        read_field(scan.shard, scan.samples[0].fields[0])


def test_a_symbolic_link_loop_is_a_source_error_naming_it(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "x.txt").symlink_to("y.txt")
    (folder / "y.txt").symlink_to("x.txt")
    with pytest.raises(SourceError, match=r"folder: 'x\.txt' is a symbolic link loop; remove or fix the link") as info:
        scan_shard(ShardSpec(str(folder), "folder"), CONFIG)
    assert "\n" not in str(info.value) and info.value.url == str(folder)
    with pytest.raises(SourceError, match=r"member 'x\.txt' \(field 'txt'\): a symbolic link loop"):
        read_field(ShardSpec(str(folder), "folder"), FieldLocation("txt", "text", "x.txt", 0, 4))


@pytest.mark.parametrize("target", ["inside", "outside"])
@pytest.mark.parametrize("name", ["linked", "linked.txt"])
def test_a_linked_subfolder_is_refused_naming_the_link(tmp_path: Path, target: str, name: str) -> None:
    folder = _folder(tmp_path)
    elsewhere = folder / "sub" if target == "inside" else tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    (folder / name).symlink_to(elsewhere)
    with pytest.raises(
        SourceError,
        match=rf"folder: '{name}' is a symbolic link to the folder .*{elsewhere.name} "
        rf"\({target} the folder\); linked folders are not followed",
    ):
        scan_shard(ShardSpec(str(folder), "folder"), CONFIG)


def test_links_to_files_inside_the_folder_are_read_and_a_dangling_one_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "sub" / "c.txt").symlink_to("../a.txt")
    (folder / "d.txt").symlink_to(folder / "sub" / "b.txt")
    scan = scan_shard(ShardSpec(str(folder), "folder"), CONFIG)
    assert {s.key: read_field(scan.shard, s.fields[0]) for s in scan.samples} == {
        "a": b"mine",
        "d": b"also mine",
        "sub/b": b"also mine",
        "sub/c": b"mine",
    }
    (folder / "e.txt").symlink_to("gone.txt")
    with pytest.raises(SourceError, match=r"'e\.txt' is a symbolic link to .*gone\.txt, which does not exist"):
        scan_shard(ShardSpec(str(folder), "folder"), CONFIG)


def test_a_socket_swapped_in_after_indexing_is_refused_as_not_a_regular_file(tmp_path: Path, caplog) -> None:
    folder = _folder(tmp_path)
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(folder / "sub" / "c.txt"))
        scan = scan_shard(ShardSpec(str(folder), "folder"), CONFIG)
        assert "skipping 'sub/c.txt': a socket, not a regular file" in caplog.text
        (folder / "a.txt").unlink()
        listening.close()
        with socket.socket(socket.AF_UNIX) as other:
            other.bind(str(folder / "a.txt"))  # open() of a socket is ENXIO: it was a bare OSError
            with pytest.raises(SourceError, match=r"member 'a\.txt' \(field 'txt'\): a socket, not a regular file"):
                read_field(scan.shard, scan.samples[0].fields[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chain", ["simplecache::", "filecache::"])
def test_a_folder_behind_an_fsspec_cache_is_confined_as_a_local_one(tmp_path: Path, chain: str) -> None:
    folder = _folder(tmp_path)
    (tmp_path / "secret.txt").write_bytes(b"SECRET")
    url = chain + str(folder)
    (folder / "c.txt").symlink_to(tmp_path / "secret.txt")  # before: indexed, the outside file's bytes served
    with pytest.raises(SourceError, match=r"'c\.txt' is a symbolic link to .*secret\.txt, outside the folder"):
        scan_shard(ShardSpec(url, "folder"), CONFIG)
    (folder / "c.txt").unlink()
    (folder / "d.txt").write_bytes(b"SECREt")
    scan = scan_shard(ShardSpec(url, "folder"), CONFIG)
    field = next(s for s in scan.samples if s.key == "d").fields[0]
    (folder / "d.txt").unlink()
    (folder / "d.txt").symlink_to(tmp_path / "secret.txt")  # the same length: only the link check stands in the way
    with pytest.raises(SourceError, match="outside the folder"):
        read_field(scan.shard, field)
    (folder / "d.txt").unlink()
    os.mkfifo(folder / "d.txt")
    with pytest.raises(SourceError, match="a FIFO, not a regular file"):
        read_field(scan.shard, field)


_SWAPPER = """
import os, sys
folder, secret, staging = sys.argv[1:]
print("swapping", flush=True)
for i in range(10**7):  # a.txt: a link to the outside file, the file again, ... (killed when the reads are done)
    if i % 2:
        with open(os.path.join(staging, "f"), "wb") as f:
            f.write(b"mine")
        os.replace(os.path.join(staging, "f"), os.path.join(folder, "a.txt"))
    else:
        os.symlink(secret, os.path.join(staging, "l"))
        os.replace(os.path.join(staging, "l"), os.path.join(folder, "a.txt"))
"""


@pytest.mark.timeout(300)
def test_a_link_swapped_in_while_fields_are_read_never_returns_the_outside_file(tmp_path: Path) -> None:
    # A writer process (a thread would rarely interleave, under the GIL): the former check-then-open
    # returned the outside file's bytes about once in 600 reads of this loop.
    folder = _folder(tmp_path)
    (tmp_path / "secret.txt").write_bytes(b"SECR")  # the same length: only the path check stands in the way
    scan = scan_shard(ShardSpec(str(folder), "folder"), CONFIG)
    field = scan.samples[0].fields[0]
    assert field.member == "a.txt"
    (tmp_path / "staging").mkdir()
    (tmp_path / "swapper.py").write_text(_SWAPPER)
    swapper = subprocess.Popen(
        [
            sys.executable,
            str(tmp_path / "swapper.py"),
            str(folder),
            str(tmp_path / "secret.txt"),
            str(tmp_path / "staging"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    outcomes = {"mine": 0, "refused": 0}
    try:
        assert swapper.stdout is not None and swapper.stdout.readline() == "swapping\n"
        for _ in range(5000):
            try:
                data = read_field(scan.shard, field)
            except SourceError as exc:
                assert "outside the folder" in str(exc), exc
                outcomes["refused"] += 1
                continue
            assert data == b"mine", "an outside file's bytes were returned"
            outcomes["mine"] += 1
        assert swapper.poll() is None, "the swapper stopped before the reads did"
    finally:
        swapper.kill()
        swapper.wait()
    assert outcomes["mine"] > 0 and outcomes["refused"] > 0, outcomes


# -- `index --out` --------------------------------------------------------------------------------------


@pytest.fixture()
def shard(tmp_path: Path) -> Path:
    return _tar(tmp_path / "s.tar", [(f"k{i}.txt", b"text") for i in range(4)])


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize(
    "contents",
    [
        {"notes.txt": b"my notes"},
        {"manifest.json": b'{"name": "my project"}', "data.bin": b"\0\1"},  # a manifest.json that is not omnifeed's
        {"manifest.json": json.dumps({"format": "omnifeed.index/1"}).encode(), "data.bin": b"\0\1"},
    ],
)
def test_index_out_over_a_folder_with_foreign_files_is_refused_and_leaves_them(
    tmp_path: Path, shard: Path, contents: dict[str, bytes]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name, data in contents.items():
        (out / name).write_bytes(data)
    with pytest.raises(OmnifeedError, match="choose another --out, or remove .*out yourself") as info:
        build_index([str(shard)], out, CONFIG, progress=False)
    assert "\n" not in str(info.value)
    assert _files(out) == contents
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.tar"]  # nothing left beside it


def test_index_out_over_an_index_with_a_foreign_file_is_refused_and_keeps_both(tmp_path: Path, shard: Path) -> None:
    out = build_index([str(shard)], tmp_path / "out", CONFIG, progress=False).path
    (out / "README.md").write_text("how I built this")
    before = _files(out)
    with pytest.raises(OmnifeedError, match=r"files omnifeed did not write \(README\.md\), which it will not delete"):
        build_index([str(shard)], out, CONFIG, progress=False)
    assert _files(out) == before


def test_index_out_replaces_omnifeeds_own_index_or_an_empty_folder(tmp_path: Path, shard: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    first = build_index([str(shard)], out, CONFIG, progress=False)
    other = _tar(tmp_path / "t.tar", [(f"j{i}.txt", b"more text") for i in range(3)])
    again = build_index([str(shard), str(other)], out, CONFIG, progress=False)
    assert (first.num_samples, again.num_samples) == (4, 7)
    assert SampleIndex(out).num_samples == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.tar", "t.tar"]  # no .building- or .old- left


def test_the_cli_refuses_a_foreign_out_in_one_line(tmp_path: Path, shard: Path, capsys) -> None:
    from omnifeed.tools._cli import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["index", str(shard), "--out", str(tmp_path / "out"), "--workers", "1", "--no-progress"]) == 1
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


# -- ranges with holes ----------------------------------------------------------------------------------


def test_a_range_with_missing_shards_names_them_and_counts_those_that_exist(tmp_path: Path) -> None:
    for i in range(10):
        if i not in (2, 5, 7):
            _tar(tmp_path / f"shards-{i:04d}.tar", [(f"k{i}.txt", b"text")])
    spec = f"{tmp_path}/shards-{{0000..0009}}.tar"
    with pytest.raises(SourceError) as info:
        build_index([spec], tmp_path / "index", CONFIG, progress=False)
    assert str(info.value) == (
        f"{spec}: 3 of the 10 paths it names do not exist "
        "(shards-0002.tar, shards-0005.tar, shards-0007.tar); 7 exist: create the missing "
        "ones or narrow the range"
    )
    with pytest.raises(SourceError, match=r"none of the 10 paths it names exists \(the first is .*/other-0000\.tar\)"):
        build_index([f"{tmp_path}/other-{{0000..0009}}.tar"], tmp_path / "index", CONFIG, progress=False)
    with pytest.raises(SourceError, match=r"no file or folder matches the pattern .*/nothing-\*\.tar"):
        build_index([f"{tmp_path}/nothing-*.tar"], tmp_path / "index", CONFIG, progress=False)
    assert not (tmp_path / "index").exists()


# -- build_index in a script without a main guard -------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("guarded", [False, True])
def test_build_index_runs_in_a_script_with_or_without_a_main_guard(tmp_path: Path, guarded: bool) -> None:
    """Scan workers do not import the caller's script: a README snippet pasted into a file just works."""
    shards = [str(_tar(tmp_path / f"s{i}.tar", [(f"k{i}-{j}.txt", b"text") for j in range(3)])) for i in range(2)]
    call = f"report = build_index({shards!r}, {str(tmp_path / 'index')!r}, IndexConfig(workers=2), progress=False)"
    body = call + "\nprint('indexed', report.num_samples)\n"
    script = "from omnifeed.loader import IndexConfig, build_index\n" + (
        "if __name__ == '__main__':\n" + textwrap.indent(body, "    ") if guarded else body
    )
    (tmp_path / "script.py").write_text(script)
    run = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False
    )
    assert run.returncode == 0 and run.stdout.strip() == "indexed 6", run.stderr


def test_a_worker_that_finds_build_index_called_while_importing_the_script_exits_at_once(tmp_path: Path) -> None:
    """The backstop, for a pool that does import the script: the worker ends with its own status, silently."""
    code = (
        "import multiprocessing\n"
        "multiprocessing.current_process()._inheriting = True\n"
        "from omnifeed.loader import build_index\n"
        "build_index(['nothing'], 'out')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 87 and not (tmp_path / "out").exists()
