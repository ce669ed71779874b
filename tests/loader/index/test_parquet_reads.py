"""Parquet and Arrow cells read back by page, with files as pyarrow and datasets write them by default (issue 28):
every cell comes back as written, a cell read touches its page and not its column chunk, neighbouring cells
share one decode, a file replaced under its path is read again, and the decompression bound holds per page."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omnifeed.loader import IndexConfig, SampleIndex, build_index
from omnifeed.loader._errors import SourceError
from omnifeed.loader.index import _parquet_pages
from omnifeed.loader.index._arrow_files import read_arrow_cell
from omnifeed.loader.index._columns import cell_bytes
from omnifeed.loader.index._open_files import SOURCE_FILES, OpenFiles
from omnifeed.loader.index._parquet_cells import ParquetCells
from omnifeed.loader.index._parquet_direct import SnappyIndex, Unsupported
from omnifeed.loader.index._parquet_pages import read_pages
from omnifeed.loader.index._records import FieldLocation
from omnifeed.loader.index._sources import read_field

datasets = pytest.importorskip("datasets", reason="the Hugging Face datasets library writes these fixtures")
datasets.disable_progress_bars()

ROWS = 1100  # pyarrow keeps the first 1,024 values of a column in its dictionary page, then falls back to plain pages


def _blobs(count: int, size: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(count)]


def _columns() -> dict[str, list]:
    header = _blobs(1, 600, 9)[0]  # shared by every cell, as JPEG headers are: Snappy copies it from the cell before
    jpg: list[bytes | None] = [header + blob for blob in _blobs(ROWS, 1448, 0)]
    for row in range(5, ROWS, 97):
        jpg[row] = None
    return {"jpg": jpg, "cls": [i % 7 for i in range(ROWS)], "txt": [f"caption {i} " * (i % 5) for i in range(ROWS)]}


@pytest.fixture(scope="module")
def pyarrow_default(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pq.write_table`` defaults: one row group; ``jpg`` is a 2 MB dictionary page, an index page and a plain page."""
    path = tmp_path_factory.mktemp("pyarrow") / "train.parquet"
    pq.write_table(pa.table(_columns()), path)
    return path


def _hf_dataset(rows: int) -> datasets.Dataset:
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.Value("int64"), "text": datasets.Value("string")}
    )
    images = [{"bytes": b, "path": None} for b in _blobs(rows, 40_000, 1)]
    return datasets.Dataset.from_dict(
        {"image": images, "label": list(range(rows)), "text": [f"row {i}" for i in range(rows)]}, features=features
    )


@pytest.fixture(scope="module")
def datasets_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``Dataset.to_parquet`` defaults: images uncompressed and PLAIN in content-defined pages of 256 KB-1 MB."""
    path = tmp_path_factory.mktemp("hf") / "train-00000-of-00001.parquet"
    _hf_dataset(80).to_parquet(str(path))
    return path


def _every_cell(path: Path) -> dict[tuple[str, int, int], bytes | None]:
    """(column, row group, row) -> the cell's field bytes, as Arrow reads the whole file."""
    table_file = pq.ParquetFile(path)
    out = {}
    for group in range(table_file.num_row_groups):
        table = table_file.read_row_group(group)
        for name in table.column_names:
            for row, value in enumerate(cell_bytes(table.column(name))):
                out[(name, group, row)] = value
    return out


def _chunk_bytes(path: Path, column: int) -> int:
    return pq.ParquetFile(path).metadata.row_group(0).column(column).total_compressed_size


def test_every_cell_of_a_pyarrow_default_file_reads_back_as_written(pyarrow_default: Path) -> None:
    chunk = pq.ParquetFile(pyarrow_default).metadata.row_group(0).column(0)
    with open(pyarrow_default, "rb") as f:

        def read(offset: int, size: int) -> bytes:
            f.seek(offset)
            return f.read(size)

        pages = read_pages(
            read,
            chunk.dictionary_page_offset,
            chunk.dictionary_page_offset + chunk.total_compressed_size,
            pyarrow_default.stat().st_size,
        )
    assert [p.kind for p in pages] == [2, 0, 0] and pages[0].values > 1000  # the layout this test is about
    reader = ParquetCells(OpenFiles())
    for (column, group, row), value in _every_cell(pyarrow_default).items():
        assert reader.cell(str(pyarrow_default), column, group, row) == value, (column, row)
    assert reader.stats()["files_opened"] == 1


