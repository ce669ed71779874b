"""Sources: expansion, scanning of tar/Parquet/folder shards, and ranged reads back by location."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from test_probe import encode_audio, encode_image, encode_video

from omnifeed.loader import IndexConfig
from omnifeed.loader._errors import SourceError
from omnifeed.loader.index._records import ShardSpec
from omnifeed.loader.index._scan import scan_shard
from omnifeed.loader.index._sources import expand_sources, read_field

CONFIG = IndexConfig()


@pytest.fixture(scope="module")
def media() -> dict[str, bytes]:
    return {
        "jpg": encode_image(64, 48),
        "png": encode_image(7, 300, "PNG"),
        "mp4": encode_video(frames=6),
        "flac": encode_audio(seconds=1.5),
    }


def samples_of(media: dict[str, bytes]) -> list[dict]:
    return [
        {"__key__": "s0", "jpg": media["jpg"], "txt": b"Hello, world!", "seg.json": b'{"a": 1}'},
        {"__key__": "dir/s1", "PNG": media["png"], "mp4": media["mp4"], "flac": media["flac"]},
        {"__key__": "s2", "txt": "naïve text here".encode(), "cap.txt": b"two more"},
    ]


def write_tar(path: Path | io.BytesIO, samples: list[dict]) -> Path | io.BytesIO:
    with wds.TarWriter(path if isinstance(path, io.BytesIO) else str(path), encoder=False) as writer:
        for sample in samples:
            writer.write(sample)
    return path


def raw_tar(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> Path:
    """A tar with members exactly as given (names are not checked); a name ending in '/' is a folder."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.type = len(data), tarfile.DIRTYPE if name.endswith("/") else tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    return path


def originals(samples: list[dict]) -> dict[tuple[str, str], bytes]:
    return {(s["__key__"], k.lower()): v for s in samples for k, v in s.items() if k != "__key__"}


def read_all(scan) -> dict[tuple[str, str], bytes]:
    """Every field of every sample of a scan, read back by its location."""
    return {
        (s.key, f.name): read_field(scan.shard, f, row_group=s.row_group, row=s.row)
        for s in scan.samples
        for f in s.fields
    }


def test_tar_scan_follows_webdataset_conventions(tmp_path, media):
    scan = scan_shard(ShardSpec(str(write_tar(tmp_path / "a.tar", samples_of(media))), "tar"), CONFIG)
    assert [s.key for s in scan.samples] == ["s0", "dir/s1", "s2"]
    fields = {s.key: {f.name: f.modality for f in s.fields} for s in scan.samples}
    assert fields["s0"] == {"jpg": "image", "seg.json": "meta", "txt": "text"}
    assert fields["dir/s1"] == {"png": "image", "mp4": "video", "flac": "audio"}
    assert [f.member for f in scan.samples[1].fields] == ["dir/s1.flac", "dir/s1.mp4", "dir/s1.PNG"]
    assert scan.size_bytes == (tmp_path / "a.tar").stat().st_size
    assert len({s.digest for s in scan.samples}) == 3


def test_tar_scan_measures_lengths(tmp_path, media):
    s0, s1, s2 = scan_shard(ShardSpec(str(write_tar(tmp_path / "a.tar", samples_of(media))), "tar"), CONFIG).samples
    assert (s0.lengths.image_width, s0.lengths.image_height, s0.lengths.text_tokens) == (64, 48, 4)
    assert (s1.lengths.image_width, s1.lengths.image_height) == (7, 300)
    assert abs(s1.lengths.video_frames - 6) <= 1 and s1.lengths.video_fps == pytest.approx(24)
    assert (s1.lengths.video_width, s1.lengths.video_height) == (64, 48)
    assert s1.lengths.audio_seconds == pytest.approx(1.5, abs=1024 / 16000) and s1.lengths.audio_sample_rate == 16000
    assert s2.lengths.text_tokens == 5  # 'naïve text here' + 'two more', summed over text fields


def test_read_field_returns_the_exact_bytes_of_every_tar_field(tmp_path, media):
    samples = samples_of(media)
    scan = scan_shard(ShardSpec(str(write_tar(tmp_path / "a.tar", samples)), "tar"), CONFIG)
    assert read_all(scan) == originals(samples)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_skips_folders_hidden_and_meta_members_and_reads_long_names(tmp_path, fmt):
    long_key = "deep/" * 20 + "k" if fmt != tarfile.USTAR_FORMAT else "k"  # beyond 100 chars: extra headers
    members = [
        ("deep/", b""),
        ("._a.jpg", b"mac junk"),
        ("__index__", b"{}"),
        (f"{long_key}.txt", b"one two"),
        (f"{long_key}.Meta.JSON", b"[]"),
        ("README", b"no extension"),
    ]
    scan = scan_shard(ShardSpec(str(raw_tar(tmp_path / "t.tar", members, fmt)), "tar"), CONFIG)
    [sample] = scan.samples
    assert sample.key == long_key and [f.name for f in sample.fields] == ["meta.json", "txt"]
    assert [read_field(scan.shard, f) for f in sample.fields] == [b"[]", b"one two"]


