"""`omnifeed precache` over a Parquet source reads each partition in file order, page after page, so a page
is decoded once per partition rather than once per cell (issue 28)."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omnifeed.cache import NvmeTier, NvmeTierConfig, RemoteTierConfig
from omnifeed.loader import IndexConfig, SampleIndex, build_index
from omnifeed.loader.index._parquet_cells import parquet_reader
from omnifeed.tools._precache import PrecacheJob, _PartitionTask
from omnifeed.tools._precache_run import precache_local

ROWS, PER_PAGE, PARTITIONS = 400, 8, 4


@pytest.fixture
def zstd_pages(tmp_path: Path) -> tuple[SampleIndex, list[bytes]]:
    # zstd pages cannot be read from the middle (pyarrow's default Snappy and datasets' uncompressed media
    # can): Arrow decodes each such page whole. Small pages (write_batch_size, data_page_size) so that
    # small data has many of them: PER_PAGE rows each.
    rng = random.Random(3)
    payloads = [rng.randbytes(2000) for _ in range(ROWS)]
    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.table({"payload": payloads}),
        path,
        compression="zstd",
        use_dictionary=False,
        data_page_size=1024,
        write_batch_size=PER_PAGE,
    )
    config = IndexConfig(workers=1, partitions=PARTITIONS, modalities={"payload": "meta"})
    build_index([str(path)], tmp_path / "index", config, progress=False)
    return SampleIndex(tmp_path / "index"), payloads


def test_a_partition_is_read_in_file_order(zstd_pages: tuple[SampleIndex, list[bytes]], tmp_path: Path) -> None:
    index, _ = zstd_pages
    job = PrecacheJob(str(index.path), NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=2**26))
    for partition in range(PARTITIONS):
        task = _PartitionTask(job, partition)
        try:
            rows = [s.row for s in index.samples(task._in_shard_order())]
        finally:
            task.close()
        assert rows == sorted(rows) and len(rows) == task.stop - task.start


def test_precache_decodes_each_page_once(
    zstd_pages: tuple[SampleIndex, list[bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, payloads = zstd_pages
    one = SampleIndex(
        build_index(
            [str(tmp_path / "train.parquet")],
            tmp_path / "one",
            IndexConfig(workers=1, partitions=1, modalities={"payload": "meta"}),
            progress=False,
        ).path
    )  # every row in one task
    reader = parquet_reader()
    reader.pages.clear()
    monkeypatch.setattr(reader.pages, "max_bytes", 3 * PER_PAGE * 2048 // 2)  # room for one page and a half
    before = reader.stats()["pages_decoded"]
    job = PrecacheJob(
        str(one.path),
        NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=2**26),
        remote=RemoteTierConfig(io_threads=1),
    )
    report = precache_local(job, [0], workers=1, progress=False)
    assert (report.counts.cached, report.counts.failed) == (ROWS, 0)
    assert reader.stats()["pages_decoded"] - before == ROWS // PER_PAGE  # in key order: 111
    with NvmeTier(job.nvme) as tier:
        held = sorted(tier.get(key) or b"" for key in tier.keys())
    assert held == sorted(payloads)
