"""Hugging Face datasets, no configuration: Parquet from ``Dataset.to_parquet`` and the Arrow folder from
``Dataset.save_to_disk``, written by the real ``datasets`` library, index and feed as they are (issue 18, item 1)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image as PILImage

from omnifeed.loader import Feed, FeedConfig, IndexConfig, PlanConfig, SampleIndex, build_index
from omnifeed.loader._errors import SourceError
from omnifeed.loader.index._records import ShardSpec
from omnifeed.loader.index._scan import scan_shard
from omnifeed.loader.index._sources import expand_sources, read_field
from omnifeed.tools._cli import main
from omnifeed.tools._demo_data import encode_flac, encode_image

datasets = pytest.importorskip("datasets", reason="the Hugging Face datasets library writes these fixtures")

ROWS = 6
CLASSES = ["cat", "dog", "bird"]
PLAIN = IndexConfig(workers=1, partitions=2)


def _dataset() -> datasets.Dataset:
    """Images (PIL → ``Image()``), labels (``ClassLabel``), text, a speaker name and FLAC audio (``Audio``)."""
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=CLASSES),
            "text": datasets.Value("string"),
            "speaker": datasets.Value("string"),
        }
    )
    images = [
        PILImage.open(io.BytesIO(encode_image(40 + i, 30, "png" if i % 2 else "jpg", seed=i))) for i in range(ROWS)
    ]
    ds = datasets.Dataset.from_dict(
        {
            "image": images,
            "label": [i % 3 for i in range(ROWS)],
            "text": [f"a photo number {i}" for i in range(ROWS)],
            "speaker": [f"spk{i}" for i in range(ROWS)],
        },
        features=features,
    )
    # Audio(decode=False) over {bytes, path} dicts: encoding with Audio() itself needs torchcodec
    clips = [{"bytes": encode_flac(0.25 + 0.05 * i, 16000, 1, seed=i), "path": None} for i in range(ROWS)]
    return ds.add_column("audio", clips).cast_column("audio", datasets.Audio(decode=False))


@pytest.fixture(scope="module")
def hf_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "train-00000-of-00001.parquet"
    _dataset().to_parquet(str(path))
    return path


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf-saved") / "train"
    _dataset().save_to_disk(str(folder), num_shards=2)
    return folder


def _one_epoch(index: SampleIndex) -> list[dict]:
    batches = []
    with Feed(index, FeedConfig(plan=PlanConfig(seed=3, batch_size=3))) as feed:
        for _ in range(ROWS // 3):
            batches.append(feed.next_batch())
    return batches


def _check_batches(batches: list[dict], stem_of_row: dict[str, int]) -> None:
    """Images decoded, labels an int64 tensor, text as text, audio decoded, a string column as str; per key."""
    seen = []
    for batch in batches:
        rows = [stem_of_row[key] for key in batch["__key__"]]
        seen += rows
        assert batch["image"]["pixels"].dtype == torch.uint8 and batch["image"]["pixels"].shape[:2] == (3, 3)
        assert batch["meta"]["label"].dtype == torch.int64 and batch["meta"]["label"].tolist() == [r % 3 for r in rows]
        assert batch["text"]["strings"] == [f"a photo number {r}" for r in rows]
        assert batch["meta"]["speaker"] == [f"spk{r}" for r in rows]
        audio = batch["audio"]
        assert audio["samples"].dtype == torch.float32 and audio["samples"].shape[:2] == (3, 1)
        assert audio["lengths"].tolist() == [round((0.25 + 0.05 * r) * 16000) for r in rows]
        assert float(audio["samples"].abs().sum()) > 0
    assert sorted(seen) == list(range(ROWS))


def test_parquet_written_by_datasets_indexes_and_feeds_without_a_config(hf_parquet: Path, tmp_path: Path) -> None:
    report = build_index([str(hf_parquet)], tmp_path / "index", PLAIN, progress=False)
    assert report.ok and report.num_samples == ROWS
    index = SampleIndex(report.path)
    keys = sorted(index.keys(range(ROWS)))
    assert keys == sorted(f"train-00000-of-00001/{r}" for r in range(ROWS)), "keys: <file stem>/<row>"
    modalities = {f.name: f.modality for f in index.sample(0).fields}
    assert modalities == {"image": "image", "audio": "audio", "label": "meta", "text": "text", "speaker": "meta"}
    assert index.manifest["modalities"] == {"samples": ROWS, "text": ROWS, "image": ROWS, "video": 0, "audio": ROWS}
    _check_batches(_one_epoch(index), {f"train-00000-of-00001/{r}": r for r in range(ROWS)})


def test_a_saved_dataset_folder_is_its_arrow_files_in_order_and_feeds_without_a_config(
    hf_saved: Path, tmp_path: Path
) -> None:
    shards = expand_sources([str(hf_saved)])
    assert [(Path(s.url).name, s.kind) for s in shards] == [
        ("data-00000-of-00002.arrow", "arrow"),
        ("data-00001-of-00002.arrow", "arrow"),
    ]
    report = build_index([str(hf_saved)], tmp_path / "index", PLAIN, progress=False)
    assert report.ok and report.num_samples == ROWS
    index = SampleIndex(report.path)
    half = ROWS // 2
    rows = {f"data-0000{r // half}-of-00002/{r % half}": r for r in range(ROWS)}
    assert sorted(index.keys(range(ROWS))) == sorted(rows)
    _check_batches(_one_epoch(index), rows)


@pytest.mark.parametrize("source", ["hf_parquet", "hf_saved"])
def test_a_struct_cell_reads_back_as_its_media_bytes(source: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(source)
    shard = expand_sources([str(path)])[0]
    scan = scan_shard(shard, PLAIN)
    table = pq.read_table(path) if shard.kind == "parquet" else pa.ipc.open_stream(shard.url).read_all()
    for sample in scan.samples:
        field = next(f for f in sample.fields if f.name == "image")
        data = read_field(shard, field, row_group=sample.row_group, row=sample.row)
        row = int(sample.key.rsplit("/", 1)[1])
        assert data == table.column("image")[row]["bytes"].as_py()
        assert PILImage.open(io.BytesIO(data)).size == (40 + row, 30)  # the first file: rows 0.. of the dataset


def test_the_cli_indexes_datasets_parquet_with_no_config_and_takes_a_key_column(
    hf_parquet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["index", str(hf_parquet), "--out", str(tmp_path / "a"), "--workers", "1", "--no-progress", "--json"]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"] == ROWS and summary["errors"] == summary["damaged"] == 0
    assert (
        main(
            [
                "index",
                str(hf_parquet),
                "--out",
                str(tmp_path / "b"),
                "--key-column",
                "speaker",
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    index = SampleIndex(tmp_path / "b")
    assert sorted(index.keys(range(ROWS))) == [f"spk{r}" for r in range(ROWS)]
    assert "speaker" not in {f.name for f in index.sample(0).fields}
    assert (
        main(
            [
                "index",
                str(hf_parquet),
                "--out",
                str(tmp_path / "c"),
                "--key-column",
                "nope",
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 1
    )
    assert "no key column 'nope'" in capsys.readouterr().err


def test_media_columns_without_metadata_or_telling_names_are_sniffed_by_content(tmp_path: Path) -> None:
    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(
        pa.table(
            {
                "payload": pa.array([encode_image(20, 10, "png", seed=i) for i in range(3)], pa.binary()),
                "clip": pa.array([{"bytes": encode_flac(0.1, 8000, 1, seed=i), "path": None} for i in range(3)], media),
                "blob": pa.array([b"\x00\x01", None, b"\x02"], pa.binary()),
                "sentence": ["one", "two", "three"],
                "note": ["x", "y", "z"],
                "mask": pa.array([encode_image(20, 10, "png", seed=9)] * 3, pa.binary()),
            }
        ),
        tmp_path / "plain.parquet",
    )
    scan = scan_shard(ShardSpec(str(tmp_path / "plain.parquet"), "parquet"), PLAIN)
    assert {f.name: f.modality for f in scan.samples[0].fields} == {  # a second image column stays meta
        "payload": "image",
        "clip": "audio",
        "blob": "meta",
        "sentence": "text",
        "note": "meta",
        "mask": "meta",
    }
    assert scan.samples[0].lengths.image_width == 20 and scan.samples[0].lengths.audio_sample_rate == 8000
    forced = scan_shard(
        ShardSpec(str(tmp_path / "plain.parquet"), "parquet"),
        IndexConfig(modalities={"payload": "meta", "note": "text"}),
    )
    assert {f.name: f.modality for f in forced.samples[0].fields}["payload"] == "meta"
    assert {f.name: f.modality for f in forced.samples[0].fields}["note"] == "text"


@pytest.mark.parametrize("file_format", [False, True])
def test_arrow_files_of_several_batches_read_back_every_cell(tmp_path: Path, file_format: bool) -> None:
    table = pa.table(
        {
            "__key__": [f"k{i}" for i in range(7)],
            "jpg": [encode_image(10 + i, 8, "jpg") for i in range(7)],
            "cls": list(range(7)),
        }
    )
    path = tmp_path / "x.arrow"
    with pa.OSFile(str(path), "wb") as sink:
        writer = (pa.ipc.new_file if file_format else pa.ipc.new_stream)(sink, table.schema)
        writer.write_table(table, max_chunksize=3)
        writer.close()
    shard = expand_sources([str(path)])[0]
    scan = scan_shard(shard, PLAIN)
    assert [(s.key, s.row_group, s.row) for s in scan.samples] == [(f"k{i}", i // 3, i % 3) for i in range(7)]
    for i, sample in enumerate(scan.samples):
        jpg, cls = sample.fields[1], sample.fields[0]
        assert read_field(shard, jpg, row_group=sample.row_group, row=sample.row) == table["jpg"][i].as_py()
        assert read_field(shard, cls, row_group=sample.row_group, row=sample.row) == str(i).encode()


def test_a_dataset_dict_folder_is_refused_naming_its_splits(tmp_path: Path) -> None:
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": ["a"]}), "test": datasets.Dataset.from_dict({"text": ["b"]})}
    ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SourceError, match=r"a DatasetDict saved by datasets; index one split's folder at a time"):
        expand_sources([str(tmp_path / "dd")])
    assert [s.kind for s in expand_sources([str(tmp_path / "dd" / "train")])] == ["arrow"]
