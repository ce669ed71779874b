"""The sample index on disk, opened memory-mapped: keys, locations and lengths by position.

Layout of an index directory (written by ``build_index``)::

    manifest.json          counts, fingerprint, length statistics, partitions
    part-00000.parquet     rows of partition 0, sorted by key (the interchange copy)
    part-00000.arrow       the same rows as uncompressed Arrow IPC (the memory-mapped copy)
    shards.parquet         shard id -> URL, kind, bytes, samples
    by_shard.npy           positions ordered by (shard, order within shard)

A sample's *position* is its row number in the concatenation of the partitions
in order. Opening maps the Arrow files and the ``by_shard`` array; pages are read
on touch and shared between every process on the node through the page cache, so
opening costs the same few megabytes for ten samples or ten million.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ._errors import IndexFormatError
from ._records import FieldLocation, SampleLengths, ShardSpec

INDEX_FORMAT = "omnifeed.index/1"
MANIFEST = "manifest.json"
SHARDS = "shards.parquet"
BY_SHARD = "by_shard.npy"

LENGTH_COLUMNS: dict[str, pa.DataType] = {
    "text_tokens": pa.int32(),
    "image_width": pa.int32(),
    "image_height": pa.int32(),
    "video_frames": pa.int32(),
    "video_fps": pa.float32(),
    "video_width": pa.int32(),
    "video_height": pa.int32(),
    "audio_seconds": pa.float32(),
    "audio_sample_rate": pa.int32(),
}
FIELD_TYPE = pa.struct(
    [("name", pa.string()), ("modality", pa.string()), ("member", pa.string()), ("offset", pa.int64()), ("size", pa.int64())]
)
ROW_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("shard", pa.int32()),
        ("shard_row", pa.int64()),
        ("row_group", pa.int32()),
        ("row", pa.int64()),
        ("fields", pa.list_(FIELD_TYPE)),
        *LENGTH_COLUMNS.items(),
        ("row_digest", pa.uint64()),
    ]
)


@dataclass(frozen=True)
class IndexedSample:
    """One row of the index: where a sample's fields are and how long each modality is."""

    position: int
    key: str
    shard: ShardSpec
    fields: tuple[FieldLocation, ...]
    lengths: SampleLengths
    row_group: int
    row: int


def partition_file(partition: int, suffix: str) -> str:
    """File name of a partition (``suffix`` is ``parquet`` or ``arrow``)."""
    return f"part-{partition:05d}.{suffix}"


