"""Decoding the pages of one Parquet column chunk, page by page, each as a small file Arrow reads (``_parquet_footer``).

A data page is decoded with the chunk's dictionary page when it uses it. A large dictionary
(over ``LARGE_DICTIONARY``: pyarrow's default writer puts its first 1,024 values of a column
there, ~100 MB for 100 KB images), or one whose values the page would repeat into more than
``EXPANDED`` bytes (one 900 KB value in 300 rows: 270 MB), is decoded in two small steps
instead, since Arrow expanding or hashing a large binary dictionary took 15 times as long as
decoding it, and expanding repeats costs their memory (docs/security.md §3):

- its values: the dictionary page, re-headed as a PLAIN data page of a REQUIRED column (a
  dictionary page has no levels), decoded once per chunk and kept (``ParquetCells``);
- each data page's indices: the data page after a stand-in dictionary of as many tiny values,
  read as a ``DictionaryArray`` whose indices (nulls included) are the page's.

A cell of such a page is then ``values[indices[row]]`` (a ``DictionaryArray`` over both, no copy).
Every page is checked against the decompression bound (``_parquet_pages``) before it is read.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from .._errors import SourceError
from ._open_files import OpenedFile
from ._parquet_footer import MAGIC, Footer, one_page_footer, page_header
from ._parquet_pages import DICTIONARY_PAGE, MAX_RATIO, Page, refuse_bomb

LARGE_DICTIONARY = 1 << 20  # over pyarrow's default dictionary page limit: a few large values
EXPANDED = 16 << 20  # a page's values expanded from its dictionary, about, past which they stay a dictionary
_CODECS = {
    "SNAPPY": "snappy",
    "GZIP": "gzip",
    "BROTLI": "brotli",
    "ZSTD": "zstd",
    "LZ4_RAW": "lz4_raw",
    "UNCOMPRESSED": None,
}
_REWRITE = "re-write the file, then re-index"


@dataclass(frozen=True)
class Chunk:
    """A column chunk's pages: its dictionary page, data pages, and the first row and rows of each."""

    dictionary: Page | None
    pages: tuple[Page, ...]
    first_rows: tuple[int, ...]
    rows: tuple[int, ...]

    def page_of(self, row: int) -> int:
        """The data page holding ``row``."""
        return bisect.bisect_right(self.first_rows, row) - 1


def pages_by_row(pages: list[Page], repeated: bool, num_rows: int) -> Chunk | None:
    """The chunk's data pages by first row; None when they do not say their rows or do not add up to ``num_rows``."""
    dictionary, row = None, 0
    data: list[Page] = []
    first_rows: list[int] = []
    counts: list[int] = []
    for page in pages:
        if page.kind == DICTIONARY_PAGE:
            if dictionary is not None or data:
                return None
            dictionary = page
        elif page.kind in (0, 3):
            rows = page.rows if page.rows >= 0 else (-1 if repeated else page.values)
            if rows <= 0 or page.values < 0:
                return None
            data.append(page)
            first_rows.append(row)
            counts.append(rows)
            row += rows
    if row != num_rows or not data:
        return None
    return Chunk(dictionary, tuple(data), tuple(first_rows), tuple(counts))


@dataclass(frozen=True)
class ChunkAt:
    """Which chunk: the file's footer, the row group, the leaf column, its path (for messages) and codec."""

    footer: Footer
    row_group: int
    leaf: int
    column: str
    codec: str

    def split_dictionary(self, chunk: Chunk, page: Page, plain_bytes: bool) -> bool:
        """Whether ``page`` is read in two steps (module docstring): it uses a dictionary of plain bytes that is
        large, or that its values would repeat into more than ``EXPANDED`` bytes."""
        dictionary = chunk.dictionary
        if not (page.uses_dictionary and dictionary is not None and plain_bytes and self.codec in _CODECS):
            return False
        expanded = page.values * dictionary.uncompressed // max(1, dictionary.values)
        return dictionary.uncompressed > LARGE_DICTIONARY or expanded > EXPANDED


def bounded(opened: OpenedFile, at: ChunkAt, pages: list[Page]) -> None:
    """Refuse (SourceError) reading ``pages`` if what they declare decompressed is over the bound."""
    decompressed, compressed = sum(p.uncompressed for p in pages), sum(p.size for p in pages)
    refuse_bomb(
        opened.url, at.row_group, at.column, decompressed, compressed, max(0, decompressed - MAX_RATIO * compressed)
    )


