"""Fuzzing the decoders: random bytes and random damage to valid files give a value or a DecodeError, nothing else.

The first tests call the decode functions with small output sizes; the entry-point tests go through
`make_decoder(modality, DecodeConfig())` with the default config, as the feed's worker pools do.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnifeed.loader.decode._config import (
    AudioDecodeConfig,
    DecodeConfig,
    ImageDecodeConfig,
    TextDecodeConfig,
    VideoDecodeConfig,
)
from omnifeed.loader.decode._registry import (
    REASONS,
    DecodeError,
    decode_audio,
    decode_image,
    decode_text,
    decode_video,
    make_decoder,
)
from omnifeed.tools._demo_data import encode_flac, encode_image, encode_video

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


def _check_image(data: bytes) -> None:
    out = decode_image(data, ImageDecodeConfig(size=32, max_size=64))
    assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[0] == 3


def _check_video(data: bytes) -> None:
    out = decode_video(data, VideoDecodeConfig(size=32, max_size=64, num_frames=4, max_decoded_frames=500))
    assert out.dtype == np.uint8 and out.ndim == 4 and out.shape[1] == 3 and 1 <= out.shape[0] <= 4


def _check_audio(data: bytes) -> None:
    out = decode_audio(data, AudioDecodeConfig(max_seconds=30))
    assert out.dtype == np.float32 and out.ndim == 2 and out.shape[0] == 1
    assert float(np.abs(out).max()) <= 1.0


def _check_text(data: bytes) -> None:
    text, ids = decode_text(data, TextDecodeConfig(max_tokens=4096))
    assert isinstance(text, str) and ids.dtype == np.int64


CHECKS: dict[str, Callable[[bytes], None]] = {
    "image": _check_image,
    "video": _check_video,
    "audio": _check_audio,
    "text": _check_text,
}


def _value_or_decode_error(check: Callable[[bytes], None], data: bytes) -> None:
    try:
        check(data)
    except DecodeError as exc:
        assert exc.reason in REASONS


@functools.cache
def _valid(kind: str) -> bytes:
    if kind == "jpeg":
        return encode_image(64, 48, "jpg")
    if kind == "png":
        return encode_image(40, 30, "png")
    if kind == "mp4":
        return encode_video(6, 32, 24, 10)
    return encode_flac(0.5, 16000, 1)


_DECODER_OF = {"jpeg": "image", "png": "image", "mp4": "video", "flac": "audio"}


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.binary(max_size=2048), modality=st.sampled_from(sorted(CHECKS)))
def test_random_bytes_give_a_value_or_a_decode_error(data: bytes, modality: str) -> None:
    _value_or_decode_error(CHECKS[modality], data)


@pytest.mark.timeout(120)
@FUZZ
@given(
    kind=st.sampled_from(sorted(_DECODER_OF)),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=12),
    keep=st.floats(0.05, 1.0),
)
def test_damaged_valid_files_give_a_value_or_a_decode_error(
    kind: str, flips: list[tuple[float, int]], keep: float
) -> None:
    data = bytearray(_valid(kind))
    for where, value in flips:
        data[int(where * len(data))] = value
    _value_or_decode_error(CHECKS[_DECODER_OF[kind]], bytes(data[: max(1, int(len(data) * keep))]))


@pytest.mark.timeout(60)
@FUZZ
@given(points=st.lists(st.integers(0, 0x10FFFF).filter(lambda c: not 0xD800 <= c < 0xE000), max_size=200))
def test_any_utf8_text_round_trips(points: list[int]) -> None:
    text = "".join(map(chr, points))
    decoded, ids = decode_text(text.encode("utf-8"), TextDecodeConfig(tokenizer="bytes"))
    assert decoded == text and bytes(ids.tolist()) == text.encode("utf-8")


ENTRY_POINTS = {modality: make_decoder(modality, DecodeConfig()) for modality in ("image", "video", "audio", "text")}


def _entry_point_value_or_decode_error(modality: str, data: bytes) -> None:
    """``make_decoder(modality, DecodeConfig())`` on ``data``: a value, or a DecodeError naming the key."""
    try:
        value = ENTRY_POINTS[modality](data, "fuzz/key-1")
    except DecodeError as exc:
        assert exc.reason in REASONS and exc.key == "fuzz/key-1" and exc.modality == modality
        assert "'fuzz/key-1'" in str(exc)
        return
    if modality == "text":
        assert isinstance(value, tuple) and isinstance(value[0], str)
    else:
        assert isinstance(value, np.ndarray) and value.size > 0


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.binary(max_size=2048), modality=st.sampled_from(sorted(ENTRY_POINTS)))
def test_every_decoder_entry_point_gives_a_value_or_a_decode_error_naming_the_key(data: bytes, modality: str) -> None:
    _entry_point_value_or_decode_error(modality, data)


@pytest.mark.timeout(120)
@FUZZ
@given(
    kind=st.sampled_from(sorted(_DECODER_OF)),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=12),
    keep=st.floats(0.05, 1.0),
    into=st.sampled_from(["image", "video", "audio", "text"]),
)
def test_damaged_valid_files_through_any_entry_point_give_a_value_or_a_decode_error(
    kind: str, flips: list[tuple[float, int]], keep: float, into: str
) -> None:
    data = bytearray(_valid(kind))
    for where, value in flips:
        data[int(where * len(data))] = value
    _entry_point_value_or_decode_error(into, bytes(data[: max(1, int(len(data) * keep))]))


def _png(width: int, height: int, depth: int, colour: int, interlace: int, body: bytes) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, interlace)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


_SMALL_GUARD = make_decoder("image", DecodeConfig.model_validate({"image": {"max_pixels": 2**22}}))  # 4 Mpx: the test
# stays small in memory; the default guard (Pillow's 89 Mpx) is the same code with a larger number
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}  # colour type: bit depths


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@FUZZ
@given(
    width=st.one_of(st.integers(0, 64), st.integers(0, 2**31 - 1)),
    height=st.one_of(st.integers(0, 64), st.integers(0, 2**31 - 1)),
    depth=st.sampled_from([1, 2, 4, 8, 16, 3, 0]),
    colour=st.sampled_from([0, 2, 3, 4, 6, 1, 7]),
    interlace=st.sampled_from([0, 1, 2]),
    rows=st.binary(max_size=64),
)
def test_png_headers_declaring_any_size_and_format_give_a_value_or_a_decode_error(
    width: int, height: int, depth: int, colour: int, interlace: int, rows: bytes
) -> None:
    data = _png(width, height, depth, colour, interlace, zlib.compress(rows * 8))
    try:
        _SMALL_GUARD(data, "k")
    except DecodeError as exc:
        valid_header = depth in _PNG_DEPTHS.get(colour, ()) and interlace in (0, 1) and width and height
        if valid_header and width * height > 2**22:
            assert exc.reason == "bomb"  # refused from the header, whatever the pixel data
