"""Shared memory for batches on their way from the service to its clients.

Each stream keeps a few **segments**: anonymous shared-memory files (``memfd_create``), so
they are private to the processes the service hands their descriptors to, over its 0700
socket, and vanish with the last process that maps them: a crashed service or client leaks
nothing in ``/dev/shm``. A segment crosses the socket once (when it is created or grown);
after that a batch header names the segment and each array's offset, dtype and shape, and
the client builds tensors as views of its mapping: no per-batch mapping, pickling or copy.
The service side is numpy only (it never imports torch); `tensor_decoder` imports torch when
a client makes one.

The service collates each batch straight into a free segment (``SegmentWriter.alloc`` is the
allocator `collate` takes); a segment is reused once every client that took its batch has
dropped the batch's tensors. When a client holds more batches than the stream has segments
(it keeps a list of them, say), a batch goes to a one-off segment the service forgets after
sending it: memory then follows what the client holds, as with a DataLoader.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from ._protocol import TENSOR_EXT

_ALIGN = 64
_MIN_SEGMENT = 1 << 20
DTYPES: tuple[str, ...] = (
    "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool", "bfloat16",
)
"""The dtype of each code a reference carries (the wire's numbering: never reorder, only append)."""
_NUMPY = {code: np.dtype(name) for code, name in enumerate(DTYPES) if name != "bfloat16"}  # native order
_CODES = {dtype: code for code, dtype in _NUMPY.items()}
_BFLOAT16 = DTYPES.index("bfloat16")
_REF = struct.Struct("<iIQBB")  # segment slot, its generation, offset, dtype code, dimensions; then the shape (int64s)


class Segment:
    """One shared-memory file mapped into the service: a slot of its stream (``slot`` -1: one-off)."""

    def __init__(self, slot: int, generation: int, size: int) -> None:
        self.slot, self.generation = slot, generation
        self.size = max(_MIN_SEGMENT, size)
        self.fd = os.memfd_create(f"omnifeed-batch-{slot}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
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
        start = -(-self.needed // _ALIGN) * _ALIGN
        self.needed = start + nbytes
        base = self.segment.base
        if base is None or self.needed > self.segment.size:
            self.overflowed = True
            return np.empty(shape, dtype=dtype)
        return base[start:start + nbytes].view(dtype).reshape(shape)


def grown_size(needed: int) -> int:
    """A segment size for ``needed`` bytes with room to spare (a quarter, rounded to MiB)."""
    return -(-int(needed * 1.25) // (1 << 20)) * (1 << 20)


def encode_batch(batch: Any, segment: Segment) -> Any:
    """The batch with every numpy array replaced by a reference into ``segment`` (a msgpack extension)."""
    if isinstance(batch, np.ndarray):
        return msgpack.ExtType(TENSOR_EXT, _reference(batch, segment))
    if isinstance(batch, dict):
        return {k: encode_batch(v, segment) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [encode_batch(v, segment) for v in batch]
    return batch


def _reference(array: np.ndarray, segment: Segment) -> bytes:
    code = _CODES.get(array.dtype)
    if code is None:
        raise TypeError(f"a batch array of dtype {array.dtype} cannot be handed over; use one of "
                        f"{', '.join(n for n in DTYPES if n != 'bfloat16')} in native byte order")
    nbytes = array.nbytes
    offset = 0 if nbytes == 0 else array.__array_interface__["data"][0] - segment.address
    if nbytes and (not array.flags.c_contiguous or offset < 0 or offset + nbytes > segment.size):
        raise ValueError("a batch array is not in the batch's shared-memory segment (collate with its allocator)")
    return (_REF.pack(segment.slot, segment.generation, offset, code, array.ndim)
            + struct.pack(f"<{array.ndim}q", *array.shape))


def _view(base_of: Callable[[int, int], np.ndarray], code: int, data: bytes) -> tuple[np.ndarray, bool, tuple[int, ...]]:
    """(the numpy view a reference names, whether it is bfloat16 (viewed as raw uint8 bytes), its shape)."""
    if code != TENSOR_EXT or len(data) < _REF.size:
        raise ValueError(f"unknown msgpack extension {code}")
    slot, generation, offset, dtype_code, ndim = _REF.unpack_from(data)
    shape = struct.unpack_from(f"<{ndim}q", data, _REF.size)
    if dtype_code >= len(DTYPES):
        raise ValueError(f"unknown dtype code {dtype_code} in a tensor reference")
    bfloat16 = dtype_code == _BFLOAT16
    dtype = np.dtype(np.uint8) if bfloat16 else _NUMPY[dtype_code]
    raw = (*shape[:-1], 2 * shape[-1]) if bfloat16 and shape else (2,) if bfloat16 else shape
    nbytes = math.prod(raw) * dtype.itemsize
    base = base_of(slot, generation)
    if offset + nbytes > base.size or min(shape, default=0) < 0:
        raise ValueError("a tensor reference points outside its segment")
    if not nbytes:
        return np.empty(raw, dtype=dtype), bfloat16, shape
    # numpy's view and reshape cost a fraction of torch's dispatch
    return base[offset:offset + nbytes].view(dtype).reshape(raw), bfloat16, shape


def array_decoder(base_of: Callable[[int, int], np.ndarray]) -> Callable[[int, bytes], Any]:
    """The msgpack extension hook that turns references into numpy arrays viewing ``base_of(slot, generation)``.

    A bfloat16 reference (numpy has no such dtype) comes back as its raw bytes: uint8 with the
    last dimension doubled.
    """

    def decode(code: int, data: bytes) -> Any:
        return _view(base_of, code, data)[0]

    return decode


def tensor_decoder(base_of: Callable[[int, int], np.ndarray]) -> Callable[[int, bytes], Any]:
    """The msgpack extension hook that turns references into torch tensors viewing ``base_of(slot, generation)``.

    The client's side (a trainer): it imports torch, which the service never does.
    """
    import torch

    def decode(code: int, data: bytes) -> Any:
        array, bfloat16, shape = _view(base_of, code, data)
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16).view(shape) if bfloat16 else tensor

    return decode
