"""`MappedRows`: an index's rows in its partitions' Arrow copies, memory-mapped record batch by record batch.

Opening reads each partition file's footer (where its record batches are) and, from the footer's
schema metadata, how many rows each batch holds (``omnifeed.batch_rows``, written with the file):
nothing per row and nothing per batch, so a billion-row index opens in the time of its 16 footers.
A record batch is mapped the first time a row of it is read, and each of its columns is checked in
full then (offsets, UTF-8, no nulls): a damaged file is an `IndexFormatError`, never a read outside
the mapping. A partition file written before the batch counts were recorded is opened by reading
every batch's header instead (its rows are then found as before; rebuild the index to open it
without that).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .._errors import IndexFormatError

BATCH_ROWS = b"omnifeed.batch_rows"  # schema metadata of an Arrow partition: rows of each record batch, JSON
ARROW_BATCH_ROWS = 65536  # the most rows of one record batch


def write_arrow_partition(table: pa.Table, path: Path, schema: pa.Schema) -> None:
    """``table`` as an uncompressed Arrow IPC file at ``path``, record batches of at most `ARROW_BATCH_ROWS` rows,
    their row counts in the schema's metadata (`BATCH_ROWS`)."""
    batches = table.to_batches(max_chunksize=ARROW_BATCH_ROWS)
    tagged = schema.with_metadata({BATCH_ROWS: json.dumps([b.num_rows for b in batches]).encode()})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, tagged) as writer:
        for batch in batches:
            writer.write_batch(batch)


def write_arrow_copy(parquet_path: Path, arrow_path: Path, schema: pa.Schema) -> None:
    """Recreate the memory-mapped copy of a partition from its Parquet file (through a temporary file)."""
    if not parquet_path.is_file():
        raise IndexFormatError(f"{parquet_path}: partition missing; rebuild the index with `omnifeed index`")
    tmp = arrow_path.with_suffix(".arrow.tmp")
    try:  # row group by row group, each cut into batches of at most ARROW_BATCH_ROWS: counts known before writing
        source = pq.ParquetFile(parquet_path)
        groups = [source.metadata.row_group(g).num_rows for g in range(source.num_row_groups)]
        counts = [min(ARROW_BATCH_ROWS, n - a) for n in groups for a in range(0, n, ARROW_BATCH_ROWS)]
        tagged = schema.with_metadata({BATCH_ROWS: json.dumps(counts).encode()})
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, tagged) as writer:
            for group in range(source.num_row_groups):
                table = source.read_row_group(group).cast(schema).combine_chunks()
                for batch in table.to_batches(max_chunksize=ARROW_BATCH_ROWS):
                    writer.write_batch(batch)
    except (OSError, pa.ArrowException, ValueError, TypeError, KeyError) as exc:  # a bad file or other columns
        tmp.unlink(missing_ok=True)
        raise IndexFormatError(
            f"{parquet_path}: unreadable partition ({type(exc).__name__}: {exc}); "
            "rebuild the index with `omnifeed index`"
        ) from exc
    tmp.replace(arrow_path)


