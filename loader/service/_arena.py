"""Shared memory for batches on their way from the service to its clients.

Each stream keeps a few **segments**: anonymous shared-memory files (``memfd_create``), so
they are private to the processes the service hands their descriptors to, over its 0700
socket, and vanish with the last process that maps them: a crashed service or client leaks
nothing in ``/dev/shm``. A segment crosses the socket once (when it is created or grown);
after that a batch header names the segment and each array's offset, dtype and shape (its
**layout**, `encode_batch`), and the client builds tensors as views of its mapping: no
per-batch mapping, pickling or copy. The service side is numpy only (it never imports torch);
the client (``omnifeed.trainer_adapter``) makes the tensors, once per (segment, layout).

The service collates each batch straight into a free segment (``SegmentWriter.alloc`` is the
allocator `collate` takes); a segment is reused once every client that took its batch has
dropped the batch's tensors. When a client holds more batches than the stream has segments
(it keeps a list of them, say), a batch goes to a one-off segment the service forgets after
sending it: memory then follows what the client holds, as with a DataLoader.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from ._protocol import KEYS_EXT, TENSOR_EXT, ProtocolError, decode

_SMALL = 4096  # the least span an array takes (a multiple of any alignment a dtype needs)
_MIN_SEGMENT = 1 << 20
DTYPES: tuple[str, ...] = (
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "bool",
    "bfloat16",
)
"""The dtype of each code a reference carries (the wire's numbering: never reorder, only append)."""
_NUMPY = {code: np.dtype(name) for code, name in enumerate(DTYPES) if name != "bfloat16"}  # native order
_CODES = {dtype: code for code, dtype in _NUMPY.items()}
_REF = struct.Struct("<iIQBB")  # segment slot, its generation, offset, dtype code, dimensions; then the shape (int64s)


def _mapped_memfd(name: str, size: int, fd: int | None, writable: bool = True) -> tuple[int, mmap.mmap]:
    """(descriptor, mapping) of a new anonymous shared-memory file of ``size`` bytes, or of ``fd`` (another process's,
    received over a socket; the mapping owns it now); the descriptor is closed if mapping fails."""
    created = fd is None
    fd = os.memfd_create(name, os.MFD_CLOEXEC) if fd is None else fd
    try:
        if created:
            os.ftruncate(fd, size)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return fd, mmap.mmap(fd, size, prot=prot)
    except BaseException:
        os.close(fd)
        raise


class Segment:
    """One shared-memory file mapped into the service: a slot of its stream (``slot`` -1: one-off)."""

    def __init__(self, slot: int, generation: int, size: int, fd: int | None = None) -> None:
        """A new segment of at least ``size`` bytes; with ``fd``, the service's segment of exactly ``size`` bytes that
        descriptor names, mapped here (a stream's producer process writes its batches there; the fd is this
        segment's now)."""
        self.slot, self.generation = slot, generation
        self.size = max(_MIN_SEGMENT, size) if fd is None else size
        self.fd, self._map = _mapped_memfd(f"omnifeed-batch-{slot}", self.size, fd)
        self.base: np.ndarray | None = np.frombuffer(self._map, dtype=np.uint8)
        self.address = self.base.ctypes.data

    @property
    def name(self) -> list[int]:
        """How a batch header names this segment: ``[slot, generation, size]``."""
        return [self.slot, self.generation, self.size]

    def close(self) -> None:
        """Unmap and close (idempotent); pages are freed when the last client mapping goes too."""
        self.base = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self._map.close()
        except BufferError:  # a batch built here is still referenced: the map goes with it
            pass


class HeldCount:
    """How many micro-batches the `BatchLedger` holds for hand-over, in a page of shared memory (``memfd``) the producer
    processes map read-only: a producer asks the service for a micro-batch only while it is not zero, so a job that
    never resized pays no round trip a micro-batch for it."""

    def __init__(self, fd: int | None = None) -> None:
        """A new count (the ledger's), or, with ``fd``, the ledger's count mapped in a producer process (which keeps
        the descriptor)."""
        self.fd, self._map = _mapped_memfd("omnifeed-handover-held", mmap.PAGESIZE, fd, writable=fd is None)
        self._value = np.frombuffer(self._map, dtype=np.int64, count=1)

    def set(self, held: int) -> None:
        """The ledger holds ``held`` micro-batches now (nothing once closed)."""
        if self.fd >= 0:
            self._value[0] = held

    def get(self) -> int:
        """The micro-batches the ledger holds."""
        return int(self._value[0])

    def close(self) -> None:
        """Unmap and close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            del self._value
            self._map.close()


class SegmentWriter:
    """Bump allocator over one segment for one batch; counts what the batch needs when it does not fit."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.needed = 0
        self.overflowed = False

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialized array of ``shape`` and ``dtype`` in the segment (private memory once it is full)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        start = self.needed
        self.needed = start + reserved_bytes(nbytes)
        base = self.segment.base
        if base is None or self.needed > self.segment.size:
            self.overflowed = True
            return np.empty(shape, dtype=dtype)
        return base[start : start + nbytes].view(dtype).reshape(shape)


def reserved_bytes(nbytes: int) -> int:
    """The span an array of ``nbytes`` takes in a segment: 4 KiB at least, else ``nbytes`` rounded up to a sixteenth of
    its power of two (at most 1/16 more). Arrays that vary a little from batch to batch (padded text, a few more boxes)
    then leave every array after them at the same offset, so the batch's layout, and the client's tensors, stay."""
    if nbytes <= _SMALL:
        return _SMALL
    step = 1 << (nbytes.bit_length() - 5)
    return -(-nbytes // step) * step


def grown_size(needed: int) -> int:
    """A segment size for ``needed`` bytes with room to spare (a quarter, rounded to MiB)."""
    return -(-int(needed * 1.25) // (1 << 20)) * (1 << 20)


def encode_batch(batch: dict[str, Any], segment: Segment) -> tuple[bytes, dict[str, Any]]:
    """(the batch's layout, the rest of it) for a batch frame: the layout places every array held in a dict.

    The layout is msgpack of ``[[path, reference or None], ...]`` (a path: the dict keys down to
    a value), one entry per key of every dict that holds arrays (a nested dict that holds arrays
    is given by its own entries), in the batch's key order: the same bytes for every batch with
    the same keys and the same shapes at the same offsets of a segment, so a client builds its
    tensors once per (segment, layout). The rest holds the values of the None entries; an array
    inside a list stays there as a reference (``TENSOR_EXT``), and ``"__key__"`` travels as one
    blob (``KEYS_EXT``).
    """
    entries: list[list[Any]] = []
    rest = _split(batch, segment, [], entries) if _holds_arrays(batch) else _inline(batch, segment)
    keys = batch.get("__key__")
    if isinstance(keys, list) and keys and all(type(k) is str for k in keys):
        joined = "\n".join(keys)
        if joined.count("\n") == len(keys) - 1:  # no key holds the separator
            rest["__key__"] = msgpack.ExtType(KEYS_EXT, joined.encode())
    return msgpack.packb(entries, use_bin_type=True), rest


def _holds_arrays(node: dict[str, Any]) -> bool:
    return any(isinstance(v, np.ndarray) or (isinstance(v, dict) and _holds_arrays(v)) for v in node.values())


def _split(node: dict[str, Any], segment: Segment, path: list[Any], entries: list[list[Any]]) -> dict[str, Any]:
    """The values of ``node`` (a dict that holds arrays) that are not in the layout; its layout entries appended."""
    rest: dict[str, Any] = {}
    for key, item in node.items():
        here = [*path, key]
        if isinstance(item, np.ndarray):
            entries.append([here, _reference(item, segment)])
        elif isinstance(item, dict) and _holds_arrays(item):
            inner = _split(item, segment, here, entries)
            if inner:
                rest[key] = inner
        else:
            entries.append([here, None])
            rest[key] = _inline(item, segment)
    return rest


_LEAVES = frozenset({str, int, float, bool, bytes, type(None)})
"""Types of the values a batch holds most (keys, strings, info, parsed JSON): passed on without a look inside."""


def _inline(value: Any, segment: Segment) -> Any:
    """``value`` with each array as a reference in place (outside the layout)."""
    if type(value) in _LEAVES:
        return value
    if isinstance(value, np.ndarray):
        return msgpack.ExtType(TENSOR_EXT, _reference(value, segment))
    if isinstance(value, dict):
        return {k: v if type(v) in _LEAVES else _inline(v, segment) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [v if type(v) in _LEAVES else _inline(v, segment) for v in value]
    return value


def _reference(array: np.ndarray, segment: Segment) -> bytes:
    code = _CODES.get(array.dtype)
    if code is None:
        raise TypeError(
            f"a batch array of dtype {array.dtype} cannot be handed over; use one of "
            f"{', '.join(n for n in DTYPES if n != 'bfloat16')} in native byte order"
        )
    nbytes = array.nbytes
    offset = 0 if nbytes == 0 else array.__array_interface__["data"][0] - segment.address
    if nbytes and (not array.flags.c_contiguous or offset < 0 or offset + nbytes > segment.size):
        raise ValueError("a batch array is not in the batch's shared-memory segment (collate with its allocator)")
    return _reference_format(array.ndim).pack(segment.slot, segment.generation, offset, code, array.ndim, *array.shape)


@functools.cache
def _reference_format(ndim: int) -> struct.Struct:
    """A reference's fields (`_REF`) and a shape of ``ndim`` dimensions, packed at once."""
    return struct.Struct(_REF.format + f"{ndim}q")


def read_reference(data: bytes) -> tuple[int, int, int, str, tuple[int, ...]]:
    """A tensor reference's fields: (segment slot, generation, byte offset, dtype name, shape); ValueError if
    malformed."""
    if len(data) < _REF.size:
        raise ValueError("a tensor reference is too short")
    ndim = data[_REF.size - 1]  # the header's last field
    if len(data) != _REF.size + 8 * ndim:
        raise ValueError("a tensor reference's shape does not match its length")
    slot, generation, offset, dtype_code, _, *dimensions = _reference_format(ndim).unpack(data)
    shape = tuple(dimensions)
    if dtype_code >= len(DTYPES) or min(shape, default=0) < 0:
        raise ValueError(f"a tensor reference with dtype code {dtype_code} and shape {shape}")
    return slot, generation, offset, DTYPES[dtype_code], shape


def batch_hook(make: Callable[[bytes], Any]) -> Callable[[int, bytes], Any]:
    """The msgpack extension hook of a batch frame: a key blob becomes the list of keys, a tensor reference
    ``make(it)``."""

    def hook(code: int, data: bytes) -> Any:
        if code == KEYS_EXT:
            return data.decode("utf-8").split("\n")
        if code == TENSOR_EXT:
            return make(data)
        raise ValueError(f"unknown msgpack extension {code}")

    return hook


Template = tuple[dict[str, Any], dict[str, Any]]
"""One dict of a batch as a layout gives it: (its keys in order, with the arrays made and None where the rest has the
value or a nested dict goes; the nested dicts' templates by key)."""


def read_layout(layout: bytes) -> list[tuple[list[Any], bytes | None]]:
    """A batch layout's (path, reference or None) pairs; ProtocolError if malformed."""
    try:
        entries = msgpack.unpackb(layout, raw=False, use_list=True)
        pairs = [(list(path), ref) for path, ref in entries]
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ProtocolError(f"a malformed batch layout ({type(exc).__name__}: {exc})") from None
    if not all(path and (ref is None or isinstance(ref, bytes)) for path, ref in pairs):
        raise ProtocolError("a batch layout entry without a path, or with something else than a reference")
    return pairs


def build_template(
    entries: list[tuple[list[Any], bytes | None]], make: Callable[[bytes], Any]
) -> tuple[Template, list[Any]]:
    """The template of a layout's entries, with ``make(reference)`` for each array, and those arrays in order."""
    root: Template = ({}, {})
    made = []
    for path, ref in entries:
        node = root
        for key in path[:-1]:
            child = node[1].get(key)
            if child is None:
                child = node[1][key] = ({}, {})
                node[0][key] = None  # its place among its parent's keys
            node = child
        if ref is None:
            node[0][path[-1]] = None
        else:
            array = node[0][path[-1]] = make(ref)
            made.append(array)
    return root, made


def merge(rest: dict[str, Any] | None, template: Template) -> dict[str, Any]:
    """A new dict: ``template``'s arrays and ``rest``'s values in the template's key order (ProtocolError if a nested
    dict of the template is something else in the rest)."""
    keys, children = template
    out = keys.copy()
    if rest:
        out.update(rest)
    for key, child in children.items():
        inner = out[key]
        if inner is not None and type(inner) is not dict:
            raise ProtocolError(f"a batch layout names {key!r} a dict, which the batch does not hold as one")
        out[key] = merge(inner, child)
    return out


def _view(base: np.ndarray, data: bytes) -> np.ndarray:
    """The numpy view of ``base`` a reference names (a bfloat16 one as its raw bytes: uint8, last dimension doubled)."""
    _slot, _generation, offset, dtype_name, shape = read_reference(data)
    bfloat16 = dtype_name == "bfloat16"
    dtype = np.dtype(np.uint8) if bfloat16 else np.dtype(dtype_name)
    raw = (*shape[:-1], 2 * shape[-1]) if bfloat16 and shape else (2,) if bfloat16 else shape
    nbytes = math.prod(raw) * dtype.itemsize
    if offset + nbytes > base.size:
        raise ValueError("a tensor reference points outside its segment")
    if not nbytes:
        return np.empty(raw, dtype=dtype)
    return base[offset : offset + nbytes].view(dtype).reshape(raw)


def decode_arrays(frame: bytes, base: np.ndarray) -> dict[str, Any]:
    """A batch frame's batch with its arrays as numpy views of ``base``, the mapping of its one segment (the service's
    side: a bfloat16 array comes back as its raw bytes, uint8 with the last dimension doubled)."""
    message = decode(frame[4:], batch_hook(lambda ref: _view(base, ref)))
    template, _ = build_template(read_layout(message["layout"]), lambda ref: _view(base, ref))
    return merge(message["batch"], template)
