"""A bound on what reading Parquet column chunks decompresses, checked from their page headers.

Arrow decompresses each page into a buffer of the size its page header declares
(``uncompressed_page_size``) and fails when the data would not fit, so the page headers, not
the footer's ``total_uncompressed_size`` (which Arrow never uses, and a file can set to
anything), bound what a read decompresses. Before Arrow reads a row group (index time), the
pages of one cell (read time, ``_parquet_cells``: its dictionary page and data page) or a whole
column chunk (read time, columns read whole), the page headers of what it will read are walked
over the same byte ranges Arrow reads, and the read is refused when their decompressed sizes exceed
``MAX_RATIO`` times their compressed bytes by more than ``MAX_EXCESS`` in all: a decompression
bomb. Bytes shared by two chunks count once, so memory stays under ``MAX_EXCESS`` plus
``MAX_RATIO`` times the bytes read. Already-compressed media (ratio about 1) and text (3-10x)
never come near it; a real column compressing more than 100x can be written in smaller row groups.

Not bounded here: a cell repeated by dictionary or run-length encoding expands when decoded
(docs/security.md §3).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import pyarrow.parquet as pq

from .._errors import SourceError

MAX_RATIO = 100
MAX_EXCESS = 256 << 20
_HEADER_WINDOW = 8 << 10
_MAX_HEADER = 16 << 20  # Arrow's largest page header
_OLD_MR_PADDING = 100  # Arrow reads this much past an old parquet-mr chunk (PARQUET-816)


class _Short(Exception):
    """The header runs past the bytes read."""


class _Thrift:
    """Just enough of Thrift's compact protocol to read a PageHeader's sizes and skip the rest."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        """One byte."""
        if self.pos >= len(self.data):
            raise _Short
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        """An unsigned varint."""
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 70:
                raise ValueError("varint too long")

    def zigzag(self) -> int:
        """A signed (zigzag) varint."""
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, kind: int, depth: int) -> None:
        """Skip one value of compact type ``kind``."""
        if depth > 32:
            raise ValueError("nested too deep")
        if kind in (1, 2):
            return
        if kind == 3:
            self.byte()
        elif kind in (4, 5, 6):
            self.varint()
        elif kind in (7, 8):
            size = 8 if kind == 7 else self.varint()
            if self.pos + size > len(self.data):
                raise _Short
            self.pos += size
        elif kind in (9, 10):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(size):
                self.skip(3 if head & 0x0F in (1, 2) else head & 0x0F, depth + 1)
        elif kind == 11:
            size = self.varint()
            types = self.byte() if size else 0
            for _ in range(size):
                self.skip(types >> 4, depth + 1)
                self.skip(types & 0x0F, depth + 1)
        elif kind == 12:
            self.struct(depth + 1)
        else:
            raise ValueError(f"unknown Thrift type {kind}")

    def struct(self, depth: int = 0, nested: dict[int, dict[int, int]] | None = None) -> dict[int, int]:
        """A struct's integer fields by id (others skipped); with ``nested``, its struct fields' integers go there."""
        fields: dict[int, int] = {}
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == 0:
                return fields
            last = last + (head >> 4) if head >> 4 else self.zigzag()
            if kind in (4, 5, 6):
                fields[last] = self.zigzag()
            elif kind == 12 and nested is not None:
                nested[last] = self.struct(depth + 1)
            else:
                self.skip(kind, depth)


DICTIONARY_PAGE = 2


@dataclass(frozen=True)
class Page:
    """One page of a column chunk, from its header: where it is, its sizes, and the values (v2: rows) it holds.

    ``size`` is the header and the compressed data; ``kind`` is Parquet's PageType (0 data, 2
    dictionary, 3 data v2); ``rows`` is -1 unless a v2 header says it; ``encoding`` is Parquet's
    Encoding of the values; ``header`` the header's bytes.
    """

    offset: int
    size: int
    uncompressed: int
    kind: int
    values: int
    rows: int
    encoding: int = -1
    header: int = 0

    @property
    def uses_dictionary(self) -> bool:
        """Whether this data page's values are indices into its chunk's dictionary page."""
        return self.encoding in (2, 8)  # PLAIN_DICTIONARY, RLE_DICTIONARY


def read_pages(
    read: Callable[[int, int], bytes], start: int, end: int, file_size: int, first_window: int = _HEADER_WINDOW
) -> list[Page]:
    """The pages starting in [start, end) by their headers; ``read(offset, size)`` reads the file (ValueError if bad).

    A header is read ``first_window`` bytes at a time, four times more each time it needs more.
    """
    pages, pos = [], start
    while pos < end:
        window = first_window
        while True:
            nested: dict[int, dict[int, int]] = {}
            reader = _Thrift(read(pos, min(window, file_size - pos)))
            try:
                header = reader.struct(nested=nested)
                break
            except _Short:
                if window >= _MAX_HEADER or pos + window >= file_size:
                    raise ValueError(f"page header at byte {pos} is cut short") from None
                window *= 4
        uncompressed, compressed = header.get(2, -1), header.get(3, -1)
        if uncompressed < 0 or compressed < 0 or pos + reader.pos + compressed > file_size:
            raise ValueError(f"page header at byte {pos} declares sizes {uncompressed} and {compressed}")
        kind = header.get(1, -1)
        data = nested.get({0: 5, DICTIONARY_PAGE: 7, 3: 8}.get(kind, -1), {})
        pages.append(
            Page(
                pos,
                reader.pos + compressed,
                uncompressed,
                kind,
                data.get(1, -1),
                data.get(3, -1) if kind == 3 else -1,
                data.get(4 if kind == 3 else 2, -1),
                reader.pos,
            )
        )
        pos += reader.pos + compressed
    return pages


def _pages(f: IO[bytes], start: int, end: int, file_size: int) -> tuple[int, int]:
    """(decompressed, last byte) of the pages starting in [start, end): what Arrow reads of the chunk."""

    def read(pos: int, size: int) -> bytes:
        f.seek(pos)
        return f.read(size)

    pages = read_pages(read, start, end, file_size)
    return sum(p.uncompressed for p in pages), pages[-1].offset + pages[-1].size if pages else start


def refuse_bomb(url: str, row_group: int, column: str, decompressed: int, compressed: int, excess: int) -> None:
    """Raise the SourceError of a read that would decompress ``excess`` bytes over the bound, if it is over."""
    if excess > MAX_EXCESS:
        raise SourceError(
            f"{url}: row group {row_group} column {column!r}: its pages declare {decompressed:,} bytes decompressed "
            f"from {compressed:,} compressed (over {MAX_RATIO}x; {excess:,} bytes over in this read, over the "
            f"{MAX_EXCESS:,} allowed): refused as a decompression bomb before anything was decompressed; if the data "
            "is real, re-write the file in smaller row groups (pyarrow.parquet.write_table(..., row_group_size=...))",
            url=url,
        )


def _old_parquet_mr(created_by: str | None) -> bool:
    """Whether Arrow pads this writer's chunks (parquet-mr before 1.2.9)."""
    match = re.match(r"parquet-mr(?: version (\d+)\.(\d+)\.(\d+))?", (created_by or "").lower())
    if match is None:
        return False
    return match.group(1) is None or tuple(int(g) for g in match.groups()) < (1, 2, 9)