def test_every_cell_of_a_datasets_parquet_file_reads_back_as_written(datasets_parquet: Path) -> None:
    reader = ParquetCells(OpenFiles())
    cells = _every_cell(datasets_parquet)
    assert {key[0] for key in cells} == {"image", "label", "text"}
    for (column, group, row), value in cells.items():
        assert reader.cell(str(datasets_parquet), column, group, row) == value, (column, row)


def test_a_cell_read_touches_its_page_not_its_column_chunk(datasets_parquet: Path, pyarrow_default: Path) -> None:
    reader = ParquetCells(OpenFiles())
    assert reader.cell(str(datasets_parquet), "image", 0, 41) is not None
    read = reader.stats()["bytes_read"]
    assert read < _chunk_bytes(datasets_parquet, 0) / 3  # 3.2 MB of images: one ~1 MB page, the footer, headers
    assert read < 1.5 * 2**20
    reader = ParquetCells(OpenFiles())
    assert reader.cell(str(pyarrow_default), "jpg", 0, ROWS - 1) is not None  # a plain page: not the dictionary
    assert reader.stats()["bytes_read"] < 0.15 * _chunk_bytes(pyarrow_default, 0)  # the page is 7 %


def test_neighbouring_cells_share_one_decoded_page(datasets_parquet: Path) -> None:
    reader = ParquetCells(OpenFiles())
    for row in range(6):
        reader.cell(str(datasets_parquet), "image", 0, row)
    stats = reader.stats()
    assert (stats["pages_decoded"], stats["page_hits"]) == (1, 5)


def test_a_second_cell_of_a_page_reads_its_own_bytes_and_little_else(
    pyarrow_default: Path, datasets_parquet: Path
) -> None:
    for path, column in ((pyarrow_default, "jpg"), (datasets_parquet, "image")):
        reader = ParquetCells(OpenFiles())
        reader.cell(str(path), column, 0, 1)  # finds the file's footer, the chunk's pages, the page's values
        before = reader.stats()
        cell = reader.cell(str(path), column, 0, 4)  # the same page: datasets cuts pages of 256 KB-1 MB
        assert cell is not None
        after = reader.stats()
        assert len(cell) <= after["bytes_read"] - before["bytes_read"] <= len(cell) + 1024, path
        assert after["pages_decoded"] == before["pages_decoded"]  # the page's value positions, found once


def test_a_large_zstd_dictionary_is_decoded_once_and_kept_apart_from_its_pages(tmp_path: Path) -> None:
    # zstd (unlike pyarrow's default Snappy) cannot be read from the middle of a page: Arrow decodes it
    path = tmp_path / "zstd.parquet"
    pq.write_table(pa.table(_columns()), path, compression="zstd")
    reader = ParquetCells(OpenFiles())
    cells = _every_cell(path)
    for row in (0, 500, 1023, 1050):
        assert reader.cell(str(path), "jpg", 0, row) == cells[("jpg", 0, row)]
    stats = reader.stats()
    assert stats["pages_decoded"] == 3  # the dictionary's values, the page of indices, the plain page
    assert 1.9e6 < stats["cached_bytes"] < 2.5e6  # the 2 MB of values counted once


def test_row_groups_pages_versions_nulls_and_nested_columns_read_back(tmp_path: Path) -> None:
    # Small data never fills a default page or row group: row_group_size, data_page_size, the dictionary
    # page limit and write_batch_size (pyarrow cuts pages between batches of that many values) are set
    # here so that this test sees many row groups and pages; every other test uses the writers' defaults.
    rows = 300
    blobs: list[bytes | None] = list(_blobs(rows, 300, 2))
    for i in range(0, rows, 7):
        blobs[i] = None
    table = pa.table(
        {
            "blob": blobs,
            "n": [None if i % 5 == 0 else i for i in range(rows)],
            "tags": [[f"t{j}" for j in range(i % 4)] for i in range(rows)],
            "box": [{"x": i, "y": -i} for i in range(rows)],
            "image": [{"bytes": b, "path": None} for b in _blobs(rows, 200, 3)],
        }
    )
    for options in ({}, {"data_page_version": "2.0", "compression": "zstd"}, {"use_dictionary": False}):
        path = tmp_path / "small-pages.parquet"
        pq.write_table(
            table,
            path,
            row_group_size=128,
            data_page_size=1024,
            dictionary_pagesize_limit=2048,
            write_batch_size=16,
            **options,
        )
        assert pq.ParquetFile(path).num_row_groups == 3
        reader = ParquetCells(OpenFiles())
        for (column, group, row), value in _every_cell(path).items():
            assert reader.cell(str(path), column, group, row) == value, (options, column, group, row)
        assert reader.stats()["pages_decoded"] > 30
        assert reader.cell(str(path), "blob", 3, 0) is None and reader.cell(str(path), "nope", 0, 0) is None


