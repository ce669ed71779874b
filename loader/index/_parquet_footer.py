"""One Parquet data page as a small Parquet file of its own, so that Arrow decodes that page and nothing else.

pyarrow reads whole column chunks; a chunk of a file written with default settings can hold a
hundred megabytes (issue 28). To decode the rows of one data page, that page and its chunk's
dictionary page (if any) are copied byte for byte after a ``PAR1`` magic, followed by a footer
made from the file's own: its schema, key-value metadata (the Arrow schema), ``created_by`` and
column orders are copied as they are, and its one row group holds one column chunk per leaf
column, each keeping its type, encodings, path and codec, with counts and offsets rewritten to
the copied pages (only the chunk of the leaf read has pages; the others are never read). Arrow
then decodes that file like any other: every encoding, codec, page version and nullability,
with the checks it always makes.

Only what is rewritten is encoded here (Thrift's compact protocol: integers, lists, structs);
everything else is copied from the footer, whose fields are found by a minimal reader
(``_parquet_pages._Thrift``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ._parquet_pages import _Short, _Thrift

MAGIC = b"PAR1"
_BOOL_TRUE, _BOOL_FALSE, _I32, _I64, _LIST, _STRUCT = 1, 2, 5, 6, 9, 12
_REQUIRED, _REPEATED = 0, 2
_PLAIN, _RLE = 0, 3
_FILE_FIELDS_KEPT = (1, 2, 5, 6, 7)  # version, schema, key_value_metadata, created_by, column_orders
_CHUNK_META_KEPT = (1, 2, 3, 4)  # type, encodings, path_in_schema, codec

Fields = list[tuple[int, int, bytes]]
"""A Thrift struct as (field id, compact type, the value's encoded bytes)."""


def _struct_fields(data: bytes) -> Fields:
    """The fields of the struct encoded in ``data``, each with its value's raw bytes."""
    reader = _Thrift(data)
    fields: Fields = []
    last = 0
    while True:
        head = reader.byte()
        kind = head & 0x0F
        if kind == 0:
            return fields
        last = last + (head >> 4) if head >> 4 else reader.zigzag()
        start = reader.pos
        if kind not in (_BOOL_TRUE, _BOOL_FALSE):
            reader.skip(kind, 1)
        fields.append((last, kind, data[start : reader.pos]))


def _list_items(data: bytes) -> list[bytes]:
    """The raw bytes of each item of the list encoded in ``data``."""
    reader = _Thrift(data)
    head = reader.byte()
    size = head >> 4 if head >> 4 != 15 else reader.varint()
    kind = head & 0x0F
    items = []
    for _ in range(size):
        start = reader.pos
        reader.skip(3 if kind in (_BOOL_TRUE, _BOOL_FALSE) else kind, 1)  # a bool item is one byte
        items.append(data[start : reader.pos])
    return items


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _i64(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _encode_struct(fields: Fields) -> bytes:
    out, last = bytearray(), 0
    for fid, kind, value in sorted(fields):
        out += bytes([(fid - last) << 4 | kind]) if 0 < fid - last <= 15 else bytes([kind]) + _i64(fid)
        out += value
        last = fid
    out.append(0)
    return bytes(out)


def _encode_list(kind: int, items: list[bytes]) -> bytes:
    head = bytes([len(items) << 4 | kind]) if len(items) < 15 else bytes([0xF0 | kind]) + _varint(len(items))
    return head + b"".join(items)


@dataclass
class Footer:
    """A file's footer as raw Thrift: its top-level fields, and each row group's column chunks found on demand."""

    fields: dict[int, tuple[int, bytes]]
    _chunks: dict[int, list[Fields]] = field(default_factory=dict)
    _groups: list[bytes] | None = None

    @classmethod
    def parse(cls, raw: bytes) -> Footer:
        """The footer from its bytes (the FileMetaData between the data and the length); ValueError if malformed."""
        try:
            return cls({fid: (kind, value) for fid, kind, value in _struct_fields(raw)})
        except _Short:
            raise ValueError("the footer is cut short") from None

    def chunk_meta(self, row_group: int) -> list[Fields]:
        """Each leaf column's ColumnMetaData fields in ``row_group`` (ValueError if malformed or absent)."""
        if row_group not in self._chunks:
            try:
                if self._groups is None:
                    self._groups = _list_items(self.fields[4][1])
                group = {fid: value for fid, _, value in _struct_fields(self._groups[row_group])}
                metas = []
                for chunk in _list_items(group[1]):
                    meta = [value for fid, kind, value in _struct_fields(chunk) if fid == 3 and kind == _STRUCT]
                    if not meta:
                        raise ValueError("a column chunk without metadata (encrypted?)")
                    metas.append(_struct_fields(meta[0]))
            except (_Short, KeyError, IndexError):
                raise ValueError(f"row group {row_group} of the footer is malformed") from None
            self._chunks[row_group] = metas
        return self._chunks[row_group]


def page_header(kind: int, values: int, uncompressed: int, compressed: int) -> bytes:
    """The header of a page of ``values`` PLAIN values: a v1 data page (``kind`` 0) or a dictionary page (2)."""
    if kind == 0:
        inner = [(1, _I32, _i64(values)), (2, _I32, _i64(_PLAIN)), (3, _I32, _i64(_RLE)), (4, _I32, _i64(_RLE))]
    else:
        inner = [(1, _I32, _i64(values)), (2, _I32, _i64(_PLAIN))]
    return _encode_struct(
        [
            (1, _I32, _i64(kind)),
            (2, _I32, _i64(uncompressed)),
            (3, _I32, _i64(compressed)),
            (5 if kind == 0 else 7, _STRUCT, _encode_struct(inner)),
        ]
    )


def _required_schema(schema: bytes, leaf: int) -> bytes:
    """The schema list with the leaf column ``leaf`` and its parents REQUIRED (ValueError if one is repeated)."""
    elements = [_struct_fields(item) for item in _list_items(schema)]

    def children(element: Fields) -> int:
        return next((_Thrift(value).zigzag() for fid, _, value in element if fid == 5), 0)

    remaining, path, seen = [children(elements[0])], [0], -1
    for i in range(1, len(elements)):
        remaining[-1] -= 1
        if children(elements[i]) > 0:
            remaining.append(children(elements[i]))
            path.append(i)
            continue
        seen += 1
        if seen == leaf:
            path.append(i)
            break
        while len(remaining) > 1 and remaining[-1] == 0:
            remaining.pop()
            path.pop()
    else:
        raise ValueError(f"the schema has no leaf column {leaf}")
    for i in path[1:]:
        if any(fid == 3 and _Thrift(value).zigzag() == _REPEATED for fid, _, value in elements[i]):
            raise ValueError("a repeated column")
        elements[i] = [f for f in elements[i] if f[0] != 3] + [(3, _I32, _i64(_REQUIRED))]
    return _encode_list(_STRUCT, [_encode_struct(element) for element in elements])


def one_page_footer(
    footer: Footer,
    row_group: int,
    leaf: int,
    *,
    dictionary: int,
    data: int,
    values: int,
    rows: int,
    required: bool = False,
) -> bytes:
    """The footer (with its length and magic) of a file of ``MAGIC``, a dictionary page of ``dictionary`` bytes
    (0: none), then a data page of ``data`` bytes holding ``values`` values in ``rows`` rows of column ``leaf``.

    ``required``: the column and its parents made REQUIRED (a page without levels: a dictionary page
    re-headed as a data page). ValueError for a footer this cannot rewrite.
    """
    chunks = []
    first = len(MAGIC)
    for j, meta in enumerate(footer.chunk_meta(row_group)):
        kept = [(fid, kind, value) for fid, kind, value in meta if fid in _CHUNK_META_KEPT]
        if j == leaf:
            total = dictionary + data
            kept += [
                (5, _I64, _i64(values)),
                (6, _I64, _i64(total)),
                (7, _I64, _i64(total)),
                (9, _I64, _i64(first + dictionary)),
            ]
            if dictionary:
                kept.append((11, _I64, _i64(first)))
        else:  # never read
            kept += [(5, _I64, _i64(0)), (6, _I64, _i64(0)), (7, _I64, _i64(0)), (9, _I64, _i64(first))]
        chunks.append(_encode_struct([(2, _I64, _i64(first)), (3, _STRUCT, _encode_struct(kept))]))
    group = _encode_struct(
        [(1, _LIST, _encode_list(_STRUCT, chunks)), (2, _I64, _i64(dictionary + data)), (3, _I64, _i64(rows))]
    )
    kept_file = [(fid, kind, value) for fid, (kind, value) in footer.fields.items() if fid in _FILE_FIELDS_KEPT]
    if required:
        try:
            kept_file = [
                (fid, kind, _required_schema(value, leaf) if fid == 2 else value) for fid, kind, value in kept_file
            ]
        except (_Short, IndexError):
            raise ValueError("the schema is malformed") from None
    encoded = _encode_struct(kept_file + [(3, _I64, _i64(rows)), (4, _LIST, _encode_list(_STRUCT, [group]))])
    return encoded + struct.pack("<i", len(encoded)) + MAGIC
