"""PNGs inflated by ISA-L and unfiltered by FFmpeg or Pillow: Pillow's own pixels, and bad input named as before."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFilter

from omnifeed.loader.decode._common import DecodeError
from omnifeed.loader.decode._config import ImageDecodeConfig
from omnifeed.loader.decode._png import stored_png
from omnifeed.loader.decode._registry import decode_image

NATIVE = ImageDecodeConfig(resize="none")
NATIVE_PILLOW = ImageDecodeConfig(resize="none", scaler="pillow")


def _picture(width: int, height: int, mode: str, **save: object) -> bytes:
    """A picture with a photo's gradients and noise, saved by Pillow with its PNG defaults (and ``save``)."""
    rng = np.random.default_rng(width * 31 + height)
    y, x = np.mgrid[0:height, 0:width]
    ramps = np.stack([x * 200 // width, y * 200 // height, (x + y) * 100 // (width + height)], axis=-1)
    noise = Image.fromarray(rng.integers(0, 56, (height, width, 3), dtype=np.uint8)).filter(ImageFilter.GaussianBlur(1))
    image = Image.fromarray((ramps + np.asarray(noise)).astype(np.uint8))
    if mode == "RGBA":
        image.putalpha(Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8)))
    elif mode == "I;16":
        image = Image.fromarray((np.asarray(image.convert("L")).astype(np.uint16) * 257))
    elif mode != "RGB":
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, format="PNG", **save)
    return out.getvalue()


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, body) of every chunk of a PNG."""
    chunks, position = [], 8
    while position < len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        chunks.append((kind, data[position + 8 : position + 8 + length]))
        position += 12 + length
    return chunks


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _interlaced_rgb(pixels: np.ndarray) -> bytes:
    """An Adam7-interlaced 8-bit RGB PNG of ``pixels`` [H, W, 3] (Pillow cannot write one), rows unfiltered."""
    height, width = pixels.shape[:2]
    rows = b""
    for x0, y0, dx, dy in (
        (0, 0, 8, 8),
        (4, 0, 8, 8),
        (0, 4, 4, 8),
        (2, 0, 4, 4),
        (0, 2, 2, 4),
        (1, 0, 2, 2),
        (0, 1, 1, 2),
    ):
        sub = pixels[y0::dy, x0::dx]
        if sub.size:
            rows += b"".join(b"\x00" + row.tobytes() for row in sub)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 1)
    body = _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


@pytest.mark.parametrize(
    ("mode", "save"),
    [
        ("RGB", {}),
        ("L", {}),
        ("RGBA", {}),
        ("LA", {}),
        ("P", {}),
        ("P", {"transparency": 3}),
        ("1", {}),
        ("I;16", {}),
        ("RGB", {"compress_level": 9}),
        ("RGB", {"optimize": True}),
        ("RGB", {"compress_level": 0}),
    ],
)
def test_a_png_of_any_mode_decodes_to_pillows_own_pixels(mode: str, save: dict[str, object]) -> None:
    data = _picture(333, 250, mode, **save)  # ~250 KB of rows: several IDAT chunks
    assert np.array_equal(decode_image(data, NATIVE), decode_image(data, NATIVE_PILLOW))
    assert stored_png(data, 10**9) is not None, "every Pillow-written still PNG takes the inflated path"


def test_an_interlaced_png_decodes_to_its_pixels() -> None:
    pixels = np.random.default_rng(5).integers(0, 256, (37, 29, 3), dtype=np.uint8)
    data = _interlaced_rgb(pixels)
    assert np.array_equal(decode_image(data, NATIVE), pixels.transpose(2, 0, 1))
    assert np.array_equal(decode_image(data, NATIVE_PILLOW), pixels.transpose(2, 0, 1))


@pytest.mark.parametrize("crop", ["none", "center"])
@pytest.mark.parametrize("mode", ["RGB", "L", "P"])
def test_a_resized_png_is_the_resize_of_pillows_pixels(crop: str, mode: str) -> None:
    data = _picture(640, 427, mode)
    config = ImageDecodeConfig(crop=crop)  # type: ignore[arg-type]
    with Image.open(io.BytesIO(data)) as image:  # Pillow's pixels, handed over as an uncompressed BMP (Pillow's path)
        plain = io.BytesIO()
        (image if image.mode in ("RGB", "L") else image.convert("RGB")).save(plain, format="BMP")
    assert np.array_equal(decode_image(data, config), decode_image(plain.getvalue(), config))


def test_the_rewritten_file_keeps_every_other_chunk_byte_for_byte() -> None:
    data = _picture(200, 150, "RGB", dpi=(300, 300), icc_profile=b"\x00" * 64)
    stored = stored_png(data, 10**9)
    assert stored is not None and (stored.width, stored.height, stored.bit_depth, stored.colour_type) == (
        200,
        150,
        8,
        2,
    )
    before, after = _chunks(data), _chunks(stored.data)
    assert [c for c in before if c[0] != b"IDAT"] == [c for c in after if c[0] != b"IDAT"]
    (idat,) = [body for kind, body in after if kind == b"IDAT"]
    assert len(idat) > 150 * (1 + 3 * 200)  # stored: every filtered row as it is, plus the blocks' headers
    with Image.open(io.BytesIO(stored.data)) as rewritten, Image.open(io.BytesIO(data)) as original:
        assert np.array_equal(np.asarray(rewritten), np.asarray(original)) and rewritten.info == original.info


def test_an_animated_png_decodes_its_first_frame_as_pillow_does() -> None:
    out = io.BytesIO()
    first, second = Image.new("RGB", (40, 30), "red"), Image.new("RGB", (40, 30), "blue")
    first.save(out, format="PNG", save_all=True, append_images=[second])
    assert stored_png(out.getvalue(), 10**9) is None
    assert np.array_equal(decode_image(out.getvalue(), NATIVE), decode_image(out.getvalue(), NATIVE_PILLOW))


def _damaged() -> dict[str, bytes]:
    data = _picture(120, 90, "RGB")
    idat = data.index(b"IDAT") + 4
    flipped = bytearray(data)
    flipped[idat + 200] ^= 0xFF
    return {
        "cut in its image data": data[: idat + 300],
        "cut before IEND": data[:-12],
        "a flipped byte in its image data": bytes(flipped),
        "image data inflating past its header's size": _inflation_bomb(10, 20, 2**20),
    }


def _inflation_bomb(width: int, height: int, rows_bytes: int) -> bytes:
    """An 8-bit RGB PNG of ``width × height`` whose image data inflates to ``rows_bytes`` of zeros (unfiltered rows)."""
    header = _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    data = zlib.compress(bytes(rows_bytes), 9)
    return b"\x89PNG\r\n\x1a\n" + header + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


@pytest.mark.parametrize("case", list(_damaged()))
def test_a_damaged_png_fails_or_decodes_as_it_did_through_pillow(case: str) -> None:
    data = _damaged()[case]
    assert stored_png(data, 10**9) is None, "damage sends the original bytes to Pillow"
    outcomes = []
    for config in (NATIVE, NATIVE_PILLOW):
        try:
            outcomes.append(decode_image(data, config, key="k").tobytes())
        except DecodeError as exc:
            assert exc.key == "k"
            outcomes.append(exc.reason)
    assert outcomes[0] == outcomes[1]


def test_a_png_over_max_pixels_is_refused_from_its_header() -> None:
    with pytest.raises(DecodeError) as caught:
        decode_image(_picture(64, 48, "RGB"), ImageDecodeConfig(max_pixels=64 * 48 - 1), key="big")
    assert (caught.value.reason, caught.value.key) == ("bomb", "big")


def test_image_data_inflating_past_its_header_is_not_inflated_past_it() -> None:
    """A deflate bomb: 200 MB of zeros in a 200 KB PNG that declares 10 × 20 pixels. ISA-L inflates at most the 620
    bytes of rows the header implies plus one; Pillow's path then decodes the rows it needs and no more."""
    bomb = _inflation_bomb(10, 20, 200 * 2**20)
    assert len(bomb) < 300_000 and stored_png(bomb, 10**9) is None
    assert decode_image(bomb, NATIVE).shape == (3, 20, 10)
