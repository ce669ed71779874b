"""Folders as users bring them (issue 28): a folder of shards indexes its shards, a folder whose samples carry no
medium is refused saying what was meant, and an ImageFolder tree's class folders become an int64 ``label``."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import webdataset
from PIL import Image

from omnifeed.loader import (
    Feed,
    FeedConfig,
    IndexConfig,
    PlanConfig,
    SampleIndex,
    SourceError,
    build_index,
    expand_sources,
    read_field,
)
from omnifeed.tools._demo_data import encode_image

CONFIG = IndexConfig(workers=1, partitions=2)
CLASSES = ["blue", "green", "red"]  # sorted, as torchvision's find_classes sorts them


def png(seed: int, width: int = 12) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, 10), (seed * 40 % 256, 0, 0)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ROOT/CLASS/img_N.png``, as torchvision's ImageFolder and the datasets imagefolder loader read."""
    root = tmp_path_factory.mktemp("imagefolder") / "train"
    for number, name in enumerate(["red", "blue", "green"]):
        (root / name).mkdir(parents=True)
        for i in range(number + 2):
            Image.new("RGB", (8 + i, 6), (number * 80, 0, 0)).save(root / name / f"img_{i:04d}.png")
    return root


def test_a_folder_of_tar_parquet_or_arrow_shards_is_indexed_as_those_shards(tmp_path: Path) -> None:
    wds = tmp_path / "wds"
    wds.mkdir()
    for shard in range(3):
        with webdataset.TarWriter(str(wds / f"train-{shard:04d}.tar")) as sink:  # webdataset's writer, its defaults
            for i in range(4):
                sink.write({"__key__": f"s{shard}-{i}", "png": png(i), "txt": f"caption {i}"})
    (wds / "README.md").write_text("how this was made")
    tables = tmp_path / "tables"
    tables.mkdir()
    table = pa.table({"jpg": [encode_image(10, 8, "jpg", seed=i) for i in range(5)], "txt": ["a b"] * 5})
    pq.write_table(table, tables / "part-0.parquet")  # pyarrow's defaults
    with pa.OSFile(str(tables / "part-1.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert [(Path(s.url).name, s.kind) for s in expand_sources([str(wds), str(tables)])] == [
        ("train-0000.tar", "tar"),
        ("train-0001.tar", "tar"),
        ("train-0002.tar", "tar"),
        ("part-0.parquet", "parquet"),
        ("part-1.arrow", "arrow"),
    ]
    report = build_index([str(wds), str(tables)], tmp_path / "index", CONFIG, progress=False)
    assert report.ok and report.num_samples == 12 + 10 and report.shards == 5
    assert SampleIndex(report.path).manifest["modalities"] | {"samples": 0} == {
        "samples": 0,
        "text": 22,
        "image": 22,
        "video": 0,
        "audio": 0,
    }


def test_a_folder_of_shards_and_sample_files_side_by_side_is_refused_naming_both(tmp_path: Path) -> None:
    (tmp_path / "a.tar").write_bytes(b"\0" * 1024)
    (tmp_path / "cat.jpg").write_bytes(encode_image(8, 8, "jpg"))
    with pytest.raises(SourceError, match=r"holds both shard files \(a\.tar, \.\.\.\) and sample files \(cat\.jpg"):
        expand_sources([str(tmp_path)])


def test_a_folder_of_files_without_a_medium_is_refused_saying_what_was_meant(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    for name in ("train.py", "model.py", "util.py"):
        (code / name).write_text("import torch\n")
    with pytest.raises(
        SourceError,
        match=r"none of its 3 samples has an image, video, audio or text field: its files "
        r"are \.py \(3\).*or pass --allow-meta-only",
    ):
        build_index([str(code)], tmp_path / "index", CONFIG, progress=False)
    with caplog.at_level(logging.WARNING):
        report = build_index(
            [str(code)], tmp_path / "index", CONFIG.model_copy(update={"allow_meta_only": True}), progress=False
        )
    assert report.num_samples == 3 and "indexed as meta only (--allow-meta-only)" in caplog.text
    nested = tmp_path / "snapshot"
    (nested / "data").mkdir(parents=True)
    (nested / "README.md").write_text("a dataset card")
    pq.write_table(pa.table({"x": [1, 2]}), nested / "data" / "train-00000-of-00001.parquet")
    with pytest.raises(
        SourceError,
        match=rf"shard files \(data/train-00000-of-00001\.parquet\): give those as "
        rf"sources, e\.g\. omnifeed index '{nested}/data/\*\.parquet'",
    ):
        build_index([str(nested)], tmp_path / "index2", CONFIG, progress=False)


def test_an_image_folder_tree_gets_int64_labels_from_its_sorted_class_folders(
    image_folder: Path, tmp_path: Path
) -> None:
    report = build_index([str(image_folder)], tmp_path / "index", CONFIG, progress=False)
    index = SampleIndex(report.path)
    assert report.classes == index.classes == index.manifest["classes"] == CLASSES
    expected = {}
    for sample in index.samples(range(index.num_samples)):
        label = next(f for f in sample.fields if f.name == "label")
        expected[sample.key] = CLASSES.index(sample.key.split("/")[0])
        assert label.modality == "meta" and read_field(sample.shard, label) == str(expected[sample.key]).encode()
    with Feed(index, FeedConfig(plan=PlanConfig(seed=2, batch_size=index.num_samples))) as feed:
        batch = feed.next_batch()
    labels = batch["meta"]["label"]
    assert labels.dtype == torch.int64 and labels.tolist() == [expected[key] for key in batch["__key__"]]
    assert batch["image"]["pixels"].shape[0] == index.num_samples


def test_class_folders_never_always_and_layouts_that_are_not_image_folders(image_folder: Path, tmp_path: Path) -> None:
    never = build_index(
        [str(image_folder)], tmp_path / "never", CONFIG.model_copy(update={"class_folders": "never"}), progress=False
    )
    assert never.classes == [] and "label" not in {f.name for f in SampleIndex(never.path).sample(0).fields}
    webdataset_like = tmp_path / "wds-folder"  # part folders whose samples are several files: no labels
    for part in ("part-00", "part-01"):
        (webdataset_like / part).mkdir(parents=True)
        (webdataset_like / part / "s.png").write_bytes(png(1))
        (webdataset_like / part / "s.txt").write_text("a caption")
    assert build_index([str(webdataset_like)], tmp_path / "wds", CONFIG, progress=False).classes == []
    deep = tmp_path / "deep"  # torchvision's rule with 'always': the top folder, at any depth
    for path in ("cat/indoor/1.png", "cat/2.png", "dog/outdoor/3.png"):
        (deep / path).parent.mkdir(parents=True, exist_ok=True)
        (deep / path).write_bytes(png(2))
    assert build_index([str(deep)], tmp_path / "auto-deep", CONFIG, progress=False).classes == []
    always = build_index(
        [str(deep)], tmp_path / "always", CONFIG.model_copy(update={"class_folders": "always"}), progress=False
    )
    assert always.classes == ["cat", "dog"] and always.num_samples == 3


def test_two_image_folders_with_different_classes_are_refused_naming_both(image_folder: Path, tmp_path: Path) -> None:
    other = tmp_path / "val"
    for name in ("blue", "yellow"):
        (other / name).mkdir(parents=True)
        (other / name / "x.png").write_bytes(png(3))
    with pytest.raises(
        SourceError,
        match=rf"the class folders of {image_folder} and {other} differ .*not in both: "
        r"green, red, yellow",
    ):
        build_index([str(image_folder), str(other)], tmp_path / "index", CONFIG, progress=False)
    assert not (tmp_path / "index").exists() and not list(tmp_path.glob(".index.building-*"))
