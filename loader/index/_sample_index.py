"""The sample index on disk, opened memory-mapped: keys, locations and lengths by position.

Layout of an index directory (written by ``build_index``)::

    manifest.json          counts, fingerprint, length statistics, partitions
    part-00000.parquet     rows of partition 0, sorted by key (the interchange copy)
    part-00000.arrow       the same rows as uncompressed Arrow IPC (the memory-mapped copy)
    shards.parquet         shard id -> URL, kind, bytes, samples
    by_shard.npy           positions ordered by (shard, order within shard)
    even-lengths.npz       the length columns of an even sample of rows (`even_positions`),
                           what a budget plan estimates its buckets from; derived, optional
    lengths.npy            every row's length columns as one record (`_length_rows`); derived, optional

A sample's *position* is its row number in the concatenation of the partitions
in order. Opening maps the Arrow files and the ``by_shard`` array and reads their
metadata, nothing per row: a chunk of rows is checked in full the first time it is
read, and pages are read on touch and shared between every process on the node
through the page cache, so opening costs the same few megabytes for ten samples or
a hundred million (benchmarks/RESULTS.md, "A billion-row index").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .._errors import IndexFormatError
from ._length_rows import LENGTH_ROWS, LengthRows, even_positions, stored_even_lengths
from ._mapped_rows import MappedRows
from ._records import FieldLocation, SampleLengths, ShardSpec, SourceKind

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
    [
        ("name", pa.string()),
        ("modality", pa.string()),
        ("member", pa.string()),
        ("offset", pa.int64()),
        ("size", pa.int64()),
    ]
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
        """Open (map) the index at ``path``; raises IndexFormatError naming the file for a missing, truncated
        or malformed index file. Rows are checked in full the first time they are read (`_chunk`)."""
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise IndexFormatError(
                f"{self.path}: no {MANIFEST}; is this an omnifeed index? Build one with `omnifeed index`."
            )
        try:
            self.manifest: dict[str, Any] = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise IndexFormatError(f"{manifest_path}: unreadable manifest ({exc}); rebuild the index") from exc
        self.num_samples: int = _check_manifest(self.manifest, manifest_path)
        self.fingerprint: str = self.manifest["fingerprint"]
        self._rows = MappedRows(self.path, self.manifest["partitions"], ROW_SCHEMA, INDEX_FORMAT)
        self._chunk_starts = self._rows.chunk_starts
        self._sample_rows: dict[int, _ChunkRows] = {}  # per chunk read so far: its sample columns, checked
        self.shards, self.shard_sizes = _read_shards(self.path / SHARDS, self.num_samples)
        self.by_shard: np.ndarray = _map_by_shard(self.path / BY_SHARD, self.num_samples)
        self._length_rows = LengthRows.open(self.path / LENGTH_ROWS, self.num_samples, LENGTH_COLUMNS)

    def _chunk(self, name: str, chunk: int) -> pa.Array:
        """One mapped chunk of a column, fully validated the first time (`MappedRows.column_chunk`)."""
        return self._rows.column_chunk(name, chunk)

    def _column(self, name: str) -> pa.ChunkedArray:
        """A whole column, every chunk validated."""
        return self._rows.column(name)

    def __len__(self) -> int:
        return self.num_samples

    def keys(self, positions: np.ndarray | list[int]) -> list[str]:
        """Sample keys at the given positions, in that order."""
        return self._take("key", positions).to_pylist()

    def length_columns(self, positions: np.ndarray | list[int]) -> dict[str, np.ndarray]:
        """The per-modality length columns at ``positions``: from ``lengths.npy`` (a record per sample), or the
        mapped rows of an index without it."""
        if self._length_rows is not None:
            positions = np.asarray(positions, dtype=np.int64)
            if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
                raise IndexError(f"positions outside the index's {self.num_samples} samples")
            return self._length_rows.columns(positions)
        return {name: self._take(name, positions).to_numpy(zero_copy_only=False) for name in LENGTH_COLUMNS}

    def even_lengths(self, size: int) -> dict[str, np.ndarray]:
        """`length_columns` at `even_positions` of ``size``: read from ``even-lengths.npz`` when the index stores
        that sample (one small file, not a page of every length column of a billion rows), else from the rows."""
        positions = even_positions(self.num_samples, size)
        stored = stored_even_lengths(self.path, size, positions.size, LENGTH_COLUMNS)
        return stored if stored is not None else self.length_columns(positions)

    def _take(self, name: str, positions: np.ndarray | list[int]) -> pa.Array:
        """One column at ``positions``, chunk by chunk: ``ChunkedArray.take`` would first copy the
        whole mapped column into memory."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
            raise IndexError(f"positions outside the index's {self.num_samples} samples")
        chunk_of = np.searchsorted(self._chunk_starts, positions, side="right") - 1
        pieces, placed = [], []
        for chunk in np.unique(chunk_of):
            where = np.flatnonzero(chunk_of == chunk)
            pieces.append(self._chunk(name, int(chunk)).take(pa.array(positions[where] - self._chunk_starts[chunk])))
            placed.append(where)
        if not pieces:
            return pa.array([], type=ROW_SCHEMA.field(name).type)
        gathered = pa.concat_arrays(pieces)
        back = np.empty(positions.size, dtype=np.int64)
        back[np.concatenate(placed)] = np.arange(positions.size)
        return gathered.take(pa.array(back))

    @property
    def classes(self) -> list[str]:
        """The class names of the samples' ImageFolder labels: ``label`` n is ``classes[n]`` ([] when none)."""
        classes = self.manifest.get("classes")
        return [str(name) for name in classes] if isinstance(classes, list) else []

    def column(self, name: str) -> np.ndarray:
        """A whole per-sample column (e.g. a length column) as a numpy array."""
        return self._column(name).to_numpy()

    def sample(self, position: int) -> IndexedSample:
        """Everything the index knows about the sample at ``position``."""
        if not 0 <= position < self.num_samples:
            raise IndexError(f"position {position} outside the index's {self.num_samples} samples")
        chunk = int(np.searchsorted(self._chunk_starts, position, side="right") - 1)
        return self._chunk_rows(chunk).sample(position, position - int(self._chunk_starts[chunk]))

    def samples(self, positions: np.ndarray | list[int]) -> list[IndexedSample]:
        """`sample` for many positions at once, each row read from its chunk's buffers (`_ChunkRows`)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
            raise IndexError(f"positions outside the index's {self.num_samples} samples")
        chunk_of = (np.searchsorted(self._chunk_starts, positions, side="right") - 1).tolist()
        starts = self._chunk_starts
        return [
            self._chunk_rows(chunk).sample(position, position - int(starts[chunk]))
            for position, chunk in zip(positions.tolist(), chunk_of)
        ]

    def _chunk_rows(self, chunk: int) -> _ChunkRows:
        """Chunk ``chunk``'s sample columns, each validated before its values are read."""
        found = self._sample_rows.get(chunk)
        if found is None:
            columns = [self._chunk(name, chunk) for name in _SAMPLE_COLUMNS]
            found = self._sample_rows[chunk] = _ChunkRows(columns, self.shards, self.path)
        return found

    def positions_of(self, keys: list[str] | pa.Array) -> np.ndarray:
        """Positions of ``keys`` (``-1`` for a key the index does not hold); builds a hash table of all keys."""
        found = pc.index_in(pa.array(keys, type=pa.string()), value_set=self._column("key").combine_chunks())
        return found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)


