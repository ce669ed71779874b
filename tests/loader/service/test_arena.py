"""A batch through shared memory: whatever nests arrays, strings and numbers comes back as it went, from the frame."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.loader.service._arena import DTYPES, Segment, SegmentWriter, decode_arrays, encode_batch, read_reference
from omnifeed.loader.service._protocol import encode

DTYPE_NAMES = [name for name in DTYPES if name != "bfloat16"]
SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
ARRAYS = st.tuples(st.sampled_from(DTYPE_NAMES), SHAPES, st.integers(0, 2**31))
LEAVES = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8) | st.binary(max_size=8)
VALUES = st.recursive(
    LEAVES | ARRAYS.map(lambda spec: ("array", spec)),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(min_size=1, max_size=4), inner, max_size=4)
        | st.tuples(inner, inner)
    ),
    max_leaves=20,
)


def _made(value: Any, alloc: Any) -> Any:
    """``value`` with each ("array", spec) an array from ``alloc`` (a collate's allocator), filled at random."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "array":
        name, shape, seed = value[1]
        array = alloc(shape, np.dtype(name))
        array[...] = np.random.default_rng(seed).integers(0, 100, shape).astype(name)
        return array
    if isinstance(value, dict):
        return {k: _made(v, alloc) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_made(v, alloc) for v in value)
    return value


def _same(sent: Any, received: Any) -> bool:
    if isinstance(sent, np.ndarray):
        return isinstance(received, np.ndarray) and sent.dtype == received.dtype and np.array_equal(sent, received)
    if isinstance(sent, dict):
        return (
            isinstance(received, dict)
            and list(sent) == list(received)
            and all(_same(v, received[k]) for k, v in sent.items())
        )
    if isinstance(sent, (list, tuple)):  # a tuple travels as a list
        return isinstance(received, list) and len(sent) == len(received) and all(map(_same, sent, received))
    return type(sent) is type(received) and sent == received


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=4), VALUES, max_size=5), st.lists(st.text(max_size=6), max_size=4))
def test_any_batch_comes_back_from_its_frame_as_it_was_sent(fields: dict[str, Any], keys: list[str]) -> None:
    """Arrays in dicts (the layout) and in lists and tuples (references in place), strings, bytes, numbers and None,
    nested any way: the service's own reading of the frame gives the same values, in the same key order."""
    segment = Segment(0, 0, 1 << 20)
    try:
        writer = SegmentWriter(segment)
        batch = {"__key__": keys, **_made({k: v for k, v in fields.items() if k != "__key__"}, writer.alloc)}
        assert not writer.overflowed
        layout, rest = encode_batch(batch, segment)
        frame = encode({"op": "batch", "layout": layout, "batch": rest})
        received = decode_arrays(frame, segment.base)  # the frame as the service sends it (length first)
        assert _same(batch, received)
    finally:
        segment.close()


@given(st.sampled_from(DTYPE_NAMES), SHAPES, st.integers(0, 7), st.integers(0, 2**20))
def test_a_reference_reads_back_its_segment_offset_dtype_and_shape(
    name: str, shape: tuple[int, ...], slot: int, generation: int
) -> None:
    segment = Segment(slot, generation, 1 << 20)
    try:
        rows = SegmentWriter(segment).alloc((7, *shape), np.dtype(name))
        array = rows[3:4].reshape(shape)  # a row: an offset past the segment's start
        layout, _ = encode_batch({"a": array}, segment)
        reference = msgpack.unpackb(layout)[0][1]
        offset = 0 if array.nbytes == 0 else array.ctypes.data - segment.address
        assert read_reference(reference) == (slot, generation, offset, name, shape)
        for cut in (reference[:-1], reference + b"\0", reference[:10]):
            with pytest.raises(ValueError):
                read_reference(cut)
    finally:
        segment.close()