def _decode(
    opened: OpenedFile,
    at: ChunkAt,
    parts: list[bytes | Page],
    tail: bytes,
    rows: int,
    *,
    as_dictionary: bool = False,
    body_only: bool = False,
) -> pa.Array:
    """Arrow's reading of ``MAGIC``, ``parts`` (bytes, or a page copied from the file: its body alone with
    ``body_only``) and ``tail`` (the footer): the leaf's column, which must hold ``rows`` rows."""
    sizes = [len(p) if isinstance(p, bytes) else p.size - (p.header if body_only else 0) for p in parts]
    buffer = bytearray(len(MAGIC) + sum(sizes) + len(tail))
    view = memoryview(buffer)
    view[: len(MAGIC)] = MAGIC
    at_byte = len(MAGIC)
    for part, size in zip(parts, sizes):
        if isinstance(part, bytes):
            view[at_byte : at_byte + size] = part
        elif opened.read_into(view[at_byte : at_byte + size], part.offset + part.size - size) != size:
            raise SourceError(
                f"{opened.url}: cut short inside the page at byte {part.offset}; {_REWRITE}", url=opened.url
            )
        at_byte += size
    view[at_byte:] = tail
    single = pq.ParquetFile(pa.BufferReader(pa.py_buffer(buffer)), read_dictionary=[at.leaf] if as_dictionary else None)
    values = single.reader.read_row_group(0, column_indices=[at.leaf], use_threads=False).column(0).combine_chunks()
    if len(values) != rows:
        raise SourceError(
            f"{opened.url}: row group {at.row_group} column {at.column!r}: a page holds {len(values)} "
            f"rows, its header says {rows}; {_REWRITE}",
            url=opened.url,
        )
    return values


def page_values(opened: OpenedFile, at: ChunkAt, chunk: Chunk, index: int) -> pa.Array:
    """The values of data page ``index``, decoded with the dictionary page if it uses it."""
    page = chunk.pages[index]
    dictionary = chunk.dictionary if page.uses_dictionary else None
    pages = [page] if dictionary is None else [dictionary, page]
    bounded(opened, at, pages)
    tail = _footer(
        opened,
        at,
        dictionary=0 if dictionary is None else dictionary.size,
        data=page.size,
        values=page.values,
        rows=chunk.rows[index],
    )
    return _decode(opened, at, list(pages), tail, chunk.rows[index])


def dictionary_values(opened: OpenedFile, at: ChunkAt, chunk: Chunk) -> pa.Array:
    """The values of the chunk's dictionary page (a binary or string array; a media struct's ``bytes``)."""
    dictionary = chunk.dictionary
    assert dictionary is not None
    bounded(opened, at, [dictionary])
    body = dictionary.size - dictionary.header
    header = page_header(0, dictionary.values, dictionary.uncompressed, body)
    tail = _footer(
        opened,
        at,
        dictionary=0,
        data=len(header) + body,
        values=dictionary.values,
        rows=dictionary.values,
        required=True,
    )
    values = _decode(opened, at, [header, dictionary], tail, dictionary.values, body_only=True)
    while pa.types.is_struct(values.type):  # a media struct: its bytes, the one leaf read
        values = values.field(0)
    return values


def page_indices(opened: OpenedFile, at: ChunkAt, chunk: Chunk, index: int) -> pa.Array:
    """The dictionary indices of data page ``index`` (null for a null cell), read after a stand-in dictionary."""
    assert chunk.dictionary is not None
    page = chunk.pages[index]
    bounded(opened, at, [page])
    count = chunk.dictionary.values
    plain = b"".join(struct.pack("<I", len(v)) + v for v in (str(i).encode() for i in range(count)))
    codec = _CODECS[at.codec]
    packed = plain if codec is None else pa.compress(plain, codec=codec, asbytes=True)
    stand_in = page_header(DICTIONARY_PAGE, count, len(plain), len(packed)) + packed
    tail = _footer(opened, at, dictionary=len(stand_in), data=page.size, values=page.values, rows=chunk.rows[index])
    values = _decode(opened, at, [stand_in, page], tail, chunk.rows[index], as_dictionary=True)
    while pa.types.is_struct(values.type):
        values = values.flatten()[0]  # the struct's nulls carried into its field
    if not pa.types.is_dictionary(values.type):
        raise SourceError(
            f"{opened.url}: row group {at.row_group} column {at.column!r}: a dictionary page's values "
            f"are {values.type}; {_REWRITE}",
            url=opened.url,
        )
    return values.indices


def _footer(
    opened: OpenedFile, at: ChunkAt, *, dictionary: int, data: int, values: int, rows: int, required: bool = False
) -> bytes:
    try:
        return one_page_footer(
            at.footer,
            at.row_group,
            at.leaf,
            dictionary=dictionary,
            data=data,
            values=values,
            rows=rows,
            required=required,
        )
    except ValueError as exc:
        raise SourceError(f"{opened.url}: unreadable Parquet footer ({exc}); {_REWRITE}", url=opened.url) from None


def dense(cell: pa.Array) -> pa.Array:
    """One cell of a page read in two steps (a ``DictionaryArray``) as its plain value; others as they are."""
    return cell.dictionary_decode() if pa.types.is_dictionary(cell.type) else cell
