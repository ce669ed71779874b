"""Batches from worker processes to the main process through reused shared-memory slots.

torch's workers hand each batch over by moving every tensor into a new shared-memory segment and
passing its file descriptor over a socket, one connection (with an authentication handshake) per
tensor; the main process maps each segment and unmaps it when the batch dies. Here each worker keeps
a few slots (segments it allocated once, ``prefetch_factor + 2`` of them), copies every tensor and
numpy array of a batch into a free slot, and sends a small pickle whose arrays are (offset, dtype,
shape) references into that slot. A slot's file descriptor crosses once, when the slot is created or
grown. The main process builds the batch's tensors as views of its mapping of the slot, without a
copy, and a finalizer frees the slot when the last of them dies. When every slot is taken (the
consumer holds on to many batches) a batch falls back to torch's own path.

``benchmarks/bench_dataloader.py`` measures it against torch's hand-off.
"""

from __future__ import annotations

import io
import multiprocessing.heap
import pickle
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import numpy as np
import torch

_ALIGN = 64


class PackedBatch(NamedTuple):
    """A batch in transit: in slot ``slot`` (``payload`` is a pickle) or as itself (``slot`` is None)."""

    slot: int | None
    storage: torch.UntypedStorage | None  # sent when the slot is new or grown
    payload: Any


def slots_per_worker(prefetch_factor: int) -> int:
    """Slots a worker keeps: its batches in flight plus the two a consumer holds while it steps."""
    return prefetch_factor + 2


def _slot_array(obj: object) -> bool:
    if type(obj) is torch.Tensor:
        return (
            obj.layout is torch.strided and obj.device.type == "cpu" and not obj.requires_grad and not obj.is_quantized
        )
    return type(obj) is np.ndarray and not obj.dtype.hasobject


