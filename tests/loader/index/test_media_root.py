"""Media cells holding only a path (``datasets``' ``to_parquet`` of local files): refused in two lines naming
``--media-root`` and the embed step, printed once; with a media root, read beneath it and confined (issue 28)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from omnifeed.loader import Feed, FeedConfig, IndexConfig, PlanConfig, SampleIndex, SourceError, build_index, read_field
from omnifeed.tools._cli import main
from omnifeed.tools._demo_data import encode_image

datasets = pytest.importorskip("datasets", reason="the Hugging Face datasets library writes the fixture")

ROWS = 6


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the media folder, the Parquet file ``to_parquet`` wrote of a dataset of its images, by absolute path)."""
    work = tmp_path_factory.mktemp("paths")
    media = work / "photos"
    for row in range(ROWS):
        (media / f"class{row % 2}").mkdir(parents=True, exist_ok=True)
        (media / f"class{row % 2}" / f"{row}.png").write_bytes(encode_image(10 + row, 8, "png", seed=row))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    ds = datasets.Dataset.from_dict(
        {
            "image": [str(media / f"class{r % 2}" / f"{r}.png") for r in range(ROWS)],
            "label": [r % 2 for r in range(ROWS)],
        },
        features=features,
    )
    ds.to_parquet(str(work / "train.parquet"))  # keeps each file's path, not its bytes
    assert pq.read_table(work / "train.parquet").column("image")[0]["bytes"].as_py() is None
    return media, work / "train.parquet"


def test_without_a_media_root_the_file_is_refused_in_two_lines_printed_once(
    exported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, table = exported
    assert main(["index", str(table), "--out", str(tmp_path / "index"), "--workers", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("omnifeed: error: ") and "column 'image' holds file paths, not the files" in lines[0]
    assert "--media-root DIR" in lines[1] and "embed_table_storage" in lines[1] and err.count("--media-root") == 1
    assert not (tmp_path / "index").exists()


def test_under_a_media_root_path_only_cells_index_and_feed_like_embedded_ones(
    exported: tuple[Path, Path], tmp_path: Path
) -> None:
    media, table = exported
    report = build_index(
        [str(table)], tmp_path / "index", IndexConfig(workers=1, media_root=str(media)), progress=False
    )
    assert report.ok and report.num_samples == ROWS
    index = SampleIndex(report.path)
    for sample in index.samples(range(ROWS)):
        row = int(sample.key.rsplit("/", 1)[1])
        image = next(f for f in sample.fields if f.name == "image")
        assert image.modality == "image" and sample.lengths.image_width == 10 + row
        assert read_field(sample.shard, image) == (media / f"class{row % 2}" / f"{row}.png").read_bytes()
    with Feed(index, FeedConfig(plan=PlanConfig(seed=0, batch_size=ROWS))) as feed:
        batch = feed.next_batch()
    rows = [int(key.rsplit("/", 1)[1]) for key in batch["__key__"]]
    assert (
        sorted(batch["image"]["index"].tolist()) == list(range(ROWS)) and batch["image"]["pixels"].dtype == torch.uint8
    )
    assert [round(w / h * 8) for h, w in batch["image"]["sizes"].tolist()] == [10 + r for r in rows]  # resized, as read
    assert batch["meta"]["label"].dtype == torch.int64 and batch["meta"]["label"].tolist() == [r % 2 for r in rows]


def test_a_path_leading_outside_the_media_root_or_missing_damages_only_its_row(tmp_path: Path) -> None:
    root, outside = tmp_path / "media", tmp_path / "secret"
    root.mkdir()
    outside.mkdir()
    (root / "ok.png").write_bytes(encode_image(9, 9, "png"))
    (outside / "key.png").write_bytes(encode_image(7, 7, "png"))
    os.symlink(outside / "key.png", root / "link.png")
    paths = ["ok.png", str(root / "ok.png"), str(outside / "key.png"), "../secret/key.png", "link.png", "gone.png"]
    cells = pa.array(
        [{"bytes": None, "path": p} for p in paths], pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    )
    pq.write_table(pa.table({"__key__": [f"k{i}" for i in range(len(paths))], "image": cells}), tmp_path / "t.parquet")
    report = build_index(
        [str(tmp_path / "t.parquet")], tmp_path / "index", IndexConfig(workers=1, media_root=str(root)), progress=False
    )
    assert report.num_samples == 2 and {d["key"]: d["reason"] for d in report.damaged} == dict.fromkeys(
        ["k2", "k3", "k4", "k5"], "no_bytes"
    )
    errors = {d["key"]: d["error"] for d in report.damaged}
    assert "not beneath the media root" in errors["k2"] and "not beneath the media root" in errors["k3"]
    assert "outside the folder" in errors["k4"] and "--media-root" in errors["k5"]
    index = SampleIndex(report.path)
    sample = index.sample(0)
    (root / "ok.png").unlink()
    os.symlink(outside / "key.png", root / "ok.png")  # swapped for a link out after indexing: never read
    with pytest.raises(SourceError, match="outside the folder"):
        read_field(sample.shard, next(f for f in sample.fields if f.name == "image"))
