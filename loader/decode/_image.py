"""Images with Pillow: bytes → uint8 [3, H, W] RGB, resized by policy, bombs refused from the header.

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
  changes, the pixels a little (0.4 levels on average); off, they are Pillow's plain decode
  and resize exactly.
- Errors: 'empty' (no bytes), 'truncated' (Pillow: "image file is truncated", or end of
  data), 'bomb', 'corrupt' (anything else Pillow rejects), 'unsupported' (a pixel mode
  that has no RGB conversion). ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES = True`` (a global
  Pillow switch) would make truncated files decode grey-filled instead.
"""

from __future__ import annotations

import io
import logging

import av
import numpy as np
from av.video.reformatter import VideoReformatter
from PIL import Image

from ._common import DecodeError, center_square, resized_size
from ._config import ImageDecodeConfig

logger = logging.getLogger(__name__)

_EXPORTS_ARROW = hasattr(Image.Image, "__arrow_c_array__")  # Pillow 11.2 and newer
_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
_SWS_INTERPOLATION = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "lanczos": "LANCZOS"}


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
    if width * height > max_pixels:
        raise DecodeError(
            f"header declares {width}x{height} = {width * height} pixels, over max_pixels = {max_pixels}",
            key,
            "image",
            "bomb",
        )
    return width, height


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


def _decode(data: bytes, config: ImageDecodeConfig, key: str) -> np.ndarray:
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
        if config.crop == "center":
            src_box = (box[0] * scale, box[1] * scale, box[2] * scale, box[3] * scale)
        else:  # the whole source: the whole decoded image, whatever size draft mode decoded it at
            src_box = (0.0, 0.0, float(pixels.width), float(pixels.height))
        if pixels.size == out and src_box == (0.0, 0.0, float(pixels.width), float(pixels.height)):
            return _chw(pixels)
        if config.scaler == "ffmpeg" and all(edge.is_integer() for edge in src_box):
            return _scaled_chw(pixels, tuple(int(edge) for edge in src_box), out, config.resample)
        return _chw(pixels.resize(out, _RESAMPLE[config.resample], box=src_box))


def _chw(pixels: Image.Image) -> np.ndarray:
    """uint8 [3, H, W] of an 'RGB' or 'L' image (copied: the image may close after)."""
    if pixels.mode == "L":
        pixels = pixels.convert("RGB")
    return hwc_to_chw(_rgb_pixels(pixels))


def _scaled_chw(pixels: Image.Image, box: tuple[int, ...], out: tuple[int, int], resample: str) -> np.ndarray:
    """uint8 [3, H, W]: the ``box`` of an 'RGB' or 'L' image scaled to ``out`` by libswscale.

    Scaled straight into planar G, B, R (FFmpeg's ``gbrp``): swscale's packed RGB output and
    Pillow's resize each cost about twice its CPU, and the planes are already the output's layout.
    """
    left, top, right, bottom = box
    if pixels.mode == "L":
        rows, layout = np.asarray(pixels)[top:bottom, left:right], "gray"
    else:
        rgbx = _rgbx_pixels(pixels)
        rows, layout = (rgbx, "rgba") if rgbx is not None else (np.asarray(pixels), "rgb24")
        rows = rows[top:bottom, left:right]
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rows), format=layout)
    width, height = out
    planar = VideoReformatter().reformat(
        frame, width=width, height=height, format="gbrp", interpolation=_SWS_INTERPOLATION[resample], threads=1
    )
    chw = np.empty((3, height, width), dtype=np.uint8)
    for channel, plane in zip((1, 2, 0), planar.planes):  # gbrp's planes are G, B, R
        chw[channel] = np.frombuffer(plane, np.uint8).reshape(height, plane.line_size)[:, :width]
    return chw


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
