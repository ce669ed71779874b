"""Table sources, Parquet and Arrow files: one row per sample, every column but the key a field.

A field is named by its lower-cased column name; a null cell is an absent field; a column's
modality and its cells' bytes are ``_columns``'s (Hugging Face features, names, sniffed content).

Keys: the ``IndexConfig.key_column`` column. A file without a column of the default name
``__key__`` (as ``datasets`` writes them) is keyed ``<file stem>/<row>``: the file name without
its extension, and the row's 0-based number within the file (``train-00000-of-00002/17``), so
the same file gives the same keys wherever it is read. A key column named otherwise must exist.

Locations: a Parquet cell by (row group, row within it); an Arrow cell by (record batch number,
row within it) and the byte offset of that batch's message (``_arrow_files``).
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
from ._parquet_pages import check_decompressed
from ._probe import FieldProbeError
from ._records import FieldLocation, ShardScan, ShardSpec
from ._samples import Items, make_sample
from ._tokenizers import TokenCounter

DEFAULT_KEY_COLUMN = "__key__"
_EMBED = ("embed the files in the dataset (datasets embeds them in save_to_disk and push_to_hub; before to_parquet: "
          "ds.with_format('arrow').map(datasets.table.embed_table_storage, batched=True))")


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
                raise SourceError(f"{self.url}: no key column {config.key_column!r} (columns: {', '.join(names)}); "
                                  "set IndexConfig.key_column (--key-column) to the column holding the sample key",
                                  url=self.url)
            self.key_column = None
        self.stem = posixpath.basename(self.url.rstrip("/")).rsplit(".", 1)[0]
        self.columns = [name for name in names if name != self.key_column]
        by_field: dict[str, str] = {}
        for column in self.columns:
            other = by_field.setdefault(column.lower(), column)
            if other != column:
                raise SourceError(f"{self.url}: columns {other!r} and {column!r} are both field {column.lower()!r} "
                                  "(names are lower-cased); rename one of them", url=self.url)
        self.modalities = ColumnModalities(schema, self.columns, config)
        self.damage = Damage(self.url, config.strict)
        self.seen: set[str] = set()
        self.rows = 0  # rows of the file before the current chunk

    def _keys(self, table: pa.Table, chunk: int) -> list[str]:
        if self.key_column is None:
            return [f"{self.stem}/{self.rows + row}" for row in range(table.num_rows)]
        column = self.key_column
        try:
            raw = table.column(column).to_pylist()
        except (ValueError, OverflowError) as exc:  # invalid UTF-8, a date out of Python's range
            raise SourceError(f"{self.url}: row group {chunk}: column {column!r} holds a key that cannot be converted "
                              f"({type(exc).__name__}: {exc}); fix column {column!r}", url=self.url) from None
        keys = []
        for row, value in enumerate(raw):
            key = str(value)
            if value is None or key in self.seen:
                problem = "a null key" if value is None else f"key {key!r} again"
                raise SourceError(f"{self.url}: row group {chunk} row {row} has {problem}; fix column {column!r}",
                                  url=self.url, key=key)
            self.seen.add(key)
            keys.append(key)
        return keys

    def add(self, table: pa.Table, chunk: int, offset: int) -> None:
        """Samples of one chunk: row group or batch number ``chunk``, its message at byte ``offset`` (Arrow; else -1)."""
        keys = self._keys(table, chunk)
        cells, paths = {}, {}
        for column in self.columns:
            try:
                cells[column] = cell_bytes(table.column(column))
            except SourceError as exc:
                raise SourceError(f"{self.url}: row group {chunk}: column {column!r}: {exc}; fix or drop the column",
                                  url=self.url) from None
            paths[column] = cell_paths(table.column(column))
        self.modalities.decide(cells)
        for row, key in enumerate(keys):
            items: Items = []
            for column in self.columns:
                value = cells[column][row]
                path = paths[column][row] if paths[column] is not None else None  # type: ignore[index]
                if value is None and path is not None:
                    self.damage.add(key, column, "no_bytes", (
                        f"{self.url}: row {self.rows + row} (sample {key!r}): column {column!r} holds no bytes, only "
                        f"the path {path!r}, a file outside the dataset, which omnifeed does not read; {_EMBED}"))
                    break
                if value is not None:
                    items.append((FieldLocation(column.lower(), self.modalities.of(column), column, offset, len(value)),
                                  value))
            else:
                try:
                    self.scan.samples.append(make_sample(self.url, key, items, self.count, chunk, row))
                except FieldProbeError as exc:
                    self.damage.add(key, exc.member, exc.reason, str(exc))
        self.rows += table.num_rows

    def finish(self) -> ShardScan:
        """The scan, with its damaged rows (ShardDamaged when no row is left)."""
        return self.damage.finish(self.scan)