class MappedRows:
    """The rows of an index's partitions, in position order, as lazily mapped record batches ("chunks")."""

    def __init__(self, root: Path, partitions: list[dict[str, Any]], schema: pa.Schema, fmt: str) -> None:
        self.root, self.schema = root, schema
        self._readers: list[pa.ipc.RecordBatchFileReader] = []
        self._where: list[tuple[int, int]] = []  # chunk -> (partition, batch in it)
        self._paths: list[Path] = []
        rows: list[int] = []
        for p, part in enumerate(partitions):
            arrow_path = root / part["file"].replace(".parquet", ".arrow")
            if not arrow_path.is_file():
                write_arrow_copy(root / part["file"], arrow_path, schema)
            redo = f"delete it (it is re-created from {part['file']}) or rebuild the index"
            try:
                reader = pa.ipc.open_file(pa.memory_map(str(arrow_path), "r"))
                counts = _batch_rows(reader)
            except (OSError, pa.ArrowException) as exc:
                raise IndexFormatError(f"{arrow_path}: unreadable ({exc}); {redo}") from exc
            if not reader.schema.equals(schema):
                raise IndexFormatError(f"{arrow_path}: not the columns of an {fmt} index; {redo}")
            if sum(counts) != part["rows"]:
                raise IndexFormatError(f"{arrow_path}: {sum(counts)} rows, manifest says {part['rows']}; {redo}")
            self._readers.append(reader)
            self._paths.append(arrow_path)
            self._where += [(p, b) for b in range(len(counts))]
            rows += counts
        self.chunk_starts = np.cumsum([0, *rows], dtype=np.int64)
        self._rows = rows
        self._batches: dict[int, pa.RecordBatch] = {}
        self._checked: set[tuple[str, int]] = set()

    @property
    def num_chunks(self) -> int:
        """Record batches over all partitions."""
        return len(self._where)

    def batch(self, chunk: int) -> pa.RecordBatch:
        """Record batch ``chunk`` (mapped on first use; its row count checked against the recorded one)."""
        found = self._batches.get(chunk)
        if found is None:
            partition, b = self._where[chunk]
            try:
                found = self._readers[partition].get_batch(b)
            except (OSError, pa.ArrowException) as exc:
                raise IndexFormatError(
                    f"{self._paths[partition]}: record batch {b} unreadable ({exc}); {_REBUILD}"
                ) from exc
            if found.num_rows != self._rows[chunk]:
                raise IndexFormatError(
                    f"{self._paths[partition]}: record batch {b} holds {found.num_rows} rows, its footer says "
                    f"{self._rows[chunk]}; {_REBUILD}"
                )
            self._batches[chunk] = found
        return found

    def column_chunk(self, name: str, chunk: int) -> pa.Array:
        """Column ``name`` of record batch ``chunk``, fully validated the first time."""
        array = self.batch(chunk).column(name)
        if (name, chunk) not in self._checked:
            first, last = self.chunk_starts[chunk], self.chunk_starts[chunk + 1] - 1
            try:
                array.validate(full=True)
            except pa.ArrowException as exc:
                raise IndexFormatError(
                    f"{self.root}: column {name!r} of rows {first}..{last} is damaged ({exc}); rebuild the index"
                ) from exc
            if _nulls(array):  # counts from the metadata, checked against the validity bitmaps just now
                raise IndexFormatError(
                    f"{self.root}: column {name!r} of rows {first}..{last} holds null values, which an index never "
                    f"holds; {_REBUILD}"
                )
            self._checked.add((name, chunk))
        return array

    def column(self, name: str) -> pa.ChunkedArray:
        """A whole column, every chunk validated (reads every record batch)."""
        return pa.chunked_array(
            [self.column_chunk(name, i) for i in range(self.num_chunks)], type=self.schema.field(name).type
        )


_REBUILD = "delete the index's .arrow files (they are re-created from the .parquet ones) or rebuild the index"


def _batch_rows(reader: pa.ipc.RecordBatchFileReader) -> list[int]:
    """Rows of each record batch: from the schema's metadata when the file records them, else from every batch's
    header (files written before the counts were recorded)."""
    meta = reader.schema.metadata or {}
    if BATCH_ROWS in meta:
        try:
            counts = json.loads(meta[BATCH_ROWS])
        except ValueError:
            counts = None
        if (
            isinstance(counts, list)
            and len(counts) == reader.num_record_batches
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
        ):
            return counts
    return [reader.get_batch(b).num_rows for b in range(reader.num_record_batches)]


def _nulls(array: pa.Array) -> int:
    """Null values in ``array`` and its children, as their metadata counts them (the first full validation of a
    chunk checks the counts against the validity bitmaps)."""
    count = array.null_count
    if isinstance(array, pa.ListArray):
        count += _nulls(array.values)
    elif isinstance(array, pa.StructArray):
        count += sum(_nulls(array.field(i)) for i in range(array.type.num_fields))
    return count