class _SlotPickler(ForkingPickler):
    """Pickles a batch with its tensors and arrays replaced by references into a slot."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.arrays: list[tuple[Any, int]] = []
        self.size = 0
        self._seen: dict[int, Any] = {}  # the same array twice in a batch is stored once

    def persistent_id(self, obj: Any) -> Any:
        if not _slot_array(obj):
            return None
        if id(obj) in self._seen:
            return self._seen[id(obj)]
        pid = self._place(obj)
        self._seen[id(obj)] = pid
        return pid

    def _place(self, obj: Any) -> Any:
        offset = self.size
        nbytes = obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor) else obj.nbytes
        self.arrays.append((obj, offset))
        self.size = offset + -(-nbytes // _ALIGN) * _ALIGN
        if isinstance(obj, torch.Tensor):
            return ("tensor", offset, nbytes, obj.dtype, tuple(obj.shape))
        return ("ndarray", offset, nbytes, obj.dtype.str if not obj.dtype.fields else obj.dtype, obj.shape)


class SlotFlags:
    """One byte per slot (1 while the slot is in use), in memory the workers share, outside multiprocessing's heap.

    ``RawArray`` allocates from one heap per process whose bookkeeping an exception raised
    asynchronously inside it (Ctrl-C, torch's SIGCHLD handler naming a dead worker) leaves broken
    for every later loader of the process ("pop from empty list"); a mapping of its own has
    nothing to break. It crosses to spawned workers as a file descriptor, as a RawArray does.
    """

    def __init__(self, count: int) -> None:
        self._arena = multiprocessing.heap.Arena(max(count, 1))

    def __getitem__(self, index: int) -> int:
        return self._arena.buffer[index]

    def __setitem__(self, index: int, value: int) -> None:
        self._arena.buffer[index] = value


class SlotWriter:
    """A worker's slots: packs each batch into a free one (``flags[first + k]`` is 1 while slot k is in use)."""

    def __init__(self, flags: Any, first: int, count: int) -> None:
        self._flags = flags
        self._first = first
        self._count = count
        self._slots: list[tuple[torch.UntypedStorage, torch.Tensor, np.ndarray]] = []
        self.fallbacks = 0

    def pack(self, batch: Any) -> PackedBatch:
        """``batch`` ready to send: copied into a free slot, or as itself when none is free."""
        buffer = io.BytesIO()
        pickler = _SlotPickler(buffer)
        pickler.dump(batch)
        if not pickler.arrays:
            return PackedBatch(None, None, batch)
        slot, storage = self._free_slot(pickler.size)
        if slot is None:
            self.fallbacks += 1
            return PackedBatch(None, None, batch)
        _, as_tensor, as_array = self._slots[slot]
        for array, offset in pickler.arrays:
            if isinstance(array, torch.Tensor):
                nbytes = array.numel() * array.element_size()
                as_tensor[offset : offset + nbytes].view(array.dtype).view(array.shape).copy_(array)
            else:
                np.copyto(as_array[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape), array)
        self._flags[self._first + slot] = 1
        return PackedBatch(slot, storage, buffer.getvalue())

    def _free_slot(self, size: int) -> tuple[int | None, torch.UntypedStorage | None]:
        """A free slot of at least ``size`` bytes (grown or created if need be) and its storage if new."""
        free = [k for k in range(len(self._slots)) if not self._flags[self._first + k]]
        fits = [k for k in free if self._slots[k][0].nbytes() >= size]
        if fits:
            return fits[0], None
        if free:
            slot = free[0]
        elif len(self._slots) < self._count:
            slot = len(self._slots)
            self._slots.append(None)  # type: ignore[arg-type]
        else:
            return None, None
        capacity = -(-max(size + size // 4, _ALIGN) // 4096) * 4096
        storage = torch.UntypedStorage._new_shared(capacity)
        as_tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._slots[slot] = (storage, as_tensor, as_tensor.numpy())
        return slot, storage


class _SlotUnpickler(pickle.Unpickler):
    def __init__(self, payload: bytes, lease: np.ndarray) -> None:
        super().__init__(io.BytesIO(payload))
        self._lease = lease
        self._as_tensor: torch.Tensor | None = None
        self._loaded: dict[tuple[Any, ...], Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        kind, offset, nbytes, dtype, shape = pid
        if pid in self._loaded:
            return self._loaded[pid]
        if kind == "tensor":
            if self._as_tensor is None:
                self._as_tensor = torch.from_numpy(self._lease)
            array: Any = self._as_tensor[offset : offset + nbytes].view(dtype).view(shape)
        else:
            array = self._lease[offset : offset + nbytes].view(np.dtype(dtype)).reshape(shape)
        self._loaded[pid] = array
        return array


class SlotReader:
    """The main process's side: maps each worker's slots once, and builds batches as views of them."""

    def __init__(self, flags: Any, per_worker: int) -> None:
        self._flags = flags
        self._per_worker = per_worker
        self._slots: dict[tuple[int, int], torch.Tensor] = {}
        self.shared = 0
        self.fallbacks = 0

    def unpack(self, worker: int, packed: PackedBatch) -> Any:
        """The batch of ``packed``; its tensors and arrays free the slot when the last of them dies."""
        if packed.slot is None:
            self.fallbacks += 1
            return packed.payload
        key = (worker, packed.slot)
        if packed.storage is not None:
            self._slots[key] = torch.empty(0, dtype=torch.uint8).set_(packed.storage)
        lease = self._slots[key].numpy()  # a new array object per batch: the slot's lease
        release = weakref.finalize(lease, self._flags.__setitem__, worker * self._per_worker + packed.slot, 0)
        release.atexit = False
        self.shared += 1
        try:
            return _SlotUnpickler(packed.payload, lease).load()
        finally:
            del lease

    def discard(self, worker: int, packed: PackedBatch) -> None:
        """Drop a batch nobody will see (a stale or skipped task), freeing its slot."""
        if packed.slot is None:
            return
        self.unpack(worker, packed)
        self.shared -= 1