def test_tar_field_is_a_ranged_read_of_the_member_only(tmp_path):
    big = [{"__key__": "pad", "bin": b"\x01" * 4_000_000}, {"__key__": "k", "txt": b"hi"}]
    shard = write_tar(tmp_path / "big.tar", big)
    field = scan_shard(ShardSpec(str(shard), "tar"), CONFIG).samples[1].fields[0]
    rchar = lambda text: int(text.split("rchar:")[1].split()[0])  # noqa: E731
    for url in (str(shard), f"file://{shard}"):
        io_before = Path("/proc/self/io").read_text()
        assert read_field(ShardSpec(url, "tar"), field) == b"hi"
        # the read syscalls fetched far less than the 4 MB shard
        assert rchar(Path("/proc/self/io").read_text()) - rchar(io_before) < 1_000_000


def test_memory_urls_work_for_tar_and_parquet(media):
    fs = fsspec.filesystem("memory")
    try:
        samples = samples_of(media)
        fs.pipe_file("/omnifeed-test/shards/a.tar", write_tar(io.BytesIO(), samples).getvalue())
        sink = io.BytesIO()
        pq.write_table(pa.table({"__key__": ["p0"], "txt": ["a b c"]}), sink)
        fs.pipe_file("/omnifeed-test/shards/b.parquet", sink.getvalue())
        shards = expand_sources(["memory://omnifeed-test/shards/*"])
        assert [(s.url, s.kind) for s in shards] == [
            ("memory:///omnifeed-test/shards/a.tar", "tar"),
            ("memory:///omnifeed-test/shards/b.parquet", "parquet"),
        ]
        tar_scan, parquet_scan = (scan_shard(s, CONFIG) for s in shards)
        assert read_all(tar_scan) == originals(samples)
        assert read_all(parquet_scan) == {("p0", "txt"): b"a b c"}
    finally:
        fs.rm("/omnifeed-test", recursive=True)


def write_parquet(path: Path) -> Path:
    table = pa.table(
        {
            "__key__": ["r0", "r1", "r2"],
            "Caption": ["one two", None, "three"],
            "jpg": pa.array([encode_image(10, 20), encode_image(3, 4), None], pa.binary()),
            "ocr.txt": pa.array([b"x y", b"z", None], pa.large_binary()),
            "label": [1, 2, 3],
        }
    )
    pq.write_table(table, path, row_group_size=2)
    return path


def test_parquet_scan_reads_rows_as_samples_by_row_group(tmp_path):
    config = IndexConfig(modalities={"caption": "text"})
    scan = scan_shard(ShardSpec(str(write_parquet(tmp_path / "t.parquet")), "parquet"), config)
    assert [(s.key, s.row_group, s.row) for s in scan.samples] == [("r0", 0, 0), ("r1", 0, 1), ("r2", 1, 0)]
    r0, r1, r2 = scan.samples
    assert {f.name: (f.modality, f.member) for f in r0.fields} == {
        "caption": ("text", "Caption"),
        "jpg": ("image", "jpg"),
        "ocr.txt": ("text", "ocr.txt"),
        "label": ("meta", "label"),
    }
    assert "caption" not in {f.name for f in r1.fields} and "jpg" not in {f.name for f in r2.fields}
    assert (r0.lengths.text_tokens, r0.lengths.image_width, r0.lengths.image_height) == (4, 10, 20)
    assert all(f.offset == -1 for s in scan.samples for f in s.fields)
    assert scan.size_bytes == (tmp_path / "t.parquet").stat().st_size


def test_read_field_returns_parquet_cells_as_bytes(tmp_path):
    scan = scan_shard(ShardSpec(str(write_parquet(tmp_path / "t.parquet")), "parquet"), CONFIG)
    got = read_all(scan)
    assert got[("r0", "caption")] == b"one two" and got[("r2", "caption")] == b"three"
    assert got[("r1", "jpg")] == encode_image(3, 4) and got[("r1", "ocr.txt")] == b"z"
    assert got[("r2", "label")] == b"3"


def write_folder(root: Path, media: dict[str, bytes]) -> dict[str, bytes]:
    files = {"b/x.jpg": media["jpg"], "b/x.TXT": b"a b", "a.seg.json": b"{}", "a.png": media["png"]}
    files["c/d/e.flac"] = media["flac"]
    for relative, data in {**files, ".hidden.txt": b"no", "b/.x.jpg": b"no", ".git/HEAD.txt": b"no"}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
    return files