def test_a_file_replaced_under_its_path_is_read_again_never_from_what_was_kept(tmp_path: Path) -> None:
    path = tmp_path / "swap.parquet"
    before, after = _blobs(50, 1000, 4), _blobs(50, 1000, 5)
    pq.write_table(pa.table({"jpg": before}), path)
    reader = ParquetCells(OpenFiles())
    assert reader.cell(str(path), "jpg", 0, 3) == before[3]
    pq.write_table(pa.table({"jpg": after}), tmp_path / "new.parquet")
    os.replace(tmp_path / "new.parquet", path)  # another inode at the same path
    assert reader.cell(str(path), "jpg", 0, 3) == after[3]
    with open(path, "r+b") as f:  # the same inode rewritten in place: its size and mtime change
        f.truncate(0)
        pq.write_table(pa.table({"jpg": before[:10]}), f)
    assert reader.cell(str(path), "jpg", 0, 3) == before[3]
    assert reader.cell(str(path), "jpg", 0, 20) is None  # gone: read_field names the file and says to re-index
    assert reader.stats()["files_opened"] == 3


def test_read_field_of_an_indexed_file_replaced_by_another_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"__key__": [f"k{i}" for i in range(20)], "payload": _blobs(20, 500, 6)}), path)
    index = SampleIndex(
        build_index([str(path)], tmp_path / "index", IndexConfig(workers=1, partitions=1), progress=False).path
    )
    sample = index.sample(0)
    field = sample.fields[0]
    assert len(read_field(sample.shard, field, row_group=sample.row_group, row=sample.row)) == 500
    pq.write_table(pa.table({"__key__": ["k0"], "payload": [b"short"]}), path)
    with pytest.raises(SourceError, match="truncated or changed.*re-run `omnifeed index`"):
        read_field(sample.shard, field, row_group=sample.row_group, row=sample.row)


@pytest.mark.parametrize("dictionary", [True, False])
def test_the_decompression_bound_holds_for_one_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dictionary: bool
) -> None:
    path = tmp_path / "zeros.parquet"
    pq.write_table(pa.table({"blob": [b"ok", bytes(8 * 2**20)]}), path, compression="zstd", use_dictionary=dictionary)
    monkeypatch.setattr(_parquet_pages, "MAX_EXCESS", 2**20)  # 8 MiB of zeros is ~800x: a bomb under a 1 MiB bound
    with pytest.raises(SourceError, match=rf"{path}: row group 0 column 'blob': .* refused as a decompression bomb"):
        ParquetCells(OpenFiles()).cell(str(path), "blob", 0, 0)
    monkeypatch.undo()
    assert ParquetCells(OpenFiles()).cell(str(path), "blob", 0, 1) == bytes(8 * 2**20)


def test_every_cell_of_a_saved_dataset_reads_back_and_the_file_stays_mapped(tmp_path: Path) -> None:
    folder = tmp_path / "saved"
    _hf_dataset(30).save_to_disk(str(folder))
    config = IndexConfig(workers=1, partitions=1, modalities={"image": "meta"})  # random bytes, not images
    index = SampleIndex(build_index([str(folder)], tmp_path / "index", config, progress=False).path)
    truth = _hf_dataset(30).with_format("arrow")[:]
    images = cell_bytes(truth.column("image"))
    before = SOURCE_FILES.bytes_read
    for sample in index.samples(range(len(index))):
        row = int(sample.key.rsplit("/", 1)[1])
        image = next(f for f in sample.fields if f.name == "image")
        assert read_field(sample.shard, image, row_group=sample.row_group, row=sample.row) == images[row]
    assert SOURCE_FILES.bytes_read - before == sum(map(len, images))  # each cell read on its own, nothing else
    arrow_file = index.sample(0).shard.url
    renamed = tmp_path / "moved.arrow"
    os.replace(arrow_file, renamed)  # the path now names nothing: never served from the kept mapping
    image = next(f for f in index.sample(0).fields if f.name == "image")
    with pytest.raises(FileNotFoundError):
        read_arrow_cell(arrow_file, image, index.sample(0).row)


