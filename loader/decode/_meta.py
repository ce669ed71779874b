"""Meta fields as values: labels as ints, JSON parsed, text as str; the bytes only where the type is unknown.

A meta field's type comes from its name (the last extension, ``seg.json`` → ``json``, or the
whole name, ``label``) and, for a Parquet cell, from its column's Arrow type (the index stores
binary cells as they are, string cells as UTF-8 and every other type as JSON):

| field (last extension) | value |
|---|---|
| ``cls``, ``cls2``, ``class``, ``label``, ``idx``, ``index``, ``inx``, ``id``, ``count`` | ``int`` when the text is a decimal integer in int64 range (spaces around it allowed), else the text as ``str`` |
| ``json``, ``jsn`` | the parsed JSON value (``dict``, ``list``, ``int``, ``float``, ``str``, ``bool``, ``None``) |
| ``txt``, ``text``, ``transcript`` | ``str`` |
| a Parquet column of another type than binary or string (int, float, bool, list, struct, ...) | the parsed value, whatever the name (an int column gives ``int``) |
| a Parquet string column, other names | ``str`` |
| anything else (tar members, folder files, Parquet binary columns) | the ``bytes`` as stored |

The names are WebDataset's (``cls``, ``json``, ``txt``, ...) plus ``label`` and ``idx``.
JSON integers outside int64 come back as their decimal ``str`` (a batch carries 64-bit
integers only). Errors: ``encoding`` (a typed field that is not UTF-8), ``corrupt`` (a
``.json`` field that does not parse).
"""  # noqa: E501 (Markdown table rows cannot wrap)

from __future__ import annotations

import functools
import json
import re
from typing import Any, Literal

from ._common import DecodeError

ColumnKind = Literal["binary", "string", "json"]
"""How the index stored a Parquet cell: binary as is, a string as UTF-8, anything else as JSON."""

INT_FIELDS = frozenset({"cls", "cls2", "class", "label", "idx", "index", "inx", "id", "count"})
JSON_FIELDS = frozenset({"json", "jsn"})
TEXT_FIELDS = frozenset({"txt", "text", "transcript"})

_INTEGER = re.compile(rb"\s*[+-]?[0-9]+\s*")
_INT64 = (-(2**63), 2**63 - 1)


@functools.lru_cache(maxsize=1024)  # a dataset has few field names; asked once per value
def field_type(field: str) -> Literal["int", "json", "text", "bytes"]:
    """The type a meta field's name says: 'int', 'json', 'text', or 'bytes' (unknown)."""
    name = field.lower()
    for candidate in (name.rsplit(".", 1)[-1], name):
        if candidate in INT_FIELDS:
            return "int"
        if candidate in JSON_FIELDS:
            return "json"
        if candidate in TEXT_FIELDS:
            return "text"
    return "bytes"


def _int_or_str(digits: str) -> int | str:
    value = int(digits)
    return value if _INT64[0] <= value <= _INT64[1] else digits


_JSON = json.JSONDecoder(parse_int=_int_or_str)  # once: json.loads with an option builds a decoder per call


def _text(data: bytes, key: str, field: str) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(
            f"field {field!r} is not UTF-8 (byte {exc.start}: {exc.reason})", key, "meta", "encoding"
        ) from exc


def _json(data: bytes, key: str, field: str) -> Any:
    text = _text(data, key, field)
    try:
        return _JSON.decode(text)
    except ValueError as exc:  # JSONDecodeError, or a number too long for int()
        raise DecodeError(f"field {field!r} is not valid JSON ({exc})", key, "meta", "corrupt") from exc


def decode_meta(data: bytes, key: str, field: str, column: ColumnKind | None = None) -> Any:
    """The value of meta field ``field`` of sample ``key`` from its stored bytes (see the module docstring).

    ``column``: how the index stored it, for a Parquet cell (None for tar members and folder files).
    Raises DecodeError 'encoding' or 'corrupt'.
    """
    if column == "json":
        return _json(data, key, field)
    kind = field_type(field)
    if kind == "int":
        if _INTEGER.fullmatch(data):
            return _int_or_str(data.decode("ascii").strip())
        return _text(data, key, field)
    if kind == "json":
        return _json(data, key, field)
    if kind == "text" or column == "string":
        return _text(data, key, field)
    return bytes(data)
