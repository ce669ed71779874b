"""A PNG's image data inflated by ISA-L, so that the PNG decoder that follows only unfilters.

zlib's inflate was two thirds of a PNG's decode on the training scenario's mix (2.4 of 3.6 ms of
CPU a picture of 160–640 px saved with Pillow's defaults); ISA-L's (python-isal) inflates the same
streams in 0.9 ms. Neither Pillow nor FFmpeg lets another inflate be plugged in, so the file
is rewritten with its IDAT data as *stored* deflate blocks (zlib's copy-through mode, no
compression) and the decoders read that: the same filtered rows, the same pixels, modes and
metadata, every other chunk kept byte for byte. Anything unusual (APNG, a header over a guard,
data that does not inflate to exactly the size the header implies, a cut file) is left to the
decoder with the original bytes, which decodes it or names what is wrong as before.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from isal import isal_zlib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples a pixel
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_STORED_BLOCK = 65535  # the most bytes a stored deflate block holds


@dataclass(frozen=True)
class StoredPng:
    """A PNG rewritten with stored (uncompressed) image data, and what its header says."""

    data: bytes
    width: int
    height: int
    bit_depth: int
    colour_type: int


def _filtered_size(width: int, height: int, bits_per_pixel: int, interlaced: bool) -> int:
    """Bytes of the filtered rows the header implies (a filter byte a row; Adam7's seven passes when interlaced)."""
    passes = _ADAM7 if interlaced else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        columns, rows = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if columns > 0 and rows > 0:
            total += rows * (1 + -(-(columns * bits_per_pixel) // 8))
    return total


def stored_png(data: bytes, max_pixels: float) -> StoredPng | None:
    """``data`` with its image data inflated and stored uncompressed; None: decode the original bytes instead.

    None for anything but a well-formed still PNG of at most ``max_pixels`` whose image data
    inflates (Adler-32 checked) to exactly the filtered rows its header implies.
    """
    if not data.startswith(PNG_SIGNATURE) or len(data) < 33:
        return None
    length, kind = struct.unpack_from(">I4s", data, 8)
    if kind != b"IHDR" or length != 13:
        return None
    width, height, bit_depth, colour_type, _, _, interlace = struct.unpack_from(">IIBBBBB", data, 16)
    if colour_type not in _CHANNELS or not 0 < width * height <= max_pixels or interlace > 1:
        return None
    idats: list[memoryview] = []
    view = memoryview(data)
    first_idat = after_idat = 0
    position = 8
    while position + 12 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        end = position + 12 + length
        if end > len(data):
            return None  # cut inside a chunk
        if kind == b"acTL":
            return None  # APNG: the animation's chunks are the decoder's business
        if kind == b"IDAT":
            if after_idat:
                return None  # IDAT chunks must be consecutive
            first_idat = first_idat or position
            idats.append(view[position + 8 : end - 4])
        elif idats and not after_idat:
            after_idat = position
        position = end
    if not idats or not after_idat:
        return None  # no image data, or nothing after it (not even IEND): a cut file
    expected = _filtered_size(width, height, _CHANNELS[colour_type] * bit_depth, interlace == 1)
    inflater, pieces, budget = isal_zlib.decompressobj(), [], expected + 1  # a bomb stops one byte over
    try:
        for chunk in idats:
            pieces.append(inflater.decompress(chunk, budget))
            budget -= len(pieces[-1])
            if budget == 0:  # max_length 0 would mean no bound
                return None
    except isal_zlib.error:  # type: ignore[misc]  # the stub declares it an instance, not a class
        return None  # corrupt or cut data: the decoder names it
    if budget != 1 or not inflater.eof:
        return None
    return StoredPng(_rewritten(data, first_idat, after_idat, b"".join(pieces)), width, height, bit_depth, colour_type)


def _rewritten(data: bytes, first_idat: int, after_idat: int, rows: bytes) -> bytes:
    """``data`` with its IDAT chunks replaced by one holding ``rows`` as a zlib stream of stored blocks."""
    view = memoryview(rows)
    pieces: list[bytes | memoryview] = [b"\x78\x01"]  # zlib header: deflate, 32 KiB window, no dictionary
    for start in range(0, len(rows), _STORED_BLOCK):
        block = view[start : start + _STORED_BLOCK]
        final = int(start + _STORED_BLOCK >= len(rows))
        pieces += [struct.pack("<BHH", final, len(block), len(block) ^ 0xFFFF), block]
    pieces.append(struct.pack(">I", isal_zlib.adler32(rows)))
    payload = b"".join(pieces)
    crc = isal_zlib.crc32(payload, isal_zlib.crc32(b"IDAT"))
    chunk = struct.pack(">I4s", len(payload), b"IDAT")
    return b"".join((data[:first_idat], chunk, payload, struct.pack(">I", crc), data[after_idat:]))
