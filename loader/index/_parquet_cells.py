"""Parquet cells read back by page: a cell read touches its own bytes, or its page, never its column chunk.

A cell is (file, row group, row, column). Its file is kept open with its parsed footer
(``_open_files``: bounded, and opened again when the path no longer names the same file). Its
column chunk's pages are found once per process from their headers (``_parquet_pages.read_pages``:
offset, size and the rows each holds). Then, for the page holding the row:

- PLAIN byte arrays stored or Snappy-compressed (media as ``datasets`` and pyarrow write them by
  default, and their dictionary pages): the page's value positions are found once, and the cell
  is one ranged read of its bytes (``_parquet_direct``; a dictionary-encoded page's indices come
  from Arrow, the value from the dictionary page);
- anything else: the page (with its dictionary page if it uses it) is read with ranged reads and
  decoded by Arrow as a small file of its own (``_parquet_page_files``, ``_parquet_footer``);
- a column of several leaves (a struct other than a media struct ``{bytes, path}``, of which only
  ``bytes`` is read), a repeated column whose pages do not say their rows (v1 pages), or a chunk
  whose pages do not add up to its row group: the column chunk is read whole, as before.

What is found or decoded (value positions, decoded pages, whole chunks) is kept in one
byte-bounded LRU per process (``PAGE_CACHE_BYTES``), keyed by the file's identity, and made once
however many threads want it at the same time, so the neighbouring cells of a page share it.
Every read is bounded by ``_parquet_pages``: what its pages declare decompressed, against the
bytes read (docs/security.md §3). Figures: benchmarks/RESULTS.md, docs/your-data.md.
"""

from __future__ import annotations

import io
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import IO, Any, cast

import pyarrow as pa
import pyarrow.parquet as pq

from .._errors import SourceError
from ._columns import cell_bytes, cell_kind, is_media_struct
from ._open_files import SOURCE_FILES, OpenedFile, OpenFiles
from ._parquet_direct import DIRECT_CODECS, PageValues, Unsupported
from ._parquet_direct import page_values as direct_page_values
from ._parquet_footer import MAGIC, Footer
from ._parquet_page_files import (
    Chunk,
    ChunkAt,
    bounded,
    dense,
    dictionary_values,
    page_indices,
    page_values,
    pages_by_row,
)
from ._parquet_pages import Page, check_decompressed, read_pages

PAGE_CACHE_BYTES = 256 << 20
_FOOTER_MAX = 64 << 20
_REWRITE = "re-write the file, then re-index"


