"""Damage costs one sample at index time: damaged samples are left out and every one named; the rest of
the shard is indexed; ``strict`` refuses the shard as before; the manifest counts them; the CLI's exit
status says so (issue 18, item 5)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omnifeed.loader import IndexConfig, SampleIndex, build_index
from omnifeed.loader._errors import SourceError
from omnifeed.loader.index._records import ShardSpec
from omnifeed.loader.index._scan import scan_shard
from omnifeed.tools._cli import main
from omnifeed.tools._demo_data import encode_image

GOOD, BAD = 92, 10
CONFIG = IndexConfig(workers=1, partitions=2)
STRICT = CONFIG.model_copy(update={"strict": True})


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _damaged_tar(path: Path, good: int = GOOD, bad: int = BAD) -> tuple[Path, list[str]]:
    """``good`` samples (a JPEG and a label) with ``bad`` samples whose JPEG header is broken spread among them."""
    members, damaged, total = [], [], good + bad
    for i in range(total):
        key = f"s{i:04d}"
        broken = i * bad // total != (i + 1) * bad // total  # exactly ``bad`` of them, evenly spread
        image = b"\xff\xd8\xff\xe0 not a JPEG after all" if broken else encode_image(16, 12, "jpg", seed=i)
        members += [(f"{key}.jpg", image), (f"{key}.cls", str(i % 5).encode())]
        damaged += [key] if broken else []
    assert len(damaged) == bad
    return _tar(path, members), damaged


@pytest.fixture(scope="module")
def damaged_shard(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    return _damaged_tar(tmp_path_factory.mktemp("damage") / "mixed.tar")


def test_a_tar_with_damaged_headers_indexes_every_good_sample_and_names_every_damaged_one(
    damaged_shard: tuple[Path, list[str]], tmp_path: Path
) -> None:
    shard, damaged = damaged_shard
    report = build_index([str(shard)], tmp_path / "index", CONFIG, progress=False)
    assert report.num_samples == GOOD and not report.errors and not report.ok
    assert [d["key"] for d in report.damaged] == damaged
    for entry in report.damaged:
        assert entry["file"] == str(shard) and entry["member"] == f"{entry['key']}.jpg"
        assert entry["reason"] == "header" and "unreadable image header" in entry["error"]
        assert str(shard) in entry["error"] and repr(entry["key"]) in entry["error"]
    index = SampleIndex(report.path)
    assert not set(index.keys(range(index.num_samples))) & set(damaged)
    summary = index.manifest["damaged"]
    assert summary["count"] == BAD and summary["by_reason"] == {"header": BAD} and summary["samples"] == report.damaged
    assert "file" not in summary and not (report.path / "damaged.jsonl").exists()


def test_strict_refuses_the_shard_at_its_first_damaged_sample(
    damaged_shard: tuple[Path, list[str]], tmp_path: Path
) -> None:
    shard, damaged = damaged_shard
    with pytest.raises(SourceError, match=rf"member '{damaged[0]}\.jpg' of sample '{damaged[0]}'.*unreadable image"):
        scan_shard(ShardSpec(str(shard), "tar"), STRICT)
    good = _tar(tmp_path / "good.tar", [("g.jpg", encode_image(8, 8, "jpg"))])
    report = build_index([str(good), str(shard)], tmp_path / "index", STRICT, progress=False)
    assert report.num_samples == 1 and not report.damaged
    assert [e["source"] for e in report.errors] == [str(shard)]


def test_the_cli_names_every_damaged_sample_and_exits_3_and_strict_exits_1(
    damaged_shard: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard, damaged = damaged_shard
    assert main(["index", str(shard), "--out", str(tmp_path / "a"), "--workers", "1", "--no-progress", "--json"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out) | {"index": "", "fingerprint": ""} == {
        "index": "",
        "fingerprint": "",
        "samples": GOOD,
        "shards": 1,
        "errors": 0,
        "damaged": BAD,
        "classes": 0,
    }
    lines = [line for line in err.splitlines() if line.startswith("omnifeed: damaged (header): ")]
    assert len(lines) == BAD and all(f"'{key}.jpg'" in line for key, line in zip(damaged, lines))
    assert f"{BAD} damaged sample(s) left out" in err
    assert main(["index", str(shard), "--out", str(tmp_path / "b"), "--strict", "--workers", "1", "--no-progress"]) == 1
    assert "no sample could be indexed" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_many_damaged_samples_are_all_listed_in_a_side_file_and_the_index_can_be_replaced(tmp_path: Path) -> None:
    shard, damaged = _damaged_tar(tmp_path / "many.tar", good=20, bad=120)
    report = build_index([str(shard)], tmp_path / "index", CONFIG, progress=False)
    summary = SampleIndex(report.path).manifest["damaged"]
    assert summary["count"] == 120 and len(summary["samples"]) == 100 and summary["file"] == "damaged.jsonl"
    listed = [json.loads(line) for line in (report.path / "damaged.jsonl").read_text().splitlines()]
    assert [d["key"] for d in listed] == damaged and listed == report.damaged
    again = build_index([str(shard)], tmp_path / "index", CONFIG, progress=False)  # over its own side file
    assert again.num_samples == 20


def test_a_shard_whose_every_sample_is_damaged_is_refused_and_still_lists_them(tmp_path: Path) -> None:
    bad = _tar(tmp_path / "bad.tar", [("a.jpg", b"\xff\xd8\xff nope"), ("b.png", b"\x89PNG\r\n\x1a\n nope")])
    good = _tar(tmp_path / "good.tar", [("g.jpg", encode_image(8, 8, "jpg"))])
    report = build_index([str(good), str(bad)], tmp_path / "index", CONFIG, progress=False)
    assert report.num_samples == 1 and [d["key"] for d in report.damaged] == ["a", "b"]
    [error] = report.errors
    assert error["source"] == str(bad) and "every one is damaged (and 1 more damaged sample)" in error["error"]


def test_damage_inside_one_sample_costs_that_sample(tmp_path: Path) -> None:
    image = encode_image(8, 8, "png")
    shard = _tar(
        tmp_path / "t.tar",
        [("a.png", image), ("b.png", image), ("b.PNG", image), ("c.txt", b"\xff\xfe"), ("d.png", image)],
    )
    scan = scan_shard(ShardSpec(str(shard), "tar"), CONFIG)
    assert [s.key for s in scan.samples] == ["a", "d"]
    assert [(d.key, d.member, d.reason) for d in scan.damaged] == [
        ("b", "b.PNG", "field_twice"),
        ("c", "c.txt", "encoding"),
    ]


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar makes the sparse archive")
def test_the_samples_before_a_sparse_member_are_kept_and_it_and_the_rest_named(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(f"sample {name}")
    with open(tmp_path / "big.txt", "wb") as f:
        f.truncate(10**8)
        f.write(b"data")
    (tmp_path / "z.txt").write_text("after")
    run = subprocess.run(
        ["tar", "--sparse", "--format=gnu", "-cf", "s.tar", "a.txt", "b.txt", "big.txt", "z.txt"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        pytest.skip(f"this tar cannot write sparse members: {run.stderr.strip()}")
    scan = scan_shard(ShardSpec(str(tmp_path / "s.tar"), "tar"), CONFIG)
    assert [s.key for s in scan.samples] == ["a"]  # 'b' was being read: it may have had more members
    [damaged] = scan.damaged
    assert (damaged.key, damaged.member, damaged.reason) == ("b", "big.txt", "sparse")
    assert "the 1 sample before it are indexed, sample 'b' (perhaps incomplete) and the rest" in damaged.error
    with pytest.raises(SourceError, match="member 'big.txt' is a GNU sparse file"):
        scan_shard(ShardSpec(str(tmp_path / "s.tar"), "tar"), STRICT)


def test_a_parquet_row_whose_image_header_is_damaged_costs_that_row(tmp_path: Path) -> None:
    images = [encode_image(8, 8, "png", seed=i) for i in range(5)]
    images[2] = b"\x89PNG\r\n\x1a\n truncated"
    pq.write_table(
        pa.table({"image": pa.array(images, pa.binary()), "label": [0, 1, 2, 3, 4]}),
        tmp_path / "t.parquet",
        row_group_size=2,
    )
    scan = scan_shard(ShardSpec(str(tmp_path / "t.parquet"), "parquet"), CONFIG)
    assert [s.key for s in scan.samples] == ["t/0", "t/1", "t/3", "t/4"]
    assert [(d.key, d.member, d.reason) for d in scan.damaged] == [("t/2", "image", "header")]
    with pytest.raises(SourceError, match=r"member 'image' of sample 't/2'"):
        scan_shard(ShardSpec(str(tmp_path / "t.parquet"), "parquet"), STRICT)