def leaf_columns(pf: pq.ParquetFile, names: list[str]) -> list[int]:
    """The column chunks (leaf indices) Arrow reads for top-level columns ``names``."""
    return [i for i, path in enumerate(pf.reader.column_paths) if path[0] in names]


def check_decompressed(
    f: IO[bytes], pf: pq.ParquetFile, url: str, row_group: int, columns: list[int] | None = None
) -> None:
    """Refuse (SourceError) a read of ``row_group``'s chunks ``columns`` (all if None) that would decompress a bomb."""
    meta = pf.metadata
    group = meta.row_group(row_group)
    f.seek(0, 2)
    file_size = f.tell()
    padding = _OLD_MR_PADDING if _old_parquet_mr(meta.created_by) else 0
    covered: list[tuple[int, int]] = []
    excess, worst = 0, (-1, "", 0, 0)
    for j in range(group.num_columns) if columns is None else columns:
        chunk = group.column(j)
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
            start = chunk.dictionary_page_offset
        end = min(start + chunk.total_compressed_size + padding, file_size)
        try:
            if start < 0 or chunk.total_compressed_size < 0:
                raise ValueError(f"the chunk's offsets ({start}, {chunk.total_compressed_size}) are negative")
            decompressed, last = _pages(f, start, end, file_size)
        except ValueError as exc:
            raise SourceError(
                f"{url}: row group {row_group} column {chunk.path_in_schema!r}: unreadable Parquet "
                f"page header ({exc}); re-write the file, then re-index",
                url=url,
            ) from None
        fresh = max(0, last - start) - sum(max(0, min(last, e) - max(start, s)) for s, e in covered)
        covered.append((start, last))
        over = max(0, decompressed - MAX_RATIO * max(0, fresh))
        excess += over
        if over >= worst[0]:
            worst = (over, chunk.path_in_schema, decompressed, last - start)
    _, column, decompressed, compressed = worst
    refuse_bomb(url, row_group, column, decompressed, compressed, excess)