class DecodedPages:
    """Decoded pages and value positions by key, least recently used dropped past ``max_bytes``; made once per key."""

    def __init__(self, max_bytes: int = PAGE_CACHE_BYTES) -> None:
        self.max_bytes, self.nbytes = max_bytes, 0
        self._pages: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._making: dict[Hashable, Future[Any]] = {}
        self._lock = threading.Lock()
        self.decoded = self.hits = 0

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value of ``key``, made by ``make`` unless kept or being made by another thread (then waited for)."""
        with self._lock:
            kept = self._pages.get(key)
            if kept is not None:
                self._pages.move_to_end(key)
                self.hits += 1
                return kept[0]
            making = self._making.get(key)
            mine = making is None
            if making is None:
                making = self._making[key] = Future()
        if not mine:
            try:
                return making.result()
            except Exception:  # noqa: BLE001  the maker's error: made (and raised) again here, in this thread
                return make()
        try:
            value = make()
        except BaseException as exc:
            with self._lock:
                del self._making[key]
            making.set_exception(exc)
            raise
        size = _own_bytes(value)
        with self._lock:
            del self._making[key]
            self.decoded += 1
            if size <= self.max_bytes:
                self._pages[key] = (value, size)
                self.nbytes += size
                while self.nbytes > self.max_bytes:
                    self.nbytes -= self._pages.popitem(last=False)[1][1]
        making.set_result(value)
        return value

    def replace(self, key: Hashable, value: Any) -> None:
        """Keep ``value`` for ``key`` instead of what was kept (if anything)."""
        with self._lock:
            kept = self._pages.pop(key, None)
            if kept is not None:
                self.nbytes -= kept[1]
            self._pages[key] = (value, _own_bytes(value))
            self.nbytes += self._pages[key][1]

    def clear(self) -> None:
        """Drop every kept page."""
        with self._lock:
            self._pages.clear()
            self.nbytes = 0


class _Parsed:
    """What is parsed of one file, once per opening: the metadata, the raw footer, each chunk's pages."""

    def __init__(self, opened: OpenedFile) -> None:
        size = opened.size
        tail = opened.read(size - 8, 8) if size >= 12 else b""
        if len(tail) != 8 or tail[4:] != MAGIC:
            raise SourceError(
                f"{opened.url}: not a Parquet file (no PAR1 magic at its end); {_REWRITE}", url=opened.url
            )
        length = struct.unpack("<i", tail[:4])[0]
        if not 0 < length <= min(size - 12, _FOOTER_MAX):
            raise SourceError(f"{opened.url}: its footer declares {length:,} bytes; {_REWRITE}", url=opened.url)
        raw = opened.read(size - 8 - length, length)
        whole = pq.ParquetFile(pa.PythonFile(_Ranged(opened), mode="r"))
        self.metadata = whole.metadata
        self.schema = whole.schema_arrow
        self.paths = [tuple(p) for p in whole.reader.column_paths]
        columns = [self.metadata.schema.column(i) for i in range(len(self.paths))]
        self.repeated = [column.max_repetition_level > 0 for column in columns]
        self.binary = [column.physical_type == "BYTE_ARRAY" for column in columns]
        self.max_definition = [column.max_definition_level for column in columns]
        try:
            self.footer: Footer | None = Footer.parse(raw)
        except ValueError:
            self.footer = None  # columns read whole, as Arrow reads them
        self.chunks: dict[tuple[int, int], Chunk | None] = {}
        self._leaves: dict[str, list[int]] = {}

    def plain_bytes(self, leaf: int) -> bool:
        """Whether the cells of ``leaf`` are its values' bytes (a binary or string column, a media struct's bytes)."""
        path = self.paths[leaf]
        index = self.schema.get_field_index(path[0])
        if not self.binary[leaf] or self.repeated[leaf] or index < 0:
            return False
        arrow_type = self.schema.field(index).type
        if len(path) == 1:
            return cell_kind(arrow_type) in ("binary", "string")
        return path[1:] == ("bytes",) and is_media_struct(arrow_type)

    def leaves(self, member: str) -> list[int]:
        """The leaf columns a cell of top-level column ``member`` needs (a media struct: its ``bytes`` only)."""
        found = self._leaves.get(member)
        if found is None:
            index = self.schema.get_field_index(member)
            if index < 0:
                found = []
            elif is_media_struct(self.schema.field(index).type):
                found = [i for i, path in enumerate(self.paths) if path == (member, "bytes")]
            else:
                found = [i for i, path in enumerate(self.paths) if path[0] == member]
            self._leaves[member] = found
        return found


class _Ranged(io.RawIOBase):
    """A kept file as a seekable file object (its own position; ranged reads underneath)."""

    def __init__(self, opened: OpenedFile) -> None:
        super().__init__()
        self.opened, self.pos = opened, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.opened.size}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        got = self.opened.read_into(memoryview(buffer).cast("B"), self.pos)
        self.pos += got
        return got