def test_folder_scan_groups_files_by_key_and_skips_hidden_ones(tmp_path, media):
    files = write_folder(tmp_path / "data", media)
    scan = scan_shard(expand_sources([str(tmp_path / "data")])[0], CONFIG)
    assert [s.key for s in scan.samples] == ["a", "b/x", "c/d/e"]
    assert [[(f.name, f.member) for f in s.fields] for s in scan.samples] == [
        [("png", "a.png"), ("seg.json", "a.seg.json")],
        [("jpg", "b/x.jpg"), ("txt", "b/x.TXT")],
        [("flac", "c/d/e.flac")],
    ]
    members = {(s.key, f.name): f.member for s in scan.samples for f in s.fields}
    assert read_all(scan) == {where: files[member] for where, member in members.items()}
    assert scan.size_bytes == sum(map(len, files.values()))
    assert (scan.samples[1].lengths.image_width, scan.samples[1].lengths.text_tokens) == (64, 2)


def test_brace_lists_and_globs_expand_in_order_without_duplicates(tmp_path, media):
    for i in range(3):
        write_tar(tmp_path / f"shard-{i:03d}.tar", samples_of(media)[:1])
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.md").write_text("ignored by globs")
    shards = expand_sources([f"{tmp_path}/shard-{{002..000}}.tar", f"{tmp_path}/*", f"file://{tmp_path}/shard-001.tar"])
    assert [(Path(s.url).name, s.kind) for s in shards] == [
        ("shard-002.tar", "tar"),
        ("shard-001.tar", "tar"),
        ("shard-000.tar", "tar"),
        ("folder", "folder"),
    ]
    chained = expand_sources([f"simplecache::file://{tmp_path}/shard-00{{0,1}}.tar"])
    assert [s.url for s in chained] == [f"simplecache::file://{tmp_path}/shard-00{i}.tar" for i in (0, 1)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("shard-{000..003}.tar", r"1 of the 4 paths it names does not exist \(shard-003\.tar\); 3 exist"),
        ("nothing-*.tar", "no file or folder matches the pattern"),
        ("missing.parquet", "does not exist"),
        ("old.tar.gz", "re-pack it as a plain .tar"),
        ("old-{1..2}.tgz", "compressed tar"),
    ],
)
def test_bad_source_specs_are_named_in_the_error(tmp_path, media, spec, message):
    for i in range(3):
        write_tar(tmp_path / f"shard-{i:03d}.tar", samples_of(media)[:1])
    with pytest.raises(SourceError, match=message) as info:
        expand_sources([f"{tmp_path}/{spec}"])
    assert info.value.url == f"{tmp_path}/{spec}"


def scan_error(path: Path, kind: str = "tar", config: IndexConfig = CONFIG) -> SourceError:
    with pytest.raises(SourceError) as info:
        scan_shard(ShardSpec(str(path), kind), config)
    assert str(path) in str(info.value) and info.value.url == str(path)
    return info.value


@pytest.mark.parametrize("where", ["mid-header", "at-header", "mid-data", "no-end-marker", "first-block"])
def test_a_truncated_tar_keeps_the_samples_before_the_break_and_names_the_rest(tmp_path, media, where):
    data = write_tar(io.BytesIO(), samples_of(media)).getvalue()
    last = tarfile.open(fileobj=io.BytesIO(data)).getmembers()[-1]
    end = {
        "mid-header": last.offset + 100,
        "at-header": last.offset,
        "mid-data": last.offset_data + last.size // 2,
        "no-end-marker": last.offset_data + last.size,
        "first-block": 300,
    }[where]
    (tmp_path / "t.tar").write_bytes(data[:end])
    assert "re-create the shard" in str(scan_error(tmp_path / "t.tar", config=IndexConfig(strict=True)))
    if where == "first-block":  # nothing readable before the break: the shard is refused
        assert "re-create the shard" in str(scan_error(tmp_path / "t.tar"))
        return
    scan = scan_shard(ShardSpec(str(tmp_path / "t.tar"), "tar"), CONFIG)
    assert [s.key for s in scan.samples] == ["s0", "dir/s1"]
    [damaged] = scan.damaged  # the sample being read when the tar broke: perhaps incomplete
    assert damaged.key == "s2" and damaged.reason == "truncated" and "re-create the shard" in damaged.error
    assert "the 2 samples before it are indexed, sample 's2' (perhaps incomplete)" in damaged.error


def test_garbage_header_in_the_middle_of_a_tar_is_an_error(tmp_path):
    path = raw_tar(tmp_path / "t.tar", [("a.txt", b"1"), ("b.txt", b"2"), ("c.txt", b"3")])
    data = bytearray(path.read_bytes())
    data[1024:1536] = b"\x07" * 512  # the second member's header (tarfile alone would stop there silently)
    path.write_bytes(bytes(data))
    assert "corrupt" in str(scan_error(tmp_path / "t.tar"))


