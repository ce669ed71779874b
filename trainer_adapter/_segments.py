"""The client's side of the batch hand-off: segments mapped once, a batch's tensors built once per (segment, layout).

A batch frame names its segment, a **layout** (where each array of the batch sits: a path of
dict keys, offset, dtype, shape) and the rest of the batch (keys, info, strings). The service
keeps a few segments per stream and reuses them, so the same layout comes back in the same
segment batch after batch: a `KeptSegment` builds the layout's tensors (views of one torch
storage over the mapping) the first time, and hands the same tensor objects out again after,
merged into each batch's fresh dicts. Taking a batch then costs a dict update per nested dict,
whatever the number of tensors or their size.

A batch is given back to the service (its number in the next request) when the trainer holds
nothing of it: no Python reference to its tensors beyond the client's own, no other tensor
sharing them (autograd, DLPack: the tensors' use counts), no view, array or storage object of
the segment's memory (the storage's use count and its Python object's references); the client
checks its batches out at each request (`Handoff.released_to`). A segment whose tensors the
trainer changed in place (``_version``) or marked ``requires_grad`` gets them built afresh.

A one-off segment (the trainer held every kept one) is mapped for its batch alone: fresh
tensors, and a finalizer on the mapping gives the batch back when the last of them goes, so
its memory follows the trainer's references as with a DataLoader. Where torch lacks the use
counts (they are private API), every batch is built that way.
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from omnifeed.loader.service import (
    DTYPES,
    MAX_REPLY_BYTES,
    FrameReader,
    ProtocolError,
    batch_hook,
    build_template,
    decode,
    merge,
    read_layout,
    read_reference,
)

if TYPE_CHECKING:
    import socket

    import torch


def _counts_available() -> bool:
    import torch

    return hasattr(torch._C, "_storage_Use_Count") and hasattr(torch.Tensor, "_use_count")


class SegmentView:
    """Tensors of any dtype as views of one torch storage over a mapped segment."""

    def __init__(self, mapped: mmap.mmap, slot: int, generation: int, eager: bool = False) -> None:
        import torch

        self.slot, self.generation, self.size = slot, generation, len(mapped)
        self.base = np.frombuffer(mapped, dtype=np.uint8)
        self.bytes = torch.from_numpy(self.base)
        self._typed: dict[str, torch.Tensor] = {}
        if eager:  # every view the client makes later would move the storage's use count off its baseline
            for name in DTYPES:
                self._view_as(name)

    def _view_as(self, name: str) -> torch.Tensor:
        typed = self._typed.get(name)
        if typed is None:
            import torch

            typed = self._typed[name] = self.bytes.view(getattr(torch, name))
        return typed

    def tensor(self, ref: bytes) -> torch.Tensor:
        """The tensor a reference names (ProtocolError: another segment's, or outside this one)."""
        try:
            slot, generation, offset, dtype, shape = read_reference(ref)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if (slot, generation) != (self.slot, self.generation):
            raise ProtocolError(
                f"a tensor reference to segment {slot}/{generation} in a batch of {self.slot}/{self.generation}"
            )
        typed = self._view_as(dtype)
        itemsize = typed.element_size()
        strides, numel = [], 1
        for size in reversed(shape):
            strides.append(numel)
            numel *= size
        if offset % itemsize or offset + numel * itemsize > self.size:
            raise ProtocolError("a tensor reference points outside its segment")
        return typed.as_strided(shape, strides[::-1], offset // itemsize)


_KEPT_LAYOUTS = 32
"""Layouts a kept segment remembers with their tensors: a batch whose sizes vary (text lengths) moves the arrays after
the varying one, so the same few layouts come back in turn; a layout seen before costs no tensor then."""
_KEPT_TENSORS = 256
"""Tensors a kept segment remembers by reference, across its layouts (a new layout builds only its new ones)."""


class KeptSegment:
    """A segment of the stream, mapped for as long as the service keeps it, with the tensors of its recent layouts."""

    def __init__(self, mapped: mmap.mmap, slot: int, generation: int) -> None:
        import torch

        self.view = SegmentView(mapped, slot, generation, eager=True)
        self._bytes = self.view.bytes  # its version counter is every view's: an in-place change shows there
        self._storage = self._bytes.untyped_storage()  # its Python object: a trainer may hold that too
        self._pointer = self._storage._cdata
        self._use_count = torch._C._storage_Use_Count
        self.layout: bytes | None = None
        self._template: Any = ({}, {})
        self._tensors: tuple[torch.Tensor, ...] = ()
        self._floating: tuple[torch.Tensor, ...] = ()
        self._layouts: dict[bytes, tuple[Any, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        self._by_ref: dict[bytes, torch.Tensor] = {}
        self._baseline: tuple[Any, ...] = ()
        self._version = 0

    def assemble(self, rest: dict[str, Any], layout: bytes, made: int) -> dict[str, Any]:
        """The batch: ``rest`` (decoded) and the layout's tensors in new dicts; the tensors built once, reused while
        intact.

        ``made``: tensors of this segment the batch holds outside its layout (in lists), made while decoding it.
        """
        if layout != self.layout or not self._intact():
            self._switch(layout)
            self._baseline = self._counts(made)
        return merge(rest, self._template)

    def held(self) -> bool:
        """Whether anything outside the client still refers to the segment's memory (its last batch is not back).

        The Python reference counts first: a batch the trainer still holds fails there, before any call into torch.
        """
        use, storage_refs, refs, uses = self._baseline
        if [sys.getrefcount(t) for t in self._tensors] != refs or sys.getrefcount(self._storage) != storage_refs:
            return True
        if self._use_count(self._pointer) != use:
            return True
        return [t._use_count() for t in self._tensors] != uses  # type: ignore[attr-defined]

    def _counts(self, made: int = 0) -> tuple[Any, ...]:
        """What refers to the segment: ``made`` of its storage's users are the frame's own tensors outside the
        layout."""
        return (  # the same expressions as `held`: a reference count counts the references the expression makes
            self._use_count(self._pointer) - made,
            sys.getrefcount(self._storage),
            [sys.getrefcount(t) for t in self._tensors],
            [t._use_count() for t in self._tensors],  # type: ignore[attr-defined]
        )

    def _intact(self) -> bool:
        """No tensor of the segment was changed in place (data or shape) or set to require grad."""
        if self._bytes._version != self._version:
            return False
        return not self._floating or not any(t.requires_grad for t in self._floating)

    def _switch(self, layout: bytes) -> None:
        """Make ``layout`` the current one: remembered, or built (from remembered tensors where its references
        match)."""
        if not self._intact():  # the trainer changed a tensor: none is handed out again
            self._layouts.clear()
            self._by_ref.clear()
        self.layout, self._template, self._tensors, self._floating = None, ({}, {}), (), ()
        built = self._layouts.pop(layout, None)
        if built is None:
            built = self._build(layout)
            if len(self._layouts) >= _KEPT_LAYOUTS:
                del self._layouts[next(iter(self._layouts))]  # the least recently used
        self._layouts[layout] = built  # most recent last
        self.layout = layout
        self._template, self._tensors, self._floating = built
        self._version = self._bytes._version

    def _build(self, layout: bytes) -> tuple[Any, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        entries = read_layout(layout)  # a malformed layout raises before anything changes
        by_ref = self._by_ref

        def make(ref: bytes) -> torch.Tensor:
            tensor = by_ref.get(ref)
            if tensor is None:
                tensor = self.view.tensor(ref)
                if len(by_ref) >= _KEPT_TENSORS:
                    by_ref.clear()  # layouts keep their own; later ones build again
                by_ref[ref] = tensor
            return tensor

        template, tensors = build_template(entries, make)
        return template, tuple(tensors), tuple(t for t in tensors if t.is_floating_point())


class Handoff:
    """A client's batches from its service: frames read, segments mapped once, batches given back when dropped."""

    def __init__(self) -> None:
        # (service instance, batch number) of batches the trainer dropped: one deque for the client's life, since
        # finalizers registered long ago append to it
        self.released: deque[tuple[str, int]] = deque()
        self._kept: dict[tuple[int, int], KeptSegment | mmap.mmap] = {}  # mmap: use counts unavailable
        self._leases: list[tuple[str, int, KeptSegment]] = []  # batches of kept segments the trainer may hold
        self._reader = FrameReader()
        self._fds: list[int] = []
        self._fresh: SegmentView | None = None  # the batch's own view (a one-off segment, or no use counts)
        self._made = 0  # tensors the frame being decoded made in lists (outside its layout)
        self._hook = batch_hook(self._inline)
        self._counts: bool | None = None  # whether torch has the use counts (looked up with the first segment)

    def receive(self, sock: socket.socket, service: str) -> dict[str, Any]:
        """The next reply on ``sock``: a batch with its tensors in place, or any other reply as it came."""
        body, self._fds = self._reader.receive(sock, MAX_REPLY_BYTES)
        try:
            message = decode(body, self._hook)
            if message["op"] == "batch":
                self._assemble(message, service)
        finally:
            body.release()
            if self._fds:
                for fd in self._fds:  # sent but not referred to: nothing to map
                    os.close(fd)
                self._fds = []
            self._fresh, self._made = None, 0
        return message

    def released_to(self, service: str) -> list[int]:
        """Numbers of the batches of ``service`` the trainer dropped since the last call (checks the held ones)."""
        if self._leases:
            held = []
            for lease in self._leases:
                if lease[2].held():
                    held.append(lease)
                else:
                    self.released.append((lease[0], lease[1]))
            self._leases = held
        released = []
        while self.released:
            owner, seq = self.released.popleft()
            if owner == service:
                released.append(seq)
        return released

    def mapped(self) -> int:
        """Segments of the stream kept mapped."""
        return len(self._kept)

    def forget_all(self) -> None:
        """Let go of every segment (a new connection: its stream sends each anew); batches held keep their memory."""
        self._kept.clear()

    def _assemble(self, message: dict[str, Any], service: str) -> None:
        if "forget" in message:  # segments the service gave up: unmap (live tensors keep theirs)
            for forgotten in message["forget"] or ():
                self._kept.pop((int(forgotten[0]), int(forgotten[1])), None)
        segment, layout, seq, rest = message["segment"], message["layout"], message["seq"], message["batch"]
        slot, generation = segment[0], segment[1]
        if type(slot) is not int or type(generation) is not int or type(seq) is not int:
            raise ProtocolError("a batch frame whose segment or number is not an integer")
        if type(layout) is not bytes or type(rest) is not dict:
            raise ProtocolError("a batch frame without a layout or a batch")
        kept = None
        if layout or self._made:
            kept = self._kept.get((slot, generation)) or self._segment(slot, generation)  # mostly the look-up alone
        if type(kept) is KeptSegment and self._fresh is None:
            message["batch"] = kept.assemble(rest, layout, self._made)
            self._leases.append((service, seq, kept))
            return
        view = self._fresh_view(slot, generation) if layout or self._made else None
        if view is None:  # no tensor in it (meta fields only): nothing to wait for
            self.released.append((service, seq))
            return
        message["batch"] = merge(message["batch"], build_template(read_layout(layout), view.tensor)[0])
        weakref.finalize(view.base, self.released.append, (service, seq))

    def _inline(self, ref: bytes) -> torch.Tensor:
        """A tensor a batch holds in a list (outside its layout): a view of the kept segment, or of the batch's own."""
        self._made += 1
        try:
            slot, generation = read_reference(ref)[:2]
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        kept = self._segment(slot, generation)
        if isinstance(kept, KeptSegment) and self._fresh is None:
            return kept.view.tensor(ref)
        return self._fresh_view(slot, generation).tensor(ref)

    def _segment(self, slot: int, generation: int) -> KeptSegment | mmap.mmap | None:
        """The kept segment (slot, generation), mapped from the descriptor that came with this frame if new; None for a
        one-off segment."""
        if slot < 0:
            return None
        kept = self._kept.get((slot, generation))
        if kept is None:
            mapped = self._map_pending(slot, generation)
            for old in [k for k in self._kept if k[0] == slot]:
                del self._kept[old]  # a grown segment replaces the slot; live tensors keep the old map
            if self._counts is None:
                self._counts = _counts_available()
            kept = self._kept[(slot, generation)] = KeptSegment(mapped, slot, generation) if self._counts else mapped
        return kept

    def _fresh_view(self, slot: int, generation: int) -> SegmentView:
        if self._fresh is None:
            kept = self._segment(slot, generation)
            mapped = kept if isinstance(kept, mmap.mmap) else self._map_pending(slot, generation)
            self._fresh = SegmentView(mapped, slot, generation)
        return self._fresh

    def _map_pending(self, slot: int, generation: int) -> mmap.mmap:
        if not self._fds:
            raise ProtocolError(f"the service referred to segment {slot}/{generation} without sending it")
        fd = self._fds.pop(0)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
