"""Length probes (headers only) and text counters; media is encoded in memory at test time.

The ``encode_*`` helpers are also used by ``test_sources.py``.
"""

from __future__ import annotations

import io
import struct
import zlib

import av
import numpy as np
import pytest
from PIL import Image

from omnifeed.loader._errors import SourceError
from omnifeed.loader.index._probe import probe_audio, probe_image, probe_lengths, probe_text, probe_video
from omnifeed.loader.index._records import FieldLocation
from omnifeed.loader.index._tokenizers import count_regex_tokens, make_token_counter


def encode_image(width: int, height: int, fmt: str = "JPEG") -> bytes:
    """An image of the given size in the given Pillow format."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 60)).save(out, fmt)
    return out.getvalue()


def encode_video(fmt: str = "mp4", codec: str = "libx264", frames: int = 6, size=(64, 48), fps: int = 24) -> bytes:
    """A short video, encoded in memory with PyAV."""
    width, height = size
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), i * 30, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def encode_audio(fmt: str = "flac", codec: str = "flac", seconds: float = 1.5, rate: int = 16000) -> bytes:
    """A mono sine tone, encoded in memory with PyAV."""
    out = io.BytesIO()
    samples = (np.sin(np.arange(int(seconds * rate)) * 0.1) * 8000).astype(np.int16)
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.layout = "mono"
        for start in range(0, len(samples), 1024):
            frame = av.AudioFrame.from_ndarray(samples[None, start : start + 1024], format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, start
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG declaring a size, with an empty IDAT: the header of a decompression bomb."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("regex", 8), ("whitespace", 5), ("bytes", 24), ("builtins:str.split", 5), ("builtins:len", 22)],
)
def test_token_counters_measure_text(spec, expected):
    assert make_token_counter(spec)("Hello, world — it's me") == expected


def test_regex_counter_is_the_default_and_counts_words_and_symbols():
    assert make_token_counter() is count_regex_tokens
    assert count_regex_tokens("a+b = c!") == 6
    assert count_regex_tokens("") == 0


@pytest.mark.parametrize("spec", ["sentencepiece-ish", "no_such_module_xyz:count", "builtins:no_such_function"])
def test_unknown_token_counter_is_a_value_error_naming_the_choices(spec):
    with pytest.raises(ValueError, match="regex|cannot import|no attribute"):
        make_token_counter(spec)
    with pytest.raises(ValueError, match="'regex', 'whitespace', 'bytes'"):
        make_token_counter("nope")


@pytest.mark.parametrize(("fmt", "size"), [("JPEG", (64, 48)), ("PNG", (7, 300)), ("WEBP", (33, 17)), ("GIF", (1, 1))])
def test_probe_image_reads_width_and_height(fmt, size):
    assert probe_image(io.BytesIO(encode_image(*size, fmt))) == size


def test_probe_image_reads_only_the_header():
    data = encode_image(640, 480, "PNG")
    assert probe_image(io.BytesIO(data[: len(data) // 3])) == (640, 480)  # pixels cut off: never decoded


def test_probe_image_rejects_a_corrupt_header():
    with pytest.raises(SourceError, match="unreadable image header"):
        probe_image(io.BytesIO(b"\xff\xd8 this is no jpeg"))


def test_probe_image_turns_a_header_declared_bomb_into_an_error(monkeypatch):
    with pytest.raises(SourceError, match="decompression bomb"):
        probe_image(io.BytesIO(png_header(100_000, 100_000)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # between the limit and 2x: Pillow only warns
    with pytest.warns(Image.DecompressionBombWarning), pytest.raises(SourceError, match="MAX_IMAGE_PIXELS"):
        probe_image(io.BytesIO(png_header(40, 40)))


@pytest.mark.parametrize(
    ("fmt", "codec", "frames"),
    [("mp4", "libx264", 6), ("webm", "libvpx-vp9", 6), ("h264", "libx264", 7), ("mpegts", "libx264", 5)],
)
def test_probe_video_reads_frames_rate_and_size(fmt, codec, frames):
    # mp4 stores the frame count; webm and mpegts only a duration; a raw h264 stream
    # has neither, so its packets are counted
    got_frames, fps, width, height = probe_video(io.BytesIO(encode_video(fmt, codec, frames=frames)))
    assert abs(got_frames - frames) <= 1
    assert (width, height) == (64, 48)
    assert fps == pytest.approx(24) or fmt == "h264"


def test_probe_video_rejects_non_video():
    with pytest.raises(SourceError, match="unreadable video"):
        probe_video(io.BytesIO(b"\x00" * 100))
    with pytest.raises(SourceError, match="no video stream"):
        probe_video(io.BytesIO(encode_audio()))


@pytest.mark.parametrize(("fmt", "codec"), [("flac", "flac"), ("wav", "pcm_s16le")])
def test_probe_audio_reads_seconds_and_sample_rate(fmt, codec):
    seconds, rate = probe_audio(io.BytesIO(encode_audio(fmt, codec, seconds=1.25, rate=22050)))
    assert seconds == pytest.approx(1.25, abs=1024 / 22050)
    assert rate == 22050


def test_probe_audio_rejects_garbage():
    with pytest.raises(SourceError, match="unreadable audio"):
        probe_audio(io.BytesIO(b"RIFF\x00\x00garbage" * 3))


def test_probe_text_rejects_invalid_utf8():
    assert probe_text("ça va ?".encode(), count_regex_tokens) == 3
    with pytest.raises(SourceError, match="not valid UTF-8"):
        probe_text(b"ok \xff\xfe", count_regex_tokens)


def _field(name: str, modality: str) -> FieldLocation:
    return FieldLocation(name, modality, f"k.{name}", 0, 0)


def test_probe_lengths_sums_text_and_takes_the_first_field_of_each_modality():
    fields = [
        (_field("txt", "text"), b"one two"),
        (_field("cap.txt", "text"), b"three"),
        (_field("png", "image"), encode_image(5, 6, "PNG")),
        (_field("jpg", "image"), lambda: io.BytesIO(encode_image(9, 8))),  # 'jpg' < 'png': this one counts
        (_field("json", "meta"), b"\xff not read"),
        (_field("flac", "audio"), encode_audio(seconds=0.5)),
    ]
    lengths = probe_lengths(fields, count_regex_tokens)
    assert lengths.text_tokens == 3
    assert (lengths.image_width, lengths.image_height) == (9, 8)
    assert lengths.audio_seconds == pytest.approx(0.5, abs=0.07) and lengths.audio_sample_rate == 16000
    assert lengths.video_frames == 0


def test_probe_lengths_error_names_url_member_key_and_what_to_do():
    fields = [(_field("jpg", "image"), b"not an image")]
    with pytest.raises(SourceError, match=r"shard-7\.tar: member 'k\.jpg' of sample 'k'.*re-encode") as info:
        probe_lengths(fields, count_regex_tokens, url="s3://b/shard-7.tar", key="k")
    assert (info.value.url, info.value.key) == ("s3://b/shard-7.tar", "k")
    assert "IndexConfig.modalities" in str(info.value)
