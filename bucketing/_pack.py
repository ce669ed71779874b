"""Packing one sequence stream of a window into fixed-capacity packs (first-fit decreasing).

A pack is a row of ``capacity`` slots holding slices of several samples' sequences back to
back; attention is kept within each slice with ``cu_seqlens`` (flash-attention's varlen
layout) and positions restart per slice with ``position_ids``. The packing is a pure,
deterministic function of its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class Segment:
    """The slice ``[start, stop)`` of the sequence of the sample at ``position``."""

    position: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        """Number of slots (tokens) of the slice."""
        return self.stop - self.start


@dataclass(frozen=True)
class Pack:
    """One packed row: its segments, in the order they were placed."""

    segments: tuple[Segment, ...]

    @property
    def length(self) -> int:
        """Slots used: the sum of the segments' lengths."""
        return sum(segment.length for segment in self.segments)

    @property
    def positions(self) -> np.ndarray:
        """Sample position of each segment (int64)."""
        return np.array([segment.position for segment in self.segments], dtype=np.int64)

    @property
    def cu_seqlens(self) -> np.ndarray:
        """``[0, cumsum of segment lengths]`` (int32), flash-attention's varlen boundaries."""
        sizes = [segment.length for segment in self.segments]
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int32)

    @property
    def position_ids(self) -> np.ndarray:
        """``arange(start, stop)`` of each segment, concatenated (int64)."""
        parts = [np.arange(segment.start, segment.stop, dtype=np.int64) for segment in self.segments]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class OverlongSampleError(ValueError):
    """A sample is longer than the pack capacity and overlong samples are rejected."""

    def __init__(self, position: int, length: int, capacity: int) -> None:
        super().__init__(
            f"sample at position {position} has length {length} > pack capacity {capacity}: "
            "raise the capacity or set overlong='split'"
        )
        self.position = position
        self.length = length
        self.capacity = capacity

    def __reduce__(self) -> tuple[type[OverlongSampleError], tuple[int, int, int]]:
        return type(self), (self.position, self.length, self.capacity)


class _Packer:
    """First-fit over packs in creation order, tracking each pack's free room."""

    def __init__(self, capacity: int, max_packs: int) -> None:
        self.capacity = capacity
        self.room = np.zeros(max(max_packs, 1), dtype=np.int64)
        self.packs: list[list[Segment]] = []

    def first_fit(self, length: int) -> int:
        """Index of the first pack with ``length`` free slots, or -1."""
        room = self.room[: len(self.packs)]
        index = int(np.argmax(room >= length)) if room.size else 0
        return index if room.size and room[index] >= length else -1

    def put(self, index: int, segment: Segment) -> None:
        """Place ``segment`` in pack ``index``; ``index == len(packs)`` opens a new pack."""
        if index == len(self.packs):
            self.packs.append([])
            self.room[index] = self.capacity
        self.packs[index].append(segment)
        self.room[index] -= segment.length


def _checked(positions: np.ndarray, lengths: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    positions, lengths = np.asarray(positions, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    if positions.ndim != 1 or positions.shape != lengths.shape:
        raise ValueError(
            f"{what}: positions and lengths must be 1-D of one size, got {positions.shape} and {lengths.shape}"
        )
    if np.any(lengths < 0):
        raise ValueError(f"{what}: lengths must be non-negative")
    return positions, lengths


def pack_window(
    positions: np.ndarray,
    lengths: np.ndarray,
    capacity: int,
    *,
    overlong: Literal["reject", "split"] = "reject",
    lookahead_positions: np.ndarray | None = None,
    lookahead_lengths: np.ndarray | None = None,
) -> tuple[list[Pack], int]:
    """Pack a window's samples into packs of ``capacity`` slots; return (packs, lookahead used).

    First-fit decreasing: samples by length descending (ties: input order), each into the
    first pack (creation order) with room, else a new pack. Zero-length samples therefore
    land, as empty segments, in the first pack, even a full one (one is opened if the window
    has none): every sample, or piece of a split one, is in exactly one pack. A sample longer
    than ``capacity`` raises OverlongSampleError (the first in input order) under
    ``overlong="reject"``; under ``"split"`` it becomes ``L // capacity`` full packs of its
    own, opened first in input order, and a remainder ``[k * capacity, L)`` packed like any
    sample. Then the lookahead
    samples are borrowed in order into the first pack with room, stopping at the first that
    fits nowhere or is overlong; no pack is opened for them. Packs come in creation order;
    raises ValueError for ``capacity < 1`` or malformed arrays.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if overlong not in ("reject", "split"):
        raise ValueError(f"overlong must be 'reject' or 'split', got {overlong!r}")
    if (lookahead_positions is None) != (lookahead_lengths is None):
        raise ValueError("give both lookahead_positions and lookahead_lengths, or neither")
    positions, lengths = _checked(positions, lengths, "window")
    too_long = np.flatnonzero(lengths > capacity)
    if too_long.size and overlong == "reject":
        first = int(too_long[0])
        raise OverlongSampleError(int(positions[first]), int(lengths[first]), capacity)
    full = lengths // capacity
    packer = _Packer(capacity, int(full.sum()) + positions.size)
    for i in too_long:
        for k in range(int(full[i])):
            packer.put(len(packer.packs), Segment(int(positions[i]), k * capacity, (k + 1) * capacity))
    rest = np.where(lengths > capacity, lengths % capacity, lengths)
    for i in np.argsort(-rest, kind="stable"):
        if lengths[i] > capacity and rest[i] == 0:
            continue  # split exactly into full packs
        start = int(lengths[i] - rest[i])
        index = packer.first_fit(int(rest[i]))
        packer.put(len(packer.packs) if index < 0 else index, Segment(int(positions[i]), start, int(lengths[i])))
    borrowed = 0
    if lookahead_positions is not None and lookahead_lengths is not None:
        extra_positions, extra_lengths = _checked(lookahead_positions, lookahead_lengths, "lookahead")
        for position, length in zip(extra_positions.tolist(), extra_lengths.tolist()):
            index = packer.first_fit(length)
            if index < 0:
                break
            packer.put(index, Segment(position, 0, length))
            borrowed += 1
    return [Pack(tuple(segments)) for segments in packer.packs], borrowed
