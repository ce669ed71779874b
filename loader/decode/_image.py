"""Images with Pillow (JPEGs with libjpeg-turbo) and libswscale: bytes → uint8 [3, H, W] RGB, resized by policy.

- Format: only ``config.formats`` are identified (others are 'corrupt'; a multi-picture
  JPEG, MPO, counts as JPEG); the first frame of animated or multi-page files.
- Guard: ``width × height`` from the header over ``config.max_pixels`` is 'bomb' before any
  pixel is decoded (Pillow's own guard, ``PIL.Image.MAX_IMAGE_PIXELS`` × 2, raises 'bomb' too).
- Colour: palette, grey, grey+alpha, RGBA, CMYK and YCbCr become RGB; alpha is dropped
  (not composited); 16-bit grey keeps its high byte; float ('F') is clipped to 0–255.
- Orientation: the EXIF orientation tag is NOT applied, so sizes agree with the index and
  the cost model, which measure the stored pixels.
- Resize: `resized_size` (the cost model's arithmetic); ``crop='center'`` resizes the centred
  square of the source straight to ``size × size`` (one resample, no intermediate image).
  JPEG draft mode (``config.draft``, on by default) lets libjpeg decode at 1/2, 1/4 or 1/8 scale
  (in the DCT domain) when that is still at least the target size; the output size never
  changes, the pixels a little (0.4 levels on average); off, with ``scaler='pillow'``, they
  are Pillow's plain decode and resize exactly.
- Scaler (``config.scaler``): 'ffmpeg' (default) scales with libswscale straight into planar RGB,
  within a level or two of Pillow's resize on photos, and decodes colour or grey JPEGs with
  libjpeg-turbo through simplejpeg straight into an array (Pillow's own pixels, draft rule
  included; anything else, or anything libjpeg-turbo warns about, goes through Pillow). A PNG's
  data is inflated by ISA-L (`_png`), then 8-bit RGB and grey unfiltered by FFmpeg, others by Pillow:
  the file's own rows, Pillow's pixels. A centre crop whose box falls between pixels is resized by
  Pillow. 'pillow': Pillow throughout.
- Errors: 'empty' (no bytes), 'truncated' (Pillow: "image file is truncated", or end of
  data), 'bomb', 'corrupt' (anything else Pillow rejects), 'unsupported' (a pixel mode
  that has no RGB conversion). ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES = True`` (a global
  Pillow switch) would make truncated files decode grey-filled instead.
"""

from __future__ import annotations

import io
import logging
import math
import mmap

import av
import numpy as np
import simplejpeg
from av.video.reformatter import VideoReformatter
from PIL import Image

from ._common import SWSCALE_INTERPOLATION, DecodeError, center_square, plane_rows, resized_size
from ._config import ImageDecodeConfig
from ._png import StoredPng, stored_png

logger = logging.getLogger(__name__)

_EXPORTS_ARROW = hasattr(Image.Image, "__arrow_c_array__")  # Pillow 11.2 and newer
_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


def image_error(exc: Exception, key: str) -> DecodeError:
    """The `DecodeError` for an exception Pillow raised on ``key``'s bytes."""
    if isinstance(exc, Image.DecompressionBombError):
        return DecodeError(f"Pillow refused the header: {exc}", key, "image", "bomb")
    if isinstance(exc, Image.UnidentifiedImageError):
        return DecodeError("not an image in an accepted format", key, "image", "corrupt")
    text = f"{type(exc).__name__}: {exc}"
    reason = "truncated" if isinstance(exc, EOFError) or "truncated" in str(exc) else "corrupt"
    return DecodeError(text, key, "image", reason)


def checked_size(image: Image.Image, max_pixels: int, key: str) -> tuple[int, int]:
    """(width, height) from an opened image's header; 'corrupt' if empty, 'bomb' if too large."""
    width, height = image.size
    if width < 1 or height < 1:
        raise DecodeError(f"header declares a {width}x{height} image", key, "image", "corrupt")
    _check_pixels(width, height, max_pixels, key)
    return width, height


def _check_pixels(width: int, height: int, max_pixels: int, key: str) -> None:
    if width * height > max_pixels:
        raise DecodeError(
            f"header declares {width}x{height} = {width * height} pixels, over max_pixels = {max_pixels}",
            key,
            "image",
            "bomb",
        )


def output_geometry(
    width: int, height: int, config: ImageDecodeConfig
) -> tuple[tuple[int, int], tuple[float, float, float, float], tuple[int, int]]:
    """(output size, source box it is resampled from, size the whole source would scale to)."""
    if config.crop == "center":
        whole = resized_size(width, height, "short_side", config.size, max(width, height) * config.size)
        return (config.size, config.size), center_square(width, height), whole
    out = resized_size(width, height, config.resize, config.size, config.max_size)
    return out, (0.0, 0.0, float(width), float(height)), out


