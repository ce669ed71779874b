"""Decoded values as cache entries: what decoders return comes back equal; a bad entry is a miss, never code run."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifeed.loader.feed import encode_decoded
from omnifeed.loader.feed._decoded_codec import DecodedEntryError, decode_decoded

U64 = struct.Struct("<Q")


def array_entry(dtype: str, shape: tuple[int, ...], data: bytes = b"") -> bytes:
    """An entry holding one array, written by hand (to forge what the encoder would never write)."""
    name = dtype.encode()
    return b"OFD1T" + bytes([len(name)]) + name + bytes([len(shape)]) + b"".join(U64.pack(n) for n in shape) + data


def assert_same(got: object, expected: object) -> None:
    assert type(got) is type(expected)
    if isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert np.array_equal(got, expected, equal_nan=expected.dtype.kind in "fc")
        assert got.flags.writeable and got.flags.c_contiguous, "a fresh array, not a view of the entry"
    elif isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected)
        for a, b in zip(got, expected):
            assert_same(a, b)
    else:
        assert got == expected


DECODER_OUTPUTS = {
    "image": np.arange(3 * 5 * 7, dtype=np.uint8).reshape(3, 5, 7),  # (C, H, W) uint8
    "video": np.full((4, 3, 2, 2), 200, dtype=np.uint8),  # (T, C, H, W) uint8
    "audio": np.linspace(-1, 1, 2 * 11, dtype=np.float32).reshape(2, 11),  # (channels, samples) float32
    "text": ("héllo wörld ✓", np.array([104, 233, 108, 2**40], dtype=np.int64)),  # (text, token ids)
    "meta": b'{"label": 3}\x00\xff',
}


@pytest.mark.parametrize("modality", DECODER_OUTPUTS)
def test_what_each_decoder_returns_comes_back_equal(modality: str) -> None:
    value = DECODER_OUTPUTS[modality]
    assert_same(decode_decoded(encode_decoded(value)), value)


@pytest.mark.parametrize(
    "dtype",
    [
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        ">i2",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        ">f4",
        "float64",
        "complex64",
        "complex128",
        "V3",
    ],
)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (1,), (7,), (2, 3, 4)])
def test_arrays_of_every_plain_dtype_and_shape_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    array = np.frombuffer(rng.bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize), dtype=dtype).reshape(shape)
    assert_same(decode_decoded(encode_decoded(array)), array)


def test_a_zero_dimensional_array_keeps_its_shape() -> None:
    assert_same(decode_decoded(encode_decoded(np.array(7, dtype=np.int64))), np.array(7, dtype=np.int64))


def test_a_non_contiguous_array_is_stored_as_its_values() -> None:
    array = np.arange(24, dtype=np.int32).reshape(4, 6)[::2, ::-3]
    assert_same(decode_decoded(encode_decoded(array)), np.ascontiguousarray(array))


@settings(max_examples=60, deadline=None)
@given(
    st.recursive(
        st.text()
        | st.binary()
        | st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8).map(lambda v: np.array(v, np.int32)),
        lambda inner: st.lists(inner, max_size=4).map(tuple),
        max_leaves=12,
    )
)
def test_nested_tuples_of_strings_bytes_and_arrays_round_trip(value: object) -> None:
    assert_same(decode_decoded(encode_decoded(value)), value)


@pytest.mark.parametrize(
    "value,what",
    [
        (np.array([{"a": 1}, None], dtype=object), "array of Python objects"),
        ([1, 2], "type list"),
        ({"a": 1}, "type dict"),
        (3, "type int"),
        (tuple(range(256)), "type tuple"),
    ],
)
def test_values_that_cannot_be_stored_without_pickle_are_refused(value: object, what: str) -> None:
    with pytest.raises(TypeError, match=what):
        encode_decoded(value)


def test_every_cut_short_entry_is_a_decoded_entry_error() -> None:
    entry = encode_decoded(("caption", np.arange(6, dtype=np.float32).reshape(2, 3), b"meta"))
    for end in range(len(entry)):
        with pytest.raises(DecodedEntryError):
            decode_decoded(entry[:end])
    with pytest.raises(DecodedEntryError, match="trailing bytes"):
        decode_decoded(entry + b"\0")


@pytest.mark.parametrize(
    "entry,reason",
    [
        (b"OFD1X", "unknown tag"),
        (b"OFD1S" + U64.pack(2) + b"\xff\xfe", "utf-8"),
        (b"OFD1S" + U64.pack(2**64 - 1), "cut short"),
        (array_entry("no-such-dtype", ()), "not understood"),
        (array_entry("<i4", (2**32, 2**32)), "malformed"),  # a shape whose element count overflows 64 bits
        (array_entry("<i4", (3,), b"\0" * 8), "cut short"),
        (array_entry("(2,)<i4", (1,), b"\0" * 8), "malformed"),  # a sub-array dtype would change the shape
    ],
)
def test_a_malformed_entry_is_a_decoded_entry_error(entry: bytes, reason: str) -> None:
    with pytest.raises(DecodedEntryError, match=reason):
        decode_decoded(entry)


def test_a_deeply_nested_entry_is_a_decoded_entry_error() -> None:
    with pytest.raises(DecodedEntryError):
        decode_decoded(b"OFD1" + b"U\x01" * 100_000 + b"S" + U64.pack(0))


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, ("raise SystemExit('unpickled')",))


@pytest.mark.parametrize(
    "entry",
    [
        pickle.dumps(_Exploit()),  # another job's cache wrote a pickle
        b"OFD1" + pickle.dumps(_Exploit()),
        array_entry("|O", (1,), b"\0" * 8),  # object arrays hold pointers: refused before a byte is read
        array_entry("[('a', 'O')]", (1,), b"\0" * 8),
    ],
)
def test_an_entry_is_never_unpickled(entry: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the codec called the unpickler")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    with pytest.raises(DecodedEntryError):
        decode_decoded(entry)
