"""Image decoding: shapes, resize policies agreeing with the cost model, crop, draft mode, pixel modes."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
import simplejpeg
from PIL import Image, ImageFilter

from omnifeed.bucketing import CostModel
from omnifeed.bucketing._cost import _resized
from omnifeed.loader.decode._common import DecodeError, center_square
from omnifeed.loader.decode._config import ImageDecodeConfig
from omnifeed.loader.decode._image import output_geometry
from omnifeed.loader.decode._registry import decode_image, resized_size
from omnifeed.tools._demo_data import encode_image


def _encode(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


SIDES = [1, 2, 3, 7, 13, 31, 100, 111, 223, 224, 225, 299, 333, 480, 500, 640, 1000, 1023, 1025, 4000, 12345]


@pytest.mark.parametrize(
    ("resize", "size", "max_size"),
    [
        ("short_side", 224, 1024),
        ("short_side", 384, 512),
        ("short_side", 7, 9),
        ("fixed", 224, 1024),
        ("none", 224, 1024),
    ],
)
def test_output_size_equals_the_cost_models_for_every_source_size(resize: str, size: int, max_size: int) -> None:
    pairs = list(itertools.product(SIDES, SIDES))
    width, height = (np.array(v) for v in zip(*pairs))
    model = CostModel(image_resize=resize, image_size=size, max_image_size=max_size)  # type: ignore[arg-type]
    want_w, want_h = _resized(width, height, model)
    for (w, h), ww, wh in zip(pairs, want_w, want_h):
        got = resized_size(w, h, resize, size, max_size)
        if ww > 0 and wh > 0:
            assert got == (int(ww), int(wh)), (w, h)
        else:  # the model's rounding reached 0 for an extreme aspect ratio: the decoder keeps 1 pixel
            assert got == (max(1, int(ww)), max(1, int(wh))), (w, h)


@pytest.mark.parametrize(("width", "height"), [(640, 480), (480, 640), (100, 37), (3000, 40), (224, 224), (17, 4)])
@pytest.mark.parametrize("fmt", ["jpg", "png"])
def test_decoded_image_has_the_planned_shape_and_dtype(width: int, height: int, fmt: str) -> None:
    data = encode_image(width, height, fmt)
    for resize in ("short_side", "fixed", "none"):
        config = ImageDecodeConfig(resize=resize)  # type: ignore[arg-type]
        out = decode_image(data, config, key="k")
        w, h = resized_size(width, height, resize, config.size, config.max_size)
        assert out.shape == (3, h, w) and out.dtype == np.uint8 and out.flags.c_contiguous


# 2400 x 1900 RGB is over Pillow's 16 MiB block: its rows lie in several blocks, which Pillow does not export
@pytest.mark.parametrize(("width", "height"), [(30, 20), (1, 1), (2400, 1900)])
def test_native_size_keeps_the_pixels_however_pillow_stores_them(width: int, height: int) -> None:
    ys, xs = np.indices((height, width))
    rgb = np.stack([xs * 7 + ys, xs ^ ys, ys * 3 + xs * 5], axis=-1).astype(np.uint8)  # every channel its own
    for image, want in ((Image.fromarray(rgb), rgb), (Image.fromarray(rgb[:, :, 1]), rgb[:, :, [1, 1, 1]])):
        out = decode_image(_encode(image, "PNG"), ImageDecodeConfig(resize="none"))
        assert out.flags.c_contiguous and np.array_equal(out, want.transpose(2, 0, 1))


def test_center_crop_takes_the_middle_square() -> None:
    rgb = np.zeros((100, 300, 3), np.uint8)
    rgb[:, 100:200] = 255  # the centre square is white, the sides black
    out = decode_image(_encode(Image.fromarray(rgb), "PNG"), ImageDecodeConfig(crop="center", size=50))
    assert out.shape == (3, 50, 50)
    assert out[:, :, 2:-2].min() == 255


def _smooth_jpeg(width: int, height: int) -> bytes:
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype(np.uint8)
    return _encode(Image.fromarray(rgb), "JPEG")


@pytest.mark.parametrize(
    ("width", "height", "size"), [(640, 480, 224), (1280, 960, 100), (500, 333, 224), (2400, 1800, 224)]
)
def test_draft_mode_changes_speed_not_size(width: int, height: int, size: int) -> None:
    data = _smooth_jpeg(width, height)
    fast = decode_image(data, ImageDecodeConfig(size=size, draft=True))
    full = decode_image(data, ImageDecodeConfig(size=size, draft=False))
    assert fast.shape == full.shape
    assert (
        np.abs(fast.astype(np.float32) - full.astype(np.float32)).mean() < 4.0
    )  # DCT-domain downscale: close, not equal
    crop_fast = decode_image(data, ImageDecodeConfig(size=size, crop="center", draft=True))
    assert crop_fast.shape == (3, size, size)


@pytest.mark.parametrize(
    ("width", "height", "crop"), [(1280, 960, "none"), (1600, 900, "center"), (700, 1000, "center")]
)
def test_without_draft_the_pixels_are_pillows_plain_decode_and_resize(width: int, height: int, crop: str) -> None:
    data = _smooth_jpeg(width, height)
    with Image.open(io.BytesIO(data)) as plain:  # what a torchvision-style dataset does
        rgb = plain.convert("RGB")
        if crop == "center":
            want = rgb.resize((224, 224), Image.Resampling.BILINEAR, box=center_square(width, height))
        else:
            want = rgb.resize(resized_size(width, height, "short_side", 224, 1024), Image.Resampling.BILINEAR)
    exact = decode_image(data, ImageDecodeConfig(crop=crop, draft=False, scaler="pillow"))  # type: ignore[arg-type]
    assert np.array_equal(exact, np.asarray(want).transpose(2, 0, 1))
    scaled = decode_image(data, ImageDecodeConfig(crop=crop))  # type: ignore[arg-type]
    assert scaled.shape == exact.shape and not np.array_equal(scaled, exact), "DCT-domain scaling by default"


def _photo(width: int, height: int, mode: str) -> bytes:
    """A lossless picture with the smooth gradients and soft edges of a photo (blurred noise over ramps)."""
    rng = np.random.default_rng(width * 7919 + height)
    y, x = np.mgrid[0:height, 0:width]
    ramps = np.stack([x * 200 // width, y * 200 // height, (x + y) * 200 // (width + height)], axis=-1)
    noise = Image.fromarray(rng.integers(0, 56, (height, width, 3), dtype=np.uint8)).filter(ImageFilter.GaussianBlur(2))
    return _encode(Image.fromarray((ramps + np.asarray(noise)).astype(np.uint8)).convert(mode), "PNG")


@pytest.mark.parametrize(
    ("width", "height", "crop"),
    [(640, 480, "none"), (160, 213, "none"), (333, 500, "none"), (2400, 1900, "none"), (1600, 900, "center")],
)
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_ffmpeg_scaler_gives_pillows_picture_within_a_level(width: int, height: int, crop: str, mode: str) -> None:
    data = _photo(width, height, mode)  # 2400 x 1900: rows in several blocks, copied out of Pillow, not viewed
    pillow = decode_image(data, ImageDecodeConfig(crop=crop, scaler="pillow"))  # type: ignore[arg-type]
    ffmpeg = decode_image(data, ImageDecodeConfig(crop=crop, scaler="ffmpeg"))  # type: ignore[arg-type]
    assert ffmpeg.shape == pillow.shape and ffmpeg.dtype == np.uint8 and ffmpeg.flags.c_contiguous
    difference = np.abs(ffmpeg.astype(np.int16) - pillow.astype(np.int16))
    assert difference.mean() < 0.5 and difference.max() <= 2
    if mode == "L":
        assert np.array_equal(ffmpeg[0], ffmpeg[1]) and np.array_equal(ffmpeg[0], ffmpeg[2])


def test_a_centre_crop_between_pixels_is_resized_by_pillow() -> None:
    data = _photo(701, 1000, "RGB")  # the centred square starts 149.5 rows down: swscale takes whole pixels only
    ffmpeg = decode_image(data, ImageDecodeConfig(crop="center", scaler="ffmpeg"))
    assert np.array_equal(ffmpeg, decode_image(data, ImageDecodeConfig(crop="center", scaler="pillow")))


@pytest.mark.parametrize(
    ("mode", "fmt"),
    [
        ("L", "PNG"),
        ("LA", "PNG"),
        ("RGBA", "PNG"),
        ("P", "PNG"),
        ("P", "GIF"),
        ("1", "PNG"),
        ("CMYK", "JPEG"),
        ("I;16", "PNG"),
        ("F", "TIFF"),
        ("RGB", "WEBP"),
        ("RGB", "BMP"),
    ],
)
def test_every_common_pixel_mode_becomes_rgb(mode: str, fmt: str) -> None:
    base = Image.fromarray(np.random.default_rng(1).integers(0, 256, (24, 40, 3), dtype=np.uint8))
    image = base.convert(mode) if mode not in ("I;16", "F") else base.convert("L").convert(mode)
    out = decode_image(_encode(image, fmt), ImageDecodeConfig(resize="none"))
    assert out.shape == (3, 24, 40) and out.dtype == np.uint8


def test_sixteen_bit_grey_keeps_its_high_byte() -> None:
    grey = np.full((8, 8), 0xAB00, dtype=np.uint16)
    out = decode_image(_encode(Image.fromarray(grey), "PNG"), ImageDecodeConfig(resize="none"))
    assert int(out.min()) == int(out.max()) == 0xAB


def test_transparent_palette_image_decodes_without_warnings(recwarn: pytest.WarningsRecorder) -> None:
    buf = io.BytesIO()
    Image.new("P", (16, 16), 3).save(buf, format="GIF", transparency=3)
    out = decode_image(buf.getvalue(), ImageDecodeConfig(resize="none"))
    assert out.shape == (3, 16, 16)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_multi_picture_jpeg_decodes_its_first_picture_with_draft() -> None:
    buf, second = io.BytesIO(), Image.new("RGB", (640, 480))
    Image.new("RGB", (640, 480), "red").save(buf, format="MPO", save_all=True, append_images=[second])
    out = decode_image(buf.getvalue(), ImageDecodeConfig(formats=("JPEG",)))
    assert out.shape == (3, 224, 299) and out[0].min() > 240 and out[2].max() < 15


@pytest.mark.parametrize(
    ("width", "height", "crop"),
    [
        (640, 480, "none"),
        (447, 600, "none"),
        (2400, 1800, "none"),
        (1001, 751, "none"),
        (1280, 960, "center"),
        (1001, 751, "center"),  # 1/2, 1/4: the decoded picture's last row and column are partial
        (2017, 1999, "center"),
        (333, 500, "center"),
    ],
)
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_a_jpeg_is_decoded_by_libjpeg_turbo_to_pillows_own_pixels_draft_included(
    width: int, height: int, crop: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[np.ndarray] = []
    decode_jpeg = simplejpeg.decode_jpeg

    def recording(*args: object, **kwargs: object) -> np.ndarray:
        decoded.append(decode_jpeg(*args, **kwargs))
        return decoded[-1]

    monkeypatch.setattr(simplejpeg, "decode_jpeg", recording)
    rgb = np.asarray(Image.open(io.BytesIO(_photo(width, height, "RGB"))))
    data = _encode(Image.fromarray(rgb).convert(mode), "JPEG")
    config = ImageDecodeConfig(crop=crop)  # type: ignore[arg-type]
    fast = decode_image(data, config)
    with Image.open(io.BytesIO(data)) as image:  # Pillow's draft (1/8, 1/4 or 1/2) and decode
        image.draft(None, output_geometry(width, height, config)[2])
        image.load()
        want = np.asarray(image)
    assert len(decoded) == 1 and np.array_equal(decoded[0].reshape(want.shape), want)
    pillow = decode_image(data, ImageDecodeConfig(crop=crop, scaler="pillow"))  # type: ignore[arg-type]
    assert fast.shape == pillow.shape and np.abs(fast.astype(np.int16) - pillow).max() <= 2


def test_a_jpeg_over_max_pixels_is_refused_from_its_header() -> None:
    with pytest.raises(DecodeError) as caught:
        decode_image(_smooth_jpeg(640, 480), ImageDecodeConfig(max_pixels=640 * 480 - 1), key="big")
    assert (caught.value.reason, caught.value.key) == ("bomb", "big") and "max_pixels" in str(caught.value)


def test_an_image_decodes_to_the_same_bytes_every_time() -> None:
    """libswscale writes every output column, also past the last multiple of 16, whatever buffers it reuses (resume is
    byte-identical only if decoding is; its planar output from YUV did not, see test_decode_av)."""
    pictures = [_photo(w, h, mode) for w, h, mode in ((333, 500, "RGB"), (701, 413, "L"), (97, 150, "RGB"))]
    pictures.append(_smooth_jpeg(1001, 751))
    configs = [
        ImageDecodeConfig(),
        ImageDecodeConfig(crop="center", size=90),
        ImageDecodeConfig(resize="fixed", size=57),
    ]
    first = [[decode_image(data, config) for config in configs] for data in pictures]
    for _ in range(3):  # interleaved, so each call follows one of another size
        for data, outputs in zip(pictures, first):
            assert all(np.array_equal(decode_image(data, c), out) for c, out in zip(configs, outputs))


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_the_scaler_reads_a_view_of_the_rows_as_it_reads_their_copy(channels: int) -> None:
    """swscale is handed the rows in place (a frame over the numpy view, its row stride the view's), not a copy."""
    from omnifeed.loader.decode._image import _scaled_chw

    rows = np.random.default_rng(channels).integers(0, 256, (301, 419, channels), dtype=np.uint8)
    rows = rows[:, :, 0] if channels == 1 else rows
    box = (37, 11, 37 + 250, 11 + 250)  # a centre-crop-like region: rows 419 pixels apart, not 250
    region = rows[box[1] : box[3], box[0] : box[2]]
    in_place = _scaled_chw(rows, box, (224, 224), "bilinear")
    copied = _scaled_chw(np.ascontiguousarray(region), (0, 0, 250, 250), (224, 224), "bilinear")
    assert np.array_equal(in_place, copied)


_ROWS_BEFORE_AN_UNMAPPED_PAGE = """
import ctypes, mmap, sys
import numpy as np
from omnifeed.loader.decode._image import _scaled_chw

libc, rng = ctypes.CDLL(None), np.random.default_rng(int(sys.argv[1]))
for _ in range(int(sys.argv[2])):
    channels = int(rng.choice([1, 3, 4]))
    height, width = int(rng.integers(1, 600)), int(rng.integers(1, 2000))
    out = (224, 224) if rng.random() < 0.5 else (int(rng.integers(8, 1000)), int(rng.integers(8, 800)))
    resample = str(rng.choice(["bilinear", "bicubic", "lanczos"]))
    nbytes, slack = height * width * channels, int(rng.choice([0, 8, 16, 24, 40]))
    pages = -(-(nbytes + slack) // mmap.PAGESIZE) + 1
    memory = mmap.mmap(-1, pages * mmap.PAGESIZE)
    readable = np.frombuffer(memory, np.uint8, count=(pages - 1) * mmap.PAGESIZE)
    libc.mprotect(ctypes.c_void_p(readable.ctypes.data + readable.nbytes), mmap.PAGESIZE, 0)  # PROT_NONE
    end = readable.size - slack
    rows = readable[end - nbytes : end].reshape((height, width, channels)[: 2 if channels == 1 else 3])
    rows[...] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    try:
        expected = _scaled_chw(np.ascontiguousarray(rows), (0, 0, width, height), out, resample)
    except Exception:  # a scale libswscale refuses (e.g. 1,000 pixels to 8)
        continue
    assert np.array_equal(_scaled_chw(rows, (0, 0, width, height), out, resample), expected)
print("ok")
"""


def test_rows_that_end_just_before_an_unmapped_page_are_scaled_without_a_crash() -> None:
    """libswscale reads up to 48 bytes past a frame's last pixel: rows that end at the end of their memory and of a page
    (simplejpeg's array did, once in a few thousand photos) killed the decoding process with a segfault. Random
    sizes, pixel formats and filters, each picture's rows ending 0-40 bytes before a page that is not mapped, in a
    child process (a segfault there fails the test instead of killing pytest); the pixels are those of a copy."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _ROWS_BEFORE_AN_UNMAPPED_PAGE, "29", "300"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
