"""Table sources, Parquet and Arrow files: one row per sample, every column but the key a field.

A field is named by its lower-cased column name; a null cell is an absent field; a column's
modality and its cells' bytes are ``_columns``'s (Hugging Face features, names, sniffed content).

Keys: the ``IndexConfig.key_column`` column. A file without a column of the default name
``__key__`` (as ``datasets`` writes them) is keyed ``<file stem>/<row>``: the file name without
its extension, and the row's 0-based number within the file (``train-00000-of-00002/17``), so
the same file gives the same keys wherever it is read. A key column named otherwise must exist.

Locations: a Parquet cell by (row group, row within it); an Arrow cell by (record batch number,
row within it) and the byte offset of that batch's message (``_arrow_files``); a media cell holding
only a path, by the file beneath ``IndexConfig.media_root`` (``_media_root``; without a root such a
cell refuses the file).
"""

from __future__ import annotations

import posixpath

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from .._errors import SourceError
from ._arrow_files import arrow_batches, arrow_schema
from ._columns import ColumnModalities, cell_bytes, cell_paths
from ._config import IndexConfig
from ._damage import Damage
from ._media_root import path_only_error, read_media_cell
from ._parquet_pages import check_decompressed
from ._probe import FieldProbeError
from ._records import FieldLocation, ShardScan, ShardSpec
from ._samples import Items, make_sample
from ._tokenizers import TokenCounter

DEFAULT_KEY_COLUMN = "__key__"


def scan_parquet(shard: ShardSpec, config: IndexConfig, count: TokenCounter) -> ShardScan:
    """One Parquet file's rows, a row group at a time."""
    fs, path = url_to_fs(shard.url)
    scan = ShardScan(shard, size_bytes=fs.size(path))
    with fs.open(path, "rb") as f:
        table_file = pq.ParquetFile(f)
        rows = _TableRows(scan, config, count, table_file.schema_arrow)
        for rg in range(table_file.num_row_groups):
            check_decompressed(f, table_file, shard.url, rg)
            rows.add(table_file.read_row_group(rg), rg, -1)
    return rows.finish()


def scan_arrow(shard: ShardSpec, config: IndexConfig, count: TokenCounter) -> ShardScan:
    """One Arrow IPC file's rows, a record batch at a time."""
    fs, path = url_to_fs(shard.url)
    scan = ShardScan(shard, size_bytes=fs.size(path))
    rows = _TableRows(scan, config, count, arrow_schema(shard.url))
    for number, (offset, batch) in enumerate(arrow_batches(shard.url)):
        rows.add(pa.Table.from_batches([batch]), number, offset)
    return rows.finish()