def test_a_remote_parquet_file_is_read_by_ranges_and_checked_by_its_info(pyarrow_default: Path) -> None:
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe("/issue28/train.parquet", pyarrow_default.read_bytes())
    reader = ParquetCells(OpenFiles())
    cells = _every_cell(pyarrow_default)
    url = "memory://issue28/train.parquet"
    for row in (0, 700, ROWS - 1):
        assert reader.cell(url, "jpg", 0, row) == cells[("jpg", 0, row)]
    assert reader.stats()["bytes_read"] < 1.2 * pyarrow_default.stat().st_size
    memory.pipe("/issue28/train.parquet", b"")  # replaced by an empty file
    with pytest.raises(SourceError, match="not a Parquet file"):
        reader.cell(url, "jpg", 0, 0)
    memory.rm("/issue28", recursive=True)


def test_read_field_without_a_location_is_refused() -> None:
    with pytest.raises(ValueError, match="needs its batch offset"):
        read_arrow_cell("x.arrow", FieldLocation("a", "meta", "a", -1, 1), 0)


@pytest.mark.parametrize("kind", ["random", "repeated", "runs"])
def test_any_range_of_a_snappy_stream_reads_back_from_its_literals_and_copies(kind: str) -> None:
    rng = random.Random(7)
    if kind == "random":
        data = rng.randbytes(300_000)
    elif kind == "repeated":  # copies of earlier cells' first bytes, as JPEG headers are
        data = b"".join(_blobs(1, 700, 8)[0] + rng.randbytes(rng.randrange(1, 3000)) for _ in range(150))
    else:  # copies overlapping themselves: a period shorter than the copy
        data = b"".join(bytes([i % 251]) * rng.randrange(1, 200) + b"ab" * rng.randrange(1, 40) for i in range(2000))
    packed = pa.compress(data, codec="snappy", asbytes=True)

    def read(offset: int, size: int) -> bytes:
        return packed[offset : offset + size]

    try:
        stream = SnappyIndex(read, 0, len(packed), len(data))
    except Unsupported:  # too intricate to be worth it: Arrow decodes such a page
        assert kind == "runs"
        return
    assert kind != "random" or len(stream.starts) < len(data) / 1000  # about a literal per 64 KB
    for _ in range(300):
        start = rng.randrange(len(data))
        end = min(len(data), start + rng.randrange(1, 5000))
        try:
            assert stream.read_range(read, start, end) == data[start:end], (start, end)
        except Unsupported:  # copies of copies past MAX_DEPTH: Arrow decodes such a page
            assert kind == "runs"


@pytest.mark.parametrize("compression", ["snappy", "zstd"])
def test_a_value_repeated_by_its_dictionary_is_read_without_expanding_the_page(
    tmp_path: Path, compression: str
) -> None:
    path = tmp_path / "repeated.parquet"  # 300 rows of one 300 KB value, stored once: 90 MB expanded
    value = _blobs(1, 300_000, 10)[0]
    pq.write_table(pa.table({"blob": [value] * 300}), path, compression=compression)
    assert path.stat().st_size < 400_000
    reader = ParquetCells(OpenFiles())
    assert reader.cell(str(path), "blob", 0, 299) == value
    assert reader.stats()["cached_bytes"] < 2**20  # the value once and the page's indices, not 300 copies


@pytest.mark.timeout(60)  # opening the FIFO for reading would wait for a writer
def test_a_fifo_swapped_in_for_a_parquet_file_is_refused_without_blocking(
    pyarrow_default: Path, tmp_path: Path
) -> None:
    path = tmp_path / "swapped.parquet"
    path.write_bytes(pyarrow_default.read_bytes())
    reader = ParquetCells(OpenFiles())
    assert reader.cell(str(path), "cls", 0, 3) == b"3"
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(SourceError, match="not a regular file"):
        reader.cell(str(path), "cls", 0, 3)


def test_snappy_pages_that_compress_well_are_left_to_arrow_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "compressible.parquet"  # copies of copies: read in place they would cost more than a decode
    values = [(b"abc%d" % (i % 10)) * (1000 + i) for i in range(200)]
    pq.write_table(pa.table({"blob": values}), path)
    reader = ParquetCells(OpenFiles())
    for row in (0, 77, 199, 5):
        assert reader.cell(str(path), "blob", 0, row) == values[row]
    assert reader.stats()["pages_decoded"] <= 4  # tried in place once, then one Arrow decode served the rest