@pytest.mark.parametrize(
    ("members", "message", "key"),
    [
        ([("a.jpg", b"1"), ("a.JPG", b"2")], "field 'jpg' twice", "a"),
        ([("../a.txt", b"1")], "escapes its root", None),
        ([("/etc/a.txt", b"1")], "escapes its root", None),
        ([("README", b"1"), ("dir/", b""), (".hidden.txt", b"")], "no samples", None),
    ],
)
def test_malformed_tar_members_are_errors_naming_shard_and_key(tmp_path, members, message, key):
    error = scan_error(raw_tar(tmp_path / "t.tar", members))
    assert message in str(error) and error.key == key


def test_members_of_a_key_appearing_again_are_left_out_and_named_the_first_kept(tmp_path):
    path = raw_tar(tmp_path / "t.tar", [("a.txt", b"1"), ("b.txt", b"2"), ("a.jpg", b"3"), ("c.txt", b"4")])
    scan = scan_shard(ShardSpec(str(path), "tar"), CONFIG)
    assert [(s.key, [f.name for f in s.fields]) for s in scan.samples] == [
        ("a", ["txt"]),
        ("b", ["txt"]),
        ("c", ["txt"]),
    ]
    [damaged] = scan.damaged
    assert (damaged.key, damaged.member, damaged.reason) == ("a", "a.jpg", "not_adjacent")
    assert "must be adjacent" in damaged.error and str(path) in damaged.error
    assert "must be adjacent" in str(scan_error(path, config=IndexConfig(strict=True)))


def test_empty_and_compressed_tars_are_errors(tmp_path):
    (tmp_path / "empty.tar").write_bytes(b"\0" * 10240)
    assert "no samples" in str(scan_error(tmp_path / "empty.tar"))
    with tarfile.open(tmp_path / "c.tar", "w:gz") as tar:
        tar.addfile(tarfile.TarInfo("a.txt"), io.BytesIO(b""))
    assert "re-pack" in str(scan_error(tmp_path / "c.tar"))


def test_corrupt_image_header_names_the_shard_member_and_key(tmp_path):
    error = scan_error(write_tar(tmp_path / "t.tar", [{"__key__": "k9", "jpg": b"\xff\xd8 not really"}]))
    assert "'k9.jpg'" in str(error) and error.key == "k9" and "map the field to 'meta'" in str(error)


def test_parquet_without_a_key_column_is_keyed_by_file_stem_and_row_and_a_named_one_must_exist(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b", "c"], "txt": ["x", "y", "z"]}), tmp_path / "t.parquet", row_group_size=2)
    by_row = scan_shard(ShardSpec(str(tmp_path / "t.parquet"), "parquet"), CONFIG)
    assert [(s.key, s.row_group, s.row) for s in by_row.samples] == [("t/0", 0, 0), ("t/1", 0, 1), ("t/2", 1, 0)]
    assert [f.name for f in by_row.samples[0].fields] == ["id", "txt"]
    by_id = scan_shard(ShardSpec(str(tmp_path / "t.parquet"), "parquet"), IndexConfig(key_column="id"))
    assert [s.key for s in by_id.samples] == ["a", "b", "c"]
    error = scan_error(tmp_path / "t.parquet", "parquet", IndexConfig(key_column="name"))
    assert "no key column 'name'" in str(error) and "IndexConfig.key_column (--key-column)" in str(error)
    pq.write_table(pa.table({"__key__": ["a", "a"]}), tmp_path / "d.parquet")
    assert "again" in str(scan_error(tmp_path / "d.parquet", "parquet"))


def test_empty_folder_and_not_a_parquet_file_are_errors(tmp_path):
    (tmp_path / "empty" / ".cache").mkdir(parents=True)
    assert "no samples" in str(scan_error(tmp_path / "empty", "folder"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    assert "unreadable Parquet" in str(scan_error(tmp_path / "bad.parquet", "parquet"))


def test_read_field_errors_name_the_url_and_member(tmp_path, media):
    path = write_tar(tmp_path / "a.tar", samples_of(media))
    scan = scan_shard(ShardSpec(str(path), "tar"), CONFIG)
    path.write_bytes(path.read_bytes()[:5000])  # the shard shrank after indexing
    with pytest.raises(SourceError, match=r"member 'dir/s1\.mp4'.*truncated"):
        read_field(scan.shard, scan.samples[1].fields[1])
    folder = ShardSpec(str(tmp_path), "folder")
    with pytest.raises(SourceError, match="not found"):
        read_field(folder, scan.samples[0].fields[0])
    with pytest.raises(SourceError, match="escapes the folder"):
        read_field(folder, scan.samples[0].fields[0].__class__("txt", "text", "../a.tar", 0, 1))