class ParquetCells:
    """Reads Parquet cells by page through kept files and a decoded-page LRU (module docstring); thread-safe."""

    def __init__(self, files: OpenFiles = SOURCE_FILES, page_cache_bytes: int = PAGE_CACHE_BYTES) -> None:
        self.files = files
        self.pages = DecodedPages(page_cache_bytes)

    def cell(self, url: str, member: str, row_group: int, row: int) -> bytes | None:
        """The field bytes of column ``member`` at (``row_group``, ``row``); None when the file has no such cell.

        Raises SourceError for a malformed file or a read over the decompression bound, OSError from storage.
        """
        with self.files.use(url) as opened:
            parsed = self._parsed(opened)
            if not 0 <= row_group < parsed.metadata.num_row_groups:
                return None
            leaves = parsed.leaves(member)
            if not leaves or not 0 <= row < parsed.metadata.row_group(row_group).num_rows:
                return None
            chunk = self._chunk(opened, parsed, row_group, leaves[0]) if len(leaves) == 1 else None
            if chunk is None:
                key: tuple[Hashable, ...] = (url, opened.identity, row_group, member)
                values = self.pages.get(key, lambda: self._whole(opened, parsed, row_group, member, leaves))
                first = 0
            else:
                page = chunk.page_of(row)
                first = chunk.first_rows[page]
                direct = self._direct(opened, parsed, row_group, leaves[0], chunk, page, row - first)
                if direct is not _ARROW:
                    return direct  # type: ignore[return-value]
                key = (url, opened.identity, row_group, leaves[0], page)
                values = self.pages.get(key, lambda: self._page(opened, parsed, row_group, leaves[0], chunk, page))
        try:
            return cell_bytes(dense(values.slice(row - first, 1)))[0]
        except SourceError as exc:
            raise SourceError(f"{url}: column {member!r} row group {row_group} row {row}: {exc}", url=url) from None

    def _parsed(self, opened: OpenedFile) -> _Parsed:
        parsed = opened.state.get("parquet")
        if parsed is None:
            parsed = _Parsed(opened)
            with opened.lock:
                parsed = opened.state.setdefault("parquet", parsed)
        return parsed  # type: ignore[no-any-return]

    def _chunk(self, opened: OpenedFile, parsed: _Parsed, row_group: int, leaf: int) -> Chunk | None:
        """The pages of one leaf's chunk, found once; None when its cells must be read with the whole chunk."""
        if (row_group, leaf) in parsed.chunks:
            return parsed.chunks[(row_group, leaf)]
        meta = parsed.metadata.row_group(row_group).column(leaf)
        start = meta.data_page_offset
        if meta.has_dictionary_page and 0 < meta.dictionary_page_offset < start:
            start = meta.dictionary_page_offset
        try:
            found = read_pages(
                opened.read, start, min(start + meta.total_compressed_size, opened.size), opened.size, first_window=1024
            )
        except ValueError as exc:
            raise SourceError(
                f"{opened.url}: row group {row_group} column {meta.path_in_schema!r}: unreadable Parquet "
                f"page header ({exc}); {_REWRITE}",
                url=opened.url,
            ) from None
        chunk = pages_by_row(found, parsed.repeated[leaf], parsed.metadata.row_group(row_group).num_rows)
        if parsed.footer is None:
            chunk = None
        with opened.lock:
            parsed.chunks[(row_group, leaf)] = chunk
        return chunk

    def _direct(
        self, opened: OpenedFile, parsed: _Parsed, row_group: int, leaf: int, chunk: Chunk, index: int, row: int
    ) -> bytes | None | object:
        """Row ``row`` of data page ``index`` read from the page's bytes (``_parquet_direct``), or ``_ARROW``."""
        meta = parsed.metadata.row_group(row_group).column(leaf)
        if meta.compression not in DIRECT_CODECS or not parsed.plain_bytes(leaf) or parsed.footer is None:
            return _ARROW
        at = ChunkAt(parsed.footer, row_group, leaf, meta.path_in_schema, meta.compression)
        page, dictionary = chunk.pages[index], chunk.dictionary
        base = (opened.url, opened.identity, row_group, leaf)
        key = (*base, "direct", -1 if page.uses_dictionary and dictionary is not None else index)
        try:
            if page.uses_dictionary and dictionary is not None:
                values = self.pages.get(key, lambda: _direct_values(opened, at, dictionary, 0))
                if values is _ARROW:
                    return _ARROW
                indices = self.pages.get((*base, "indices", index), lambda: page_indices(opened, at, chunk, index))
                number = indices[row].as_py()
                return None if number is None else values.cell(opened.read, number)
            values = self.pages.get(key, lambda: _direct_values(opened, at, page, parsed.max_definition[leaf]))
            return _ARROW if values is _ARROW else values.cell(opened.read, row)
        except (Unsupported, IndexError):  # compresses too well, or a value past its page: Arrow decodes it
            self.pages.replace(key, _ARROW)
            return _ARROW

    def _page(
        self, opened: OpenedFile, parsed: _Parsed, row_group: int, leaf: int, chunk: Chunk, index: int
    ) -> pa.Array:
        """The values of data page ``index`` (a large dictionary's values kept once per chunk:
        ``_parquet_page_files``)."""
        assert parsed.footer is not None
        meta = parsed.metadata.row_group(row_group).column(leaf)
        at = ChunkAt(parsed.footer, row_group, leaf, meta.path_in_schema, meta.compression)
        if not at.split_dictionary(chunk, chunk.pages[index], parsed.plain_bytes(leaf)):
            return page_values(opened, at, chunk, index)
        key = (opened.url, opened.identity, row_group, leaf, "dictionary")
        values = self.pages.get(key, lambda: dictionary_values(opened, at, chunk))
        return pa.DictionaryArray.from_arrays(page_indices(opened, at, chunk, index), values)

    def _whole(
        self, opened: OpenedFile, parsed: _Parsed, row_group: int, member: str, leaves: list[int]
    ) -> pa.ChunkedArray:
        """Column ``member`` of ``row_group`` read whole (its chunks checked against the bound first)."""
        source = _Ranged(opened)
        whole = pq.ParquetFile(pa.PythonFile(source, mode="r"), metadata=parsed.metadata)
        check_decompressed(cast(IO[bytes], source), whole, opened.url, row_group, leaves)
        return whole.read_row_group(row_group, columns=[member], use_threads=False).column(0)

    def stats(self) -> dict[str, int]:
        """Files opened, bytes read from them, pages decoded or indexed (and whole chunks), cells served from those."""
        return {
            "files_opened": self.files.opened,
            "bytes_read": self.files.bytes_read,
            "pages_decoded": self.pages.decoded,
            "page_hits": self.pages.hits,
            "cached_bytes": self.pages.nbytes,
        }