def _to_rgb_or_grey(image: Image.Image, key: str) -> Image.Image:
    """The image in mode 'RGB' or 'L' (grey stays grey until after the resize: 3× less work)."""
    mode = image.mode
    if mode in ("RGB", "L"):
        return image
    if mode.startswith("I;16") or mode == "I":
        return Image.fromarray((np.clip(np.asarray(image), 0, 65535) >> 8).astype(np.uint8), "L")
    if mode == "F":
        return Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8), "L")
    if mode in ("1", "LA", "La"):
        return image.convert("L")
    if mode == "P" and "transparency" in image.info:
        return image.convert("RGBA").convert("RGB")
    try:
        return image.convert("RGB")
    except ValueError as exc:
        raise DecodeError(f"pixel mode {mode!r} has no RGB conversion ({exc})", key, "image", "unsupported") from exc


def _pillow_guard() -> float:
    """Pixels over which Pillow warns or refuses (``MAX_IMAGE_PIXELS``, read per call: users change it): a picture
    over it takes Pillow's path, which does that, not a fast path."""
    return Image.MAX_IMAGE_PIXELS or math.inf


def _decode(data: bytes, config: ImageDecodeConfig, key: str) -> np.ndarray:
    if config.scaler == "ffmpeg":  # the array goes to libswscale as it is; Pillow's resize would copy it back in
        fast = _decode_jpeg(data, config, key)
        if fast is not None:
            return fast
        png = stored_png(data, min(config.max_pixels, _pillow_guard())) if "PNG" in config.formats else None
        if png is not None:
            fast = _decode_png(png, config)
            if fast is not None:
                return fast
            data = png.data  # Pillow's decode of the same rows, without zlib's inflate
    with Image.open(io.BytesIO(data), formats=list(config.formats)) as image:
        width, height = checked_size(image, config.max_pixels, key)
        out, box, whole = output_geometry(width, height, config)
        scale = 1.0
        if config.draft and config.resize != "none" and image.format in ("JPEG", "MPO"):  # MPO: multi-picture JPEG
            drafted = image.draft(None, whole)  # picks 1/s with the decoded image still >= whole
            if drafted is not None:
                scale = drafted[1][2] / width
        image.load()
        pixels = _to_rgb_or_grey(image, key)
        return _output(pixels, _source_box(pixels.size, box, scale, config), out, config)