class _TableRows:
    """Rows of one table file into samples, chunk by chunk (row groups or record batches)."""

    def __init__(self, scan: ShardScan, config: IndexConfig, count: TokenCounter, schema: pa.Schema) -> None:
        self.scan, self.url, self.count = scan, scan.shard.url, count
        names = schema.names
        self.key_column: str | None = config.key_column
        if config.key_column not in names:
            if config.key_column != DEFAULT_KEY_COLUMN:
                raise SourceError(
                    f"{self.url}: no key column {config.key_column!r} (columns: {', '.join(names)}); "
                    "set IndexConfig.key_column (--key-column) to the column holding the sample key",
                    url=self.url,
                )
            self.key_column = None
        self.stem = posixpath.basename(self.url.rstrip("/")).rsplit(".", 1)[0]
        self.columns = [name for name in names if name != self.key_column]
        by_field: dict[str, str] = {}
        for column in self.columns:
            other = by_field.setdefault(column.lower(), column)
            if other != column:
                raise SourceError(
                    f"{self.url}: columns {other!r} and {column!r} are both field {column.lower()!r} "
                    "(names are lower-cased); rename one of them",
                    url=self.url,
                )
        self.modalities = ColumnModalities(schema, self.columns, config)
        self.damage = Damage(self.url, config.strict)
        self.media_root = config.media_root
        self.seen: set[str] = set()
        self.rows = 0  # rows of the file before the current chunk

    def _keys(self, table: pa.Table, chunk: int) -> list[str]:
        if self.key_column is None:
            return [f"{self.stem}/{self.rows + row}" for row in range(table.num_rows)]
        column = self.key_column
        try:
            raw = table.column(column).to_pylist()
        except (ValueError, OverflowError) as exc:  # invalid UTF-8, a date out of Python's range
            raise SourceError(
                f"{self.url}: row group {chunk}: column {column!r} holds a key that cannot be converted "
                f"({type(exc).__name__}: {exc}); fix column {column!r}",
                url=self.url,
            ) from None
        keys = []
        for row, value in enumerate(raw):
            key = str(value)
            if value is None or key in self.seen:
                problem = "a null key" if value is None else f"key {key!r} again"
                raise SourceError(
                    f"{self.url}: row group {chunk} row {row} has {problem}; fix column {column!r}",
                    url=self.url,
                    key=key,
                )
            self.seen.add(key)
            keys.append(key)
        return keys

    def add(self, table: pa.Table, chunk: int, offset: int) -> None:
        """Samples of one chunk: row group or batch number ``chunk``, its message at byte ``offset`` (Arrow; else
        -1)."""
        keys = self._keys(table, chunk)
        cells, paths = {}, {}
        for column in self.columns:
            try:
                cells[column] = cell_bytes(table.column(column))
            except SourceError as exc:
                raise SourceError(
                    f"{self.url}: row group {chunk}: column {column!r}: {exc}; fix or drop the column", url=self.url
                ) from None
            paths[column] = cell_paths(table.column(column))
        files, damaged = self._path_only_cells(keys, cells, paths)
        self.modalities.decide(cells)
        modalities = self.modalities.of_rows(cells)
        for row, key in enumerate(keys):
            if row in damaged:
                continue
            items: Items = []
            for column in self.columns:
                value = cells[column][row]
                if value is not None:
                    member = files.get((column, row))
                    location = FieldLocation(
                        column.lower(),
                        modalities[column][row],
                        member or column,
                        offset if member is None else 0,
                        len(value),
                    )
                    items.append((location, value))
            try:
                self.scan.samples.append(make_sample(self.url, key, items, self.count, chunk, row))
            except FieldProbeError as exc:
                self.damage.add(key, exc.member, exc.reason, str(exc))
        self.rows += table.num_rows

    def _path_only_cells(
        self, keys: list[str], cells: dict[str, list[bytes | None]], paths: dict[str, list[str | None] | None]
    ) -> tuple[dict[tuple[str, int], str], set[int]]:
        """Media cells holding only a path: read beneath the media root into ``cells`` (``_media_root``).

        Returns the file locations by (column, row) and the rows damaged by a file that could not be read.
        Raises SourceError (two lines) at the first such cell when no media root is configured.
        """
        files: dict[tuple[str, int], str] = {}
        damaged: set[int] = set()
        for column in self.columns:
            for row, path in enumerate(paths[column] or ()):
                if path is None or cells[column][row] is not None or row in damaged:
                    continue
                number = self.rows + row
                if self.media_root is None:
                    raise SourceError(path_only_error(self.url, column, number, path), url=self.url)
                where = f"{self.url}: row {number} (sample {keys[row]!r}): column {column!r}: file {path!r}"
                try:
                    files[(column, row)], cells[column][row] = read_media_cell(self.media_root, path, self.url, where)
                except (SourceError, OSError) as exc:
                    problem = str(exc) if isinstance(exc, SourceError) else f"{where}: {exc.strerror or exc}"
                    self.damage.add(
                        keys[row],
                        column,
                        "no_bytes",
                        f"{problem} (--media-root {self.media_root}); "
                        "put the file there, or fix the path in the dataset",
                    )
                    damaged.add(row)
        return files, damaged

    def finish(self) -> ShardScan:
        """The scan, with its damaged rows (ShardDamaged when no row is left)."""
        return self.damage.finish(self.scan)
