"""Decoded values as cache entries: arrays, strings, bytes and tuples of them, in a plain binary layout.

Never pickle: a cache directory is shared between jobs, and unpickling what another
process wrote would run its code. The layout is ``OFD1``, then one value::

    array   b"T" dtype-name-length (u8) dtype-name ndim (u8) shape (u64 x ndim) data
    str     b"S" length (u64) utf-8
    bytes   b"B" length (u64) data
    tuple   b"U" count (u8) values (nested at most 32 deep)

Arrays come back as numpy arrays of the same shape (0-d included); a torch tensor (a user's
decoder may return one) is stored as its numpy array, told apart without importing torch.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ..decode import as_numpy, is_torch_tensor

_MAGIC = b"OFD1"
_MAX_DEPTH = 32  # tuples in tuples: a decoder's output is shallow; a deep entry is damage, not data
_U64 = struct.Struct("<Q")


class DecodedEntryError(ValueError):
    """A cached decoded entry does not parse (treated as a miss)."""


def tensor_bytes(value: Any) -> int:
    """Bytes held by a decoded value (arrays, (text, tokens) pairs, raw bytes)."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, tuple):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, (bytes, str)):
        return len(value)
    return 0


def encode_decoded(value: Any) -> bytes:
    """The entry bytes of a decoder's output."""
    parts: list[bytes] = [_MAGIC]
    _encode(value, parts)
    return b"".join(parts)


def _encode(value: Any, parts: list[bytes]) -> None:
    if isinstance(value, np.ndarray) or is_torch_tensor(value):
        array = as_numpy(value)
        if not array.flags.c_contiguous:  # (np.ascontiguousarray would also make a 0-d array 1-d)
            array = array.copy(order="C")
        if array.dtype.hasobject:
            raise TypeError("cannot cache an array of Python objects")
        name = array.dtype.str.encode()
        parts += [
            b"T",
            bytes([len(name)]),
            name,
            bytes([array.ndim]),
            *(_U64.pack(n) for n in array.shape),
            array.tobytes(),
        ]
    elif isinstance(value, str):
        data = value.encode()
        parts += [b"S", _U64.pack(len(data)), data]
    elif isinstance(value, (bytes, bytearray, memoryview)):
        parts += [b"B", _U64.pack(len(value)), bytes(value)]
    elif isinstance(value, tuple) and len(value) < 256:
        parts += [b"U", bytes([len(value)])]
        for item in value:
            _encode(item, parts)
    else:
        raise TypeError(f"cannot cache a decoded value of type {type(value).__name__}")


def decode_decoded(data: bytes) -> Any:
    """The decoder output an entry holds; raises DecodedEntryError if it does not parse."""
    if data[:4] != _MAGIC:
        raise DecodedEntryError("not a decoded entry")
    try:
        value, end = _decode(memoryview(data), 4, 0)
    except (IndexError, struct.error, ValueError, TypeError) as exc:
        raise DecodedEntryError(f"malformed decoded entry: {exc}") from exc
    if end != len(data):
        raise DecodedEntryError("trailing bytes after a decoded entry")
    return value


def _decode(view: memoryview, at: int, depth: int) -> tuple[Any, int]:
    if depth > _MAX_DEPTH:
        raise ValueError(f"tuples nested more than {_MAX_DEPTH} deep")
    tag = bytes(view[at : at + 1])
    at += 1
    if tag == b"T":
        name_len = view[at]
        dtype = np.dtype(bytes(view[at + 1 : at + 1 + name_len]).decode())
        if dtype.hasobject:
            raise ValueError("object arrays are not cached")
        at += 1 + name_len
        ndim = view[at]
        at += 1
        shape = tuple(_U64.unpack_from(view, at + 8 * i)[0] for i in range(ndim))
        at += 8 * ndim
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        nbytes = count * dtype.itemsize
        if at + nbytes > len(view):
            raise ValueError("array data cut short")
        array = np.frombuffer(view, dtype=dtype, count=count, offset=at).reshape(shape).copy()
        return array, at + nbytes
    if tag in (b"S", b"B"):
        length = _U64.unpack_from(view, at)[0]
        at += 8
        if at + length > len(view):
            raise ValueError("string cut short")
        raw = bytes(view[at : at + length])
        return (raw.decode() if tag == b"S" else raw), at + length
    if tag == b"U":
        count = view[at]
        at += 1
        items = []
        for _ in range(count):
            item, at = _decode(view, at, depth + 1)
            items.append(item)
        return tuple(items), at
    raise ValueError(f"unknown tag {tag!r}")