def _decode_jpeg(data: bytes, config: ImageDecodeConfig, key: str) -> np.ndarray | None:
    """A colour or grey JPEG decoded by libjpeg-turbo straight into an array (simplejpeg); None: Pillow's path.

    The same library and settings as Pillow's JPEG decoder, and Pillow's draft rule (1/s with
    s = 8, 4 or 2 while ``source // target >= s`` on both sides), so the pixels are Pillow's;
    without Pillow's copies into and out of its 4-byte pixels (about 0.5 ms a JPEG on the
    training mix, beyond the resize's gain). Anything else, or anything libjpeg-turbo warns about, takes Pillow's path,
    which decodes or names what is wrong exactly as before.
    """
    if not data.startswith(b"\xff\xd8\xff") or "JPEG" not in config.formats:
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in ("YCbCr", "Gray") or width < 1 or height < 1 or width * height > _pillow_guard():
        return None
    _check_pixels(width, height, config.max_pixels, key)
    out, box, whole = output_geometry(width, height, config)
    denominator = 1
    if config.draft and config.resize != "none":
        fits = min(width // whole[0], height // whole[1])
        denominator = next((s for s in (8, 4, 2) if fits >= s), 1)
    scaled = (-(-height // denominator), -(-width // denominator))  # libjpeg's 1/s: partial blocks round up
    channels = 1 if colorspace == "Gray" else 3
    # decoded into memory with room after its last pixel for libswscale's reads (`_readable_past_end` copies none)
    room = np.empty(scaled[0] * scaled[1] * channels + _OVERREAD, dtype=np.uint8)
    try:
        rows = simplejpeg.decode_jpeg(
            data, "GRAY" if channels == 1 else "RGB", min_height=scaled[0], min_width=scaled[1], buffer=room
        )
    except ValueError:  # corrupt, truncated, or a warning strict mode refuses
        return None
    if rows.shape[:2] != scaled:
        return None  # not the scale asked for (a simplejpeg that chose otherwise): Pillow's path
    if colorspace == "Gray":
        rows = rows[:, :, 0]
    size = (rows.shape[1], rows.shape[0])
    return _output(rows, _source_box(size, box, 1 / denominator, config), out, config)


_FFMPEG_PNG = {(8, 2): ("rgb24", 3), (8, 0): ("gray", 1)}  # (bit depth, colour type) -> FFmpeg's frame, channels


def _decode_png(png: StoredPng, config: ImageDecodeConfig) -> np.ndarray | None:
    """An 8-bit RGB or grey PNG decoded by FFmpeg straight into a frame for libswscale; None: Pillow's path.

    Its data already inflated (`stored_png`), FFmpeg's decoder only unfilters (0.26 ms a picture of
    the training mix against Pillow's 0.58) into rows that need no copy out of Pillow's 4-byte pixels. The
    rows' bytes are the file's own, so the pixels are Pillow's. Other colour types and depths
    (palette, alpha, 16-bit: Pillow's conversions define them) go to Pillow.
    """
    layout, channels = _FFMPEG_PNG.get((png.bit_depth, png.colour_type), ("", 0))
    if not layout:
        return None
    codec = av.CodecContext.create("png", "r")
    codec.thread_count = 1
    try:
        frames = codec.decode(av.Packet(png.data))
    except av.error.FFmpegError:
        return None
    if (
        len(frames) != 1
        or frames[0].format.name != layout
        or (frames[0].width, frames[0].height) != (png.width, png.height)
    ):
        return None
    rows = plane_rows(frames[0].planes[0], png.height)[:, : channels * png.width]
    if channels == 3:
        rows = rows.reshape(png.height, png.width, 3)
    out, box, _ = output_geometry(png.width, png.height, config)
    return _output(rows, _source_box((png.width, png.height), box, 1.0, config), out, config)


def _source_box(
    size: tuple[int, int], box: tuple[float, float, float, float], scale: float, config: ImageDecodeConfig
) -> tuple[float, float, float, float]:
    """The region of the decoded picture (``size``, decoded at ``scale``) that becomes the output."""
    if config.crop == "center":
        return box[0] * scale, box[1] * scale, box[2] * scale, box[3] * scale
    return 0.0, 0.0, float(size[0]), float(size[1])  # the whole source: the whole picture, at whatever draft scale


def _output(
    pixels: Image.Image | np.ndarray,
    src_box: tuple[float, float, float, float],
    out: tuple[int, int],
    config: ImageDecodeConfig,
) -> np.ndarray:
    """uint8 [3, H, W]: ``src_box`` of an 'RGB' or 'L' picture (a Pillow image, or rows [H, W(, 3)]) at ``out``."""
    size = (pixels.shape[1], pixels.shape[0]) if isinstance(pixels, np.ndarray) else pixels.size
    if size == out and src_box == (0.0, 0.0, float(size[0]), float(size[1])):
        return _chw(pixels)
    if config.scaler == "ffmpeg" and all(edge.is_integer() for edge in src_box):
        rows = pixels if isinstance(pixels, np.ndarray) else _image_rows(pixels)
        return _scaled_chw(rows, tuple(int(edge) for edge in src_box), out, config.resample)
    image = Image.fromarray(pixels) if isinstance(pixels, np.ndarray) else pixels
    return _chw(image.resize(out, _RESAMPLE[config.resample], box=src_box))


def _chw(pixels: Image.Image | np.ndarray) -> np.ndarray:
    """uint8 [3, H, W] of an 'RGB' or 'L' picture (copied: the image may close after)."""
    if isinstance(pixels, np.ndarray):
        if pixels.ndim == 2:  # grey rows: the same plane three times
            return np.ascontiguousarray(np.broadcast_to(pixels, (3, *pixels.shape)))
        return hwc_to_chw(pixels)
    if pixels.mode == "L":
        pixels = pixels.convert("RGB")
    return hwc_to_chw(_rgb_pixels(pixels))


def _image_rows(pixels: Image.Image) -> np.ndarray:
    """An 'RGB' or 'L' image's pixels as rows [H, W] (grey), [H, W, 4] (RGB + padding, a view) or [H, W, 3]."""
    if pixels.mode == "L":
        return np.asarray(pixels)
    rgbx = _rgbx_pixels(pixels)
    return rgbx if rgbx is not None else np.asarray(pixels)


_SWS_LAYOUT = {1: "gray", 3: "rgb24", 4: "rgba"}  # channels of the rows -> FFmpeg's pixel format (alpha unused)


def _scaled_chw(rows: np.ndarray, box: tuple[int, ...], out: tuple[int, int], resample: str) -> np.ndarray:
    """uint8 [3, H, W]: the ``box`` of rows [H, W] (grey), [H, W, 3] (RGB) or [H, W, 4] (RGB + padding) scaled by
    libswscale to ``out``.

    Scaled straight into planar G, B, R (FFmpeg's ``gbrp``): swscale's packed RGB output and
    Pillow's resize each cost about twice its CPU, and the planes are already the output's layout.
    """
    left, top, right, bottom = box
    region = _readable_past_end(rows[top:bottom, left:right])  # a frame over a view: its rows a row stride apart
    layout = _SWS_LAYOUT[1 if region.ndim == 2 else region.shape[2]]
    width, height = out
    planar = VideoReformatter().reformat(
        av.VideoFrame.from_numpy_buffer(region, format=layout),
        width=width,
        height=height,
        format="gbrp",
        interpolation=SWSCALE_INTERPOLATION[resample],
        threads=1,
    )
    chw = np.empty((3, height, width), dtype=np.uint8)
    for channel, plane in zip((1, 2, 0), planar.planes):  # gbrp's planes are G, B, R
        chw[channel] = plane_rows(plane, height)[:, :width]
    return chw


_OVERREAD = 128
"""Bytes past a frame's last pixel libswscale may read: its SIMD loads read up to 48 past packed RGB rows (libswscale
9.5, measured over random sizes, filters and pixel formats), as FFmpeg expects its own frames' padding after them."""
_PAGE = mmap.PAGESIZE


def _readable_past_end(region: np.ndarray) -> np.ndarray:
    """``region``, or a copy of it with `_OVERREAD` bytes after it, where the bytes after its last pixel may not be
    mapped: libswscale reading past the end of rows that end at the last byte of a page (simplejpeg's array, Pillow's
    pixels) would kill the process with a segfault. In place (no copy) unless the last pixel is that close to both
    the end of its array's memory and the end of a page: about one picture in thirty of Pillow's, none of the JPEGs
    `_decode_jpeg` decodes (into memory with that room)."""
    root = region
    while isinstance(root.base, np.ndarray):
        root = root.base
    start = region.__array_interface__["data"][0]
    last = start + sum((n - 1) * stride for n, stride in zip(region.shape, region.strides))  # its last byte
    if (
        last + _OVERREAD < root.__array_interface__["data"][0] + root.nbytes
        or last // _PAGE == (last + _OVERREAD) // _PAGE
    ):
        return region
    padded = np.empty(region.nbytes + _OVERREAD, dtype=np.uint8)
    copy = padded[: region.nbytes].reshape(region.shape)
    copy[...] = region
    return copy


def _rgb_pixels(image: Image.Image) -> np.ndarray:
    """uint8 [H, W, 3] of an RGB image: a view of Pillow's own pixels where Pillow exports them (`_rgbx_pixels`)."""
    rgbx = _rgbx_pixels(image)
    return rgbx[:, :, :3] if rgbx is not None else np.asarray(image)


def _rgbx_pixels(image: Image.Image) -> np.ndarray | None:
    """uint8 [H, W, 4] view of an RGB image's own pixels (4 bytes each), or None where Pillow cannot export them.

    ``np.asarray`` goes through ``Image.tobytes``, a copy of every pixel made while holding the
    interpreter lock (a tenth of the service's decode threads' time under the lock, by py-spy); Pillow 11.2+
    exports the pixels through the Arrow C data interface instead, without a copy. The view lives
    only until it has been copied (into the output or a frame; a copy is made either way).
    """
    if not _EXPORTS_ARROW:
        return None
    import pyarrow as pa

    try:
        exported = pa.array(image)
    except (ValueError, TypeError):  # rows in several blocks (a very large image), an older pyarrow: the copy
        return None
    if exported.offset != 0 or exported.type.list_size != 4:
        return None
    rgbx = np.frombuffer(exported.buffers()[2], np.uint8)
    height, width = image.height, image.width
    if rgbx.size < 4 * height * width:
        return None
    return rgbx[: 4 * height * width].reshape(height, width, 4)


def hwc_to_chw(array: np.ndarray) -> np.ndarray:
    """A contiguous uint8 [C, H, W] array from an [H, W, C] array (one strided copy)."""
    out = np.empty((array.shape[2], array.shape[0], array.shape[1]), dtype=np.uint8)
    out[...] = array.transpose(2, 0, 1)
    return out


def decode_image(data: bytes, config: ImageDecodeConfig, key: str = "?") -> np.ndarray:
    """Decode an encoded image into a uint8 [3, H, W] RGB array resized by ``config``.

    Raises DecodeError (reason 'empty', 'truncated', 'corrupt', 'bomb' or 'unsupported') on
    bad input; MemoryError and KeyboardInterrupt propagate.
    """
    if not data:
        raise DecodeError("the field is zero bytes long", key, "image", "empty")
    try:
        array = _decode(data, config, key)
    except DecodeError:
        raise
    except MemoryError:
        raise
    except Exception as exc:
        raise image_error(exc, key) from exc
    return array
