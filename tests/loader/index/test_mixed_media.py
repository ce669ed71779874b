"""A table column holding more than one medium (JPEG rows and FLAC rows) indexes each row as its own medium:
by a companion extension column, else by magic bytes; damaged only when a row's bytes are unreadable (issue 28)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omnifeed.loader import Feed, FeedConfig, IndexConfig, PlanConfig, SampleIndex, build_index
from omnifeed.tools._demo_data import encode_flac, encode_image

datasets = pytest.importorskip("datasets", reason="the Hugging Face datasets library writes one of the fixtures")

ROWS = 12
CONFIG = IndexConfig(workers=1, partitions=2)


def is_audio(row: int) -> bool:
    return row % 3 == 1  # a third of the rows are FLAC; the column's first cells are mostly JPEG


def columns(ext: bool) -> dict[str, list]:
    """``media`` (JPEG or FLAC bytes), ``media_ext`` (when ``ext``) and a caption."""
    media = [
        encode_flac(0.2 + 0.05 * r, 16000, 1, seed=r) if is_audio(r) else encode_image(20 + r, 10, "jpg", seed=r)
        for r in range(ROWS)
    ]
    out: dict[str, list] = {"media": media, "caption": [f"row {r}" for r in range(ROWS)]}
    if ext:
        out["media_ext"] = ["flac" if is_audio(r) else "jpg" for r in range(ROWS)]
    return out


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The mixed table written by pyarrow and by datasets, each with their defaults, with and without ``media_ext``."""
    folder = tmp_path_factory.mktemp("mixed")
    written = {}
    for ext in (True, False):
        name = "ext" if ext else "magic"
        written[f"pyarrow-{name}"] = folder / f"pyarrow-{name}.parquet"
        pq.write_table(pa.table(columns(ext)), written[f"pyarrow-{name}"])
        written[f"datasets-{name}"] = folder / f"datasets-{name}.parquet"
        datasets.Dataset.from_dict(columns(ext)).to_parquet(str(written[f"datasets-{name}"]))
    return written


@pytest.mark.parametrize("table", ["pyarrow-ext", "pyarrow-magic", "datasets-ext", "datasets-magic"])
def test_each_row_of_a_mixed_media_column_is_indexed_as_its_own_medium(
    tables: dict[str, Path], table: str, tmp_path: Path
) -> None:
    report = build_index([str(tables[table])], tmp_path / "index", CONFIG, progress=False)
    assert report.ok and report.num_samples == ROWS, report.damaged
    index = SampleIndex(report.path)
    assert index.manifest["modalities"] | {"samples": 0} == {
        "samples": 0,
        "text": ROWS,
        "image": ROWS - ROWS // 3,
        "video": 0,
        "audio": ROWS // 3,
    }
    for sample in index.samples(range(ROWS)):
        row = int(sample.key.rsplit("/", 1)[1])
        media = next(f for f in sample.fields if f.name == "media")
        assert media.modality == ("audio" if is_audio(row) else "image")
        assert sample.lengths.audio_seconds == (pytest.approx(0.2 + 0.05 * row) if is_audio(row) else 0)
        assert sample.lengths.image_width == (0 if is_audio(row) else 20 + row)


def test_the_feed_gives_the_image_rows_as_pixels_and_the_audio_rows_as_samples(
    tables: dict[str, Path], tmp_path: Path
) -> None:
    index = SampleIndex(build_index([str(tables["datasets-ext"])], tmp_path / "index", CONFIG, progress=False).path)
    seen = {"image": [], "audio": []}
    with Feed(index, FeedConfig(plan=PlanConfig(seed=1, batch_size=ROWS))) as feed:
        batch = feed.next_batch()
    rows = [int(key.rsplit("/", 1)[1]) for key in batch["__key__"]]
    for modality in seen:
        seen[modality] = sorted(rows[slot] for slot in batch[modality]["index"].tolist())
    assert seen == {
        "image": [r for r in range(ROWS) if not is_audio(r)],
        "audio": [r for r in range(ROWS) if is_audio(r)],
    }
    assert batch["audio"]["lengths"].tolist() == [
        round((0.2 + 0.05 * rows[s]) * 16000) for s in batch["audio"]["index"].tolist()
    ]


def test_only_really_unreadable_bytes_are_damage_and_a_blob_column_is_never_sniffed_cell_by_cell(
    tmp_path: Path,
) -> None:
    media = [encode_image(16, 8, "jpg", seed=r) if r % 2 else encode_flac(0.1, 8000, 1, seed=r) for r in range(6)]
    media[3] = media[3][:40]  # a JPEG cut inside its header: unreadable as what it is
    blobs = [bytes([r]) * 32 for r in range(6)]
    blobs[2] = b"ID3" + bytes(29)  # random bytes that happen to begin like an MP3: a blob column stays meta
    pq.write_table(pa.table({"media": media, "blob": blobs}), tmp_path / "t.parquet")
    report = build_index([str(tmp_path / "t.parquet")], tmp_path / "index", CONFIG, progress=False)
    assert [(d["key"], d["reason"]) for d in report.damaged] == [("t/3", "header")]
    assert "unreadable image header" in report.damaged[0]["error"]
    index = SampleIndex(report.path)
    kinds = {s.key: {f.name: f.modality for f in s.fields} for s in index.samples(range(index.num_samples))}
    assert kinds == {f"t/{r}": {"media": "image" if r % 2 else "audio", "blob": "meta"} for r in (0, 1, 2, 4, 5)}


def test_a_companion_format_column_names_each_cells_medium_by_extension_or_mime_type(tmp_path: Path) -> None:
    media = [encode_image(16, 8, "png", seed=0), encode_flac(0.1, 8000, 1, seed=1), encode_image(12, 8, "png", seed=2)]
    table = pa.table({"payload": media, "format": ["image/png", "flac", "png"], "__key__": ["a", "b", "c"]})
    pq.write_table(table, tmp_path / "t.parquet")
    index = SampleIndex(build_index([str(tmp_path / "t.parquet")], tmp_path / "index", CONFIG, progress=False).path)
    modality = {s.key: next(f.modality for f in s.fields if f.name == "payload") for s in index.samples(range(3))}
    assert modality == {"a": "image", "b": "audio", "c": "image"}
    forced = IndexConfig(workers=1, modalities={"flac": "meta"})  # an extension mapped by the user wins
    scan = SampleIndex(build_index([str(tmp_path / "t.parquet")], tmp_path / "forced", forced, progress=False).path)
    assert {s.key: next(f.modality for f in s.fields if f.name == "payload") for s in scan.samples(range(3))} == {
        "a": "image",
        "b": "meta",
        "c": "image",
    }