class SampleIndex:
    """A read-only, memory-mapped view of an index directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise IndexFormatError(f"{self.path}: no {MANIFEST}; is this an omnifeed index? Build one with `omnifeed index`.")
        try:
            self.manifest: dict[str, Any] = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise IndexFormatError(f"{manifest_path}: unreadable manifest ({exc}); rebuild the index") from exc
        if self.manifest.get("format") != INDEX_FORMAT:
            raise IndexFormatError(
                f"{manifest_path}: format {self.manifest.get('format')!r}, expected {INDEX_FORMAT!r}; rebuild the index"
            )
        self.num_samples: int = int(self.manifest["num_samples"])
        self.fingerprint: str = str(self.manifest["fingerprint"])
        self._rows = self._map_partitions()
        self._chunk_starts = np.cumsum([0] + [len(c) for c in self._rows["key"].chunks], dtype=np.int64)
        shards = pq.read_table(self.path / SHARDS)
        self.shards: list[ShardSpec] = [
            ShardSpec(url=u, kind=k) for u, k in zip(shards["url"].to_pylist(), shards["kind"].to_pylist())
        ]
        self.shard_sizes = np.asarray(shards["num_samples"], dtype=np.int64)
        self.by_shard: np.ndarray = np.load(self.path / BY_SHARD, mmap_mode="r")

    def _map_partitions(self) -> pa.Table:
        tables = []
        for part in self.manifest["partitions"]:
            arrow_path = self.path / part["file"].replace(".parquet", ".arrow")
            if not arrow_path.is_file():
                _write_arrow_copy(self.path / part["file"], arrow_path)
            table = pa.ipc.open_file(pa.memory_map(str(arrow_path), "r")).read_all()
            if table.num_rows != part["rows"]:
                raise IndexFormatError(f"{arrow_path}: {table.num_rows} rows, manifest says {part['rows']}; rebuild the index")
            tables.append(table)
        if not tables:
            return ROW_SCHEMA.empty_table()
        return pa.concat_tables(tables)

    def __len__(self) -> int:
        return self.num_samples

    def keys(self, positions: np.ndarray | list[int]) -> list[str]:
        """Sample keys at the given positions, in that order."""
        return self._take("key", positions).to_pylist()

    def length_columns(self, positions: np.ndarray | list[int]) -> dict[str, np.ndarray]:
        """The per-modality length columns at ``positions`` (read from the mapped rows, nothing else)."""
        return {name: self._take(name, positions).to_numpy(zero_copy_only=False) for name in LENGTH_COLUMNS}

    def _take(self, name: str, positions: np.ndarray | list[int]) -> pa.Array:
        """One column at ``positions``, chunk by chunk: ``ChunkedArray.take`` would first copy the
        whole mapped column into memory."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
            raise IndexError(f"positions outside the index's {self.num_samples} samples")
        column = self._rows[name]
        chunk_of = np.searchsorted(self._chunk_starts, positions, side="right") - 1
        pieces, placed = [], []
        for chunk in np.unique(chunk_of):
            where = np.flatnonzero(chunk_of == chunk)
            pieces.append(column.chunk(int(chunk)).take(pa.array(positions[where] - self._chunk_starts[chunk])))
            placed.append(where)
        if not pieces:
            return pa.array([], type=column.type)
        gathered = pa.concat_arrays(pieces)
        back = np.empty(positions.size, dtype=np.int64)
        back[np.concatenate(placed)] = np.arange(positions.size)
        return gathered.take(pa.array(back))

    def column(self, name: str) -> np.ndarray:
        """A whole per-sample column (e.g. a length column) as a numpy array."""
        return self._rows[name].to_numpy()

    def sample(self, position: int) -> IndexedSample:
        """Everything the index knows about the sample at ``position``."""
        if not 0 <= position < self.num_samples:
            raise IndexError(f"position {position} outside the index's {self.num_samples} samples")
        return self._to_sample(position, self._rows.slice(position, 1).to_pylist()[0])

    def samples(self, positions: np.ndarray | list[int]) -> list[IndexedSample]:
        """`sample` for many positions at once (one chunk-wise take per column: cheaper per sample)."""
        positions = np.asarray(positions, dtype=np.int64)
        names = ("key", "shard", "fields", "row_group", "row", *LENGTH_COLUMNS)
        columns = {name: self._take(name, positions).to_pylist() for name in names}
        return [self._to_sample(int(p), {name: columns[name][i] for name in names})
                for i, p in enumerate(positions.tolist())]

    def _to_sample(self, position: int, row: dict[str, Any]) -> IndexedSample:
        return IndexedSample(
            position=position, key=row["key"], shard=self.shards[row["shard"]],
            fields=tuple(FieldLocation(**f) for f in row["fields"]),
            lengths=SampleLengths(**{name: row[name] for name in LENGTH_COLUMNS}),
            row_group=row["row_group"], row=row["row"],
        )

    def positions_of(self, keys: list[str] | pa.Array) -> np.ndarray:
        """Positions of ``keys`` (``-1`` for a key the index does not hold); builds a hash table of all keys."""
        found = pc.index_in(pa.array(keys, type=pa.string()), value_set=self._rows["key"].combine_chunks())
        return found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)


def _write_arrow_copy(parquet_path: Path, arrow_path: Path) -> None:
    """Recreate the memory-mapped copy of a partition from its Parquet file, row group by row group."""
    if not parquet_path.is_file():
        raise IndexFormatError(f"{parquet_path}: partition missing; rebuild the index with `omnifeed index`")
    source = pq.ParquetFile(parquet_path)
    tmp = arrow_path.with_suffix(".arrow.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
        for group in range(source.num_row_groups):
            writer.write_table(source.read_row_group(group).cast(ROW_SCHEMA))
    tmp.replace(arrow_path)
