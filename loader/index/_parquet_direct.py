"""Cells read straight from their page's bytes, without decoding the page: PLAIN byte arrays, stored or Snappy.

The two writers most files come from store media this way: ``datasets`` writes image, audio
and video bytes PLAIN and uncompressed; ``pyarrow.parquet.write_table`` writes them PLAIN and
Snappy-compressed (in its dictionary page, for a column's first 1,024 values, then in data
pages of up to 1,024). A PLAIN byte array is a run of ``<u32 length><bytes>``, so once a page's
value positions are known (``PageValues``: found once per page, from 4-byte reads), a cell is
one ranged read of its own bytes.

A Snappy page cannot be decompressed from the middle, but its stream is a list of elements:
literals (bytes stored as they are) and copies (of up to 64 bytes from earlier in the
output). ``SnappyIndex`` walks the element tags once per page (their bodies are skipped, so
about one small read per 64 KB of incompressible media) and a range of the output is then
read from the literals it covers, copies resolved from what they copy. A page whose stream
is more intricate than that (compressible data: ``MAX_ELEMENTS``, ``MAX_DEPTH``, ``MAX_VISITS``), that has
nulls Arrow would have to place (any level layout but one run), or that is not v1, is left to
Arrow (``_parquet_page_files``): ``Unsupported``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ._parquet_pages import DICTIONARY_PAGE, Page

Read = Callable[[int, int], bytes]
MAX_ELEMENTS = 1 << 17  # per page: more means compressible data, decoded whole by Arrow instead
MAX_DEPTH = 64  # copies of copies resolved per byte range
MAX_VISITS = 256  # elements visited to read a range, plus one per 16 bytes of it
_WINDOW = 512  # bytes read at a tag: the next tags when elements are short
DIRECT_CODECS = ("UNCOMPRESSED", "SNAPPY")


class Unsupported(Exception):
    """This page is read by Arrow instead (it is not, or not simply, PLAIN byte arrays)."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 35:
            raise Unsupported("a varint runs past its bytes")
        b = data[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return value, pos
        shift += 7


class SnappyIndex:
    """The elements of one Snappy stream: where each starts in the output, and its literal bytes or copy offset."""

    def __init__(self, read: Read, start: int, end: int, uncompressed: int) -> None:
        head = read(start, min(10, end - start))
        declared, pos = _varint(head, 0)
        if declared != uncompressed:
            raise Unsupported(f"the stream declares {declared} bytes, the page {uncompressed}")
        pos += start
        starts: list[int] = []
        sources: list[int] = []  # literal: where its bytes are (>= 0); copy: minus its offset
        out, window_at, window = 0, pos, b""
        while pos < end:
            if pos - window_at + 5 > len(window):
                window_at, window = pos, read(pos, min(_WINDOW, end - pos))
            at = pos - window_at
            if at + 5 > len(window) and pos + 5 <= end:
                raise Unsupported("the file is cut short")
            tag, kind = window[at], window[at] & 3
            if kind == 0:
                length, size = tag >> 2, 1
                if length >= 60:
                    size = length - 58
                    length = int.from_bytes(window[at + 1 : at + size], "little")
                length += 1
                starts.append(out)
                sources.append(pos + size)
                pos += size + length
            else:
                size = {1: 2, 2: 3, 3: 5}[kind]
                extra = window[at + 1 : at + size]
                if len(extra) != size - 1:
                    raise Unsupported("a copy cut short")
                if kind == 1:
                    length, offset = (tag >> 2 & 7) + 4, (tag >> 5) << 8 | extra[0]
                else:
                    length, offset = (tag >> 2) + 1, int.from_bytes(extra, "little")
                if not 0 < offset <= out:
                    raise Unsupported(f"a copy reaches {offset} bytes back from byte {out}")
                starts.append(out)
                sources.append(-offset)
                pos += size
            out += length
            if len(starts) > MAX_ELEMENTS:
                raise Unsupported("too many elements")
        if out != uncompressed or pos != end:
            raise Unsupported(f"the stream holds {out} bytes, not {uncompressed}")
        self.starts, self.sources, self.size = starts, sources, out

    def read_range(self, read: Read, start: int, end: int) -> bytes:
        """Output bytes [start, end), read from the literals that hold them (copies resolved).

        Raises Unsupported past ``MAX_DEPTH`` copies of copies or ``MAX_VISITS`` elements: compressible data.
        """
        return self._bytes(read, start, end, 0, [MAX_VISITS + (end - start) // 16])

    def _bytes(self, read: Read, start: int, end: int, depth: int, budget: list[int]) -> bytes:
        if depth > MAX_DEPTH or not 0 <= start <= end <= self.size:
            raise Unsupported("a range out of the stream, or copies nested too deep")
        out = bytearray()
        i = bisect.bisect_right(self.starts, start) - 1
        pos = start
        while pos < end:
            budget[0] -= 1
            if budget[0] < 0:
                raise Unsupported("copies of copies: the data compresses too well to be read in place")
            first = self.starts[i]
            last = self.starts[i + 1] if i + 1 < len(self.starts) else self.size
            take = min(end, last) - pos
            source = self.sources[i]
            if source >= 0:
                out += read(source + pos - first, take)
            else:  # out[first + k] == out[first - offset + k % offset]
                offset = -source
                period = self._bytes(
                    read, first - offset, first - offset + min(offset, last - first), depth + 1, budget
                )
                skip = (pos - first) % offset
                out += (period * ((skip + take) // len(period) + 2))[skip : skip + take]
            pos += take
            i += 1
        return bytes(out)


def _levels(data: bytes, bit_width: int, count: int) -> np.ndarray:
    """``count`` values of Parquet's RLE / bit-packed hybrid encoding."""
    runs, pos, have = [], 0, 0
    width = (bit_width + 7) // 8
    while have < count:
        header, pos = _varint(data, pos)
        if header & 1:
            size = (header >> 1) * bit_width
            bits = np.unpackbits(np.frombuffer(data[pos : pos + size], np.uint8), bitorder="little")
            run = bits.reshape(-1, bit_width) @ (1 << np.arange(bit_width))
            pos += size
        else:
            run = np.full(min(header >> 1, count - have), int.from_bytes(data[pos : pos + width], "little"))
            pos += width
        if len(run) == 0:
            raise Unsupported("an empty run")
        runs.append(run)
        have += len(run)
    return np.concatenate(runs)[:count]


@dataclass(frozen=True)
class PageValues:
    """Where each value of a PLAIN byte-array page is in its output, and which rows hold one (the others are null)."""

    body: int  # where the page's data starts in the file
    snappy: SnappyIndex | None
    starts: np.ndarray  # of each value's bytes in the output
    lengths: np.ndarray
    value_of_row: np.ndarray | None  # -1 for a null row; None: row r holds value r

    @property
    def nbytes(self) -> int:
        """Memory this index holds."""
        kept = self.starts.nbytes + self.lengths.nbytes
        return (
            kept
            + (0 if self.value_of_row is None else self.value_of_row.nbytes)
            + (0 if self.snappy is None else 16 * len(self.snappy.starts))
        )

    def output(self, read: Read, start: int, end: int) -> bytes:
        """Bytes [start, end) of the page's output."""
        if self.snappy is None:
            return read(self.body + start, end - start)
        return self.snappy.read_range(read, start, end)

    def cell(self, read: Read, row: int) -> bytes | None:
        """The bytes of ``row`` (its index within the page; for a dictionary page, the value's number)."""
        value = row if self.value_of_row is None else int(self.value_of_row[row])
        if value < 0:
            return None
        start = int(self.starts[value])
        data = self.output(read, start, start + int(self.lengths[value]))
        if len(data) != self.lengths[value]:
            raise Unsupported("a value cut short")
        return data


def page_values(read: Read, page: Page, codec: str, max_definition: int, rows: int) -> PageValues:
    """The value positions of a PLAIN byte-array page (a v1 data page, or a dictionary page); Unsupported else."""
    if codec not in DIRECT_CODECS or page.kind not in (0, DICTIONARY_PAGE) or page.encoding not in (0, 2, -1):
        raise Unsupported(f"a {codec} page of kind {page.kind}, encoding {page.encoding}")
    if page.kind == 0 and page.encoding != 0:
        raise Unsupported("a dictionary-encoded data page")
    body, end = page.offset + page.header, page.offset + page.size
    snappy = SnappyIndex(read, body, end, page.uncompressed) if codec == "SNAPPY" else None
    if snappy is None and end - body != page.uncompressed:
        raise Unsupported("an uncompressed page whose sizes differ")
    index = PageValues(body, snappy, np.zeros(0, np.int64), np.zeros(0, np.int64), None)
    pos, value_of_row, count = 0, None, page.values
    if page.kind == 0 and max_definition > 0:
        declared = int.from_bytes(index.output(read, 0, 4), "little")
        levels = _levels(index.output(read, 4, 4 + declared), max_definition.bit_length(), page.values)
        defined = levels == max_definition
        count, pos = int(defined.sum()), 4 + declared
        if count != rows:
            value_of_row = np.where(defined, np.cumsum(defined) - 1, -1)
    elif page.values != rows:
        raise Unsupported("a page whose values are not its rows")
    starts, lengths = np.empty(count, np.int64), np.empty(count, np.int64)
    for i in range(count):
        length = int.from_bytes(index.output(read, pos, pos + 4), "little")
        if pos + 4 + length > page.uncompressed:
            raise Unsupported(f"value {i} runs past the page")
        starts[i], lengths[i] = pos + 4, length
        pos += 4 + length
    if pos != page.uncompressed:  # levels and lengths that do not fill the page exactly were not understood
        raise Unsupported(f"the values end at byte {pos} of {page.uncompressed}")
    return PageValues(body, snappy, starts, lengths, value_of_row)
