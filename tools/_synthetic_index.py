"""A generated index of any size whose rows point at real bytes: 8 small JPEGs with captions, repeated.

Used by the resize and resume benchmarks: one local WebDataset tar of ``MEMBERS`` samples is
indexed once with ``build_index``; its rows are then repeated (new keys, the same members'
offsets and sizes) and written with ``write_index_from_tables``, so a 10M-row index takes
minutes to write, not a scan of 10M files, and every sample still decodes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import webdataset

from omnifeed.loader import IndexConfig, SampleIndex, build_index
from omnifeed.loader.index import ROW_SCHEMA, write_index_from_tables

from ._demo_data import encode_image

MEMBERS = 8  # distinct samples in the tar; the index cycles over them


def media_tar(work: Path) -> Path:
    """One WebDataset tar of ``MEMBERS`` small JPEGs with captions."""
    tar = work / "media.tar"
    if not tar.exists():
        partial = tar.with_suffix(".partial")
        with open(partial, "wb") as f, webdataset.TarWriter(f, encoder=False) as out:
            for i in range(MEMBERS):
                caption = f"a small procedural picture, number {i}, with a gradient and a few shapes"
                out.write(
                    {"__key__": f"m-{i:02d}", "jpg": encode_image(256, 192, "jpg", seed=i), "txt": caption.encode()}
                )
        partial.rename(tar)
    return tar


def template_rows(work: Path) -> tuple[pa.Table, Any, int]:
    """The tar's rows as the index stores them (in member order), its shard spec and its size in bytes."""
    tar = media_tar(work)
    tiny = work / "template-index"
    if not (tiny / "manifest.json").is_file():
        build_index([str(tar)], tiny, IndexConfig(workers=1), progress=False)
    index = SampleIndex(tiny)
    tables = [pa.ipc.open_file(pa.memory_map(str(p), "r")).read_all() for p in sorted(tiny.glob("part-*.arrow"))]
    rows = pa.concat_tables(tables).sort_by("shard_row").combine_chunks()
    assert rows.num_rows == MEMBERS and len(index.shards) == 1
    return rows, index.shards[0], tar.stat().st_size


def repeated_tables(template: pa.Table, rows: int, chunk: int = 50_000) -> Iterator[pa.Table]:
    """``rows`` index rows cycling over the template's members: new keys, the members' real locations."""
    rng = np.random.default_rng(0)
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        table = template.take(pa.array(np.arange(start, start + n) % template.num_rows))
        for name, values in (
            ("key", pa.array([f"sample-{i:010d}" for i in range(start, start + n)])),
            ("shard_row", pa.array(np.arange(start, start + n, dtype=np.int64))),
            ("row_digest", pa.array(rng.integers(0, 2**63, n).astype(np.uint64))),
        ):
            table = table.set_column(ROW_SCHEMA.get_field_index(name), ROW_SCHEMA.field(name), values)
        yield table


def make_index(work: Path, rows: int) -> tuple[Path, dict[str, Any]]:
    """The ``rows``-sample index under ``work`` (built once, then reused) and how it was had."""
    out = work / f"index-{rows}"
    manifest = out / "manifest.json"
    if (
        manifest.is_file()
        and json.loads(manifest.read_text())["num_samples"] == rows
        and all(Path(shard.url).is_file() for shard in SampleIndex(out).shards)
    ):  # not moved since
        return out, {"cached": True}
    template, shard, size = template_rows(work)
    started = time.perf_counter()
    write_index_from_tables(repeated_tables(template, rows), [shard], [size], out, IndexConfig(partitions=16))
    return out, {"cached": False, "build_s": round(time.perf_counter() - started, 2)}