def _own_bytes(value: Any) -> int:
    """The memory a decoded page holds of its own (a page over a kept dictionary: its indices)."""
    if isinstance(value, pa.DictionaryArray):
        return int(value.indices.get_total_buffer_size())
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        return int(value.get_total_buffer_size())
    return int(getattr(value, "nbytes", 0))


class _ArrowDecodes:
    """Marks a page that ``_parquet_direct`` does not read: Arrow decodes it (``_parquet_page_files``)."""

    nbytes = 0


_ARROW = _ArrowDecodes()


def _direct_values(opened: OpenedFile, at: ChunkAt, page: Page, max_definition: int) -> PageValues | _ArrowDecodes:
    """Where the values of ``page`` are (``_parquet_direct``), or ``_ARROW``; the page is bounded first."""
    bounded(opened, at, [page])
    try:
        return direct_page_values(opened.read, page, at.codec, max_definition, page.values)
    except (Unsupported, IndexError, ValueError):
        return _ARROW


_READER = ParquetCells()


def read_parquet_cell(url: str, member: str, row_group: int, row: int) -> bytes | None:
    """One cell's field bytes through this process's reader (``ParquetCells``); None when there is no such cell."""
    return _READER.cell(url, member, row_group, row)


def parquet_reader() -> ParquetCells:
    """This process's Parquet cell reader (its ``stats()``; tests)."""
    return _READER