_PARTITION_FILE = re.compile(r"part-\d{5,}\.parquet")
_SAMPLE_COLUMNS = ("key", "shard", "fields", "row_group", "row", *LENGTH_COLUMNS)
_FIELD_TEXT = ("name", "modality", "member")
_FIELD_NUMBERS = ("offset", "size")


class _Utf8:
    """The strings of an Arrow string column, read one at a time from its offsets and data buffers."""

    def __init__(self, array: pa.Array) -> None:
        _, bounds, data = (b"" if buffer is None else buffer for buffer in array.buffers())  # empty: maybe none
        self.bounds = np.frombuffer(bounds, np.int32)[array.offset : array.offset + len(array) + 1].data  # `string`
        self.data = memoryview(data)

    def __getitem__(self, i: int) -> str:
        return str(self.data[self.bounds[i] : self.bounds[i + 1]], "utf-8")


def _values(array: pa.Array) -> memoryview:
    """A primitive column's values for reading one at a time: a memoryview's item is a Python int or float, ~10x
    cheaper than a numpy scalar's ``item()``. From the buffer, not ``to_numpy``, which imports pandas (0.3 s)."""
    buffer = array.buffers()[1]
    values = np.frombuffer(b"" if buffer is None else buffer, np.dtype(array.type.to_pandas_dtype()))
    return values[array.offset : array.offset + len(array)].data


class _ChunkRows:
    """One chunk's sample columns, read a row at a time from views of their Arrow buffers.

    Reading ``column[offset].as_py()`` made an Arrow scalar per column and row, and a dict per field: ~100 µs a
    sample against ~36 now, and 0.3 ms of a training rank's CPU a sample in its scheduler (benchmarks/RESULTS.md).
    The views are zero-copy, so a chunk costs nothing but its validation until a row is read.
    """

    def __init__(self, columns: list[pa.Array], shards: list[ShardSpec], index_path: Path) -> None:
        self.shards, self.index_path = shards, index_path
        named = dict(zip(_SAMPLE_COLUMNS, columns))
        self.keys = _Utf8(named["key"])
        fields = named["fields"]
        self.field_bounds = _values(fields.offsets)  # into ``fields.values``, whatever the list's offset
        items = fields.values
        self.field_text = [_Utf8(items.field(name)) for name in _FIELD_TEXT]
        self.field_numbers = [_values(items.field(name)) for name in _FIELD_NUMBERS]
        self.shard, self.row_group, self.row = (_values(named[name]) for name in ("shard", "row_group", "row"))
        self.lengths = [(name, _values(named[name])) for name in LENGTH_COLUMNS]

    def sample(self, position: int, offset: int) -> IndexedSample:
        """The sample at ``offset`` of this chunk (``position`` in the index)."""
        shard = self.shard[offset]
        if not 0 <= shard < len(self.shards):
            raise IndexFormatError(
                f"{self.index_path}: the row at position {position} names shard {shard}, but "
                f"{SHARDS} lists {len(self.shards)}; rebuild the index"
            )
        names, modalities, members = self.field_text
        starts, sizes = self.field_numbers
        fields = tuple(
            FieldLocation(names[i], modalities[i], members[i], starts[i], sizes[i])
            for i in range(self.field_bounds[offset], self.field_bounds[offset + 1])
        )
        return IndexedSample(
            position=position,
            key=self.keys[offset],
            shard=self.shards[shard],
            fields=fields,
            lengths=SampleLengths(**{name: column[offset] for name, column in self.lengths}),
            row_group=self.row_group[offset],
            row=self.row[offset],
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_manifest(manifest: Any, path: Path) -> int:
    """The manifest's sample count, after checking what opening relies on; IndexFormatError otherwise.

    Partition files must be plain ``part-NNNNN.parquet`` names: an index never names a file outside its
    own directory (the Arrow copy is written beside the Parquet file).
    """
    if not isinstance(manifest, dict) or manifest.get("format") != INDEX_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise IndexFormatError(f"{path}: format {found!r}, expected {INDEX_FORMAT!r}; rebuild the index")
    partitions = manifest.get("partitions")
    problem = None
    if not _is_count(manifest.get("num_samples")):
        problem = "'num_samples' is not a count"
    elif not isinstance(manifest.get("fingerprint"), str):
        problem = "'fingerprint' is not a string"
    elif not isinstance(partitions, list) or not all(
        isinstance(p, dict)
        and _is_count(p.get("rows"))
        and isinstance(p.get("file"), str)
        and _PARTITION_FILE.fullmatch(p["file"])
        for p in partitions
    ):
        problem = "'partitions' is not a list of {file: 'part-NNNNN.parquet', rows: count}"
    elif sum(p["rows"] for p in partitions) != manifest["num_samples"]:
        problem = f"the partitions hold {sum(p['rows'] for p in partitions)} rows, not num_samples"
    if problem is not None:
        raise IndexFormatError(f"{path}: {problem}; rebuild the index")
    return int(manifest["num_samples"])


def _read_shards(path: Path, num_samples: int) -> tuple[list[ShardSpec], np.ndarray]:
    """The shard table: specs and sample counts. Local shard paths must be absolute (`omnifeed index` writes
    them so): a relative one would be read relative to whatever directory the reader runs in."""
    try:
        with pq.ParquetFile(path) as shards:  # not read_table: its dataset layer imports pandas (~0.2 s a process)
            table = shards.read(columns=["url", "kind", "num_samples"])
        urls, kinds = table["url"].to_pylist(), table["kind"].to_pylist()
        sizes = np.asarray(table["num_samples"].to_pylist(), dtype=np.int64)  # (to_numpy imports pandas too)
    except (OSError, pa.ArrowException, KeyError, ValueError, TypeError) as exc:
        raise IndexFormatError(
            f"{path}: unreadable shard table ({type(exc).__name__}: {exc}); rebuild the index"
        ) from exc
    for url, kind in zip(urls, kinds):
        if kind not in get_args(SourceKind) or not isinstance(url, str) or not url:
            raise IndexFormatError(
                f"{path}: shard {url!r} of kind {kind!r} is not a tar, parquet, arrow or folder shard; "
                "rebuild the index"
            )
        if "://" not in url and "::" not in url and not url.startswith("/"):
            raise IndexFormatError(
                f"{path}: shard path {url!r} is relative (an index names its shards by absolute "
                "path or URL); rebuild the index"
            )
    if sizes.sum() != num_samples or (sizes < 0).any():
        raise IndexFormatError(
            f"{path}: shard sample counts add up to {sizes.sum()}, not {num_samples}; rebuild the index"
        )
    return [ShardSpec(url=u, kind=k) for u, k in zip(urls, kinds)], sizes


def _map_by_shard(path: Path, num_samples: int) -> np.ndarray:
    """``by_shard.npy`` mapped: one int64 position per sample (the values are not read here)."""
    try:
        array: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:  # numpy's header parser raises ValueError, SyntaxError, tokenize.TokenError, ...
        raise IndexFormatError(f"{path}: unreadable ({type(exc).__name__}: {exc}); rebuild the index") from exc
    if array.shape != (num_samples,) or array.dtype != np.dtype("<i8"):
        raise IndexFormatError(
            f"{path}: {array.dtype} array of shape {array.shape}, expected {num_samples} int64 "
            "positions; rebuild the index"
        )
    return array
