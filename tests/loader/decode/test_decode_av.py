"""Video and audio decoding with PyAV: sampling by timestamp, early stop, resize, resampling."""

from __future__ import annotations

import io
import math
from typing import Any

import av
import numpy as np
import pytest

import omnifeed.loader.decode._video as decode_video_module
from omnifeed.bucketing import CostModel, stream_lengths
from omnifeed.bucketing._cost import INDEX_COLUMNS
from omnifeed.loader.decode._config import AudioDecodeConfig, VideoDecodeConfig
from omnifeed.loader.decode._registry import decode_audio, decode_video, resized_size
from omnifeed.tools._demo_data import encode_flac, encode_video


def _clip(frames: int, fps: int, gop: int, width: int = 64, height: int = 48) -> bytes:
    """An H.264 MP4 (with B-frames) whose frame i is filled with grey level (7·i) mod 256, a keyframe every ``gop``."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream: Any = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count, stream.codec_context.gop_size = 1, gop
        stream.codec_context.options = {"preset": "veryfast", "keyint_min": str(gop), "sc_threshold": "0"}
        for i in range(frames):
            img = np.full((height, width, 3), (7 * i) % 256, np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode(None))
    return buf.getvalue()


@pytest.fixture(scope="module")
def long_clip() -> bytes:
    """300 frames at 25 fps, a keyframe every 12 frames."""
    return _clip(300, 25, 12)


@pytest.fixture(scope="module")
def every_frame(long_clip: bytes) -> np.ndarray:
    """All 300 frames of ``long_clip`` at native size, decoded sequentially (the reference)."""
    return decode_video(long_clip, VideoDecodeConfig(resize="none", max_frames=300))


class _Counter:
    """Counts the frames the video decoder gets out of the codec."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.frames = 0
        original = decode_video_module._Decoder._take

        def take(decoder: Any, frames: list[Any]) -> None:
            self.frames += len(frames)
            original(decoder, frames)

        monkeypatch.setattr(decode_video_module._Decoder, "_take", take)


def test_every_frame_decodes_in_order(every_frame: np.ndarray) -> None:
    assert every_frame.shape == (300, 3, 48, 64) and every_frame.dtype == np.uint8
    grey = every_frame[:, 0, 24, 32].astype(np.int64)
    assert np.all(np.abs(grey - np.array([(7 * i) % 256 for i in range(300)])) <= 3)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 64])
def test_num_frames_are_spread_uniformly_and_exact(long_clip: bytes, every_frame: np.ndarray, n: int) -> None:
    out = decode_video(long_clip, VideoDecodeConfig(num_frames=n, resize="none", max_frames=64))
    expected = [i * 300 // n for i in range(n)]
    assert np.array_equal(out, every_frame[expected])  # decoding from a keyframe gives the same pixels


def test_num_frames_decodes_far_fewer_frames_than_the_clip_has(
    long_clip: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = _Counter(monkeypatch)
    out = decode_video(long_clip, VideoDecodeConfig(num_frames=2))
    assert out.shape[0] == 2
    assert counter.frames <= 2 * 12 + 4  # at most a GOP per chosen frame (+ the codec's reorder delay), not 300


def test_first_frames_stop_early(long_clip: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = _Counter(monkeypatch)
    out = decode_video(long_clip, VideoDecodeConfig(max_frames=4, resize="none"))
    assert out.shape == (4, 3, 48, 64)
    assert counter.frames <= 4 + 4


@pytest.mark.parametrize(
    ("frames", "native", "fps"), [(100, 25, 10.0), (300, 25, 1.0), (50, 25, 25.0), (40, 10, 30.0), (30, 24, 7.5)]
)
def test_fps_sampling_gives_the_cost_models_frame_count(frames: int, native: int, fps: float) -> None:
    clip = _clip(frames, native, 12, 32, 24)
    out = decode_video(clip, VideoDecodeConfig(fps=fps, resize="none", max_frames=64))
    columns = dict.fromkeys(INDEX_COLUMNS, np.zeros(1))
    columns.update(
        video_frames=np.array([frames]),
        video_fps=np.array([float(native)]),
        video_width=np.array([32]),
        video_height=np.array([24]),
    )
    model = CostModel(video_fps=fps, video_max_frames=64, image_resize="none", patch_size=1)
    assert out.shape[0] * 32 * 24 == stream_lengths(columns, model)["video"][0]
    assert out.shape[0] == min(64, math.ceil(frames * fps / native) if native > fps else frames)


def test_fps_sampling_takes_the_frame_shown_at_each_time(long_clip: bytes, every_frame: np.ndarray) -> None:
    out = decode_video(long_clip, VideoDecodeConfig(fps=2.0, resize="none", max_frames=64))
    assert np.array_equal(out, every_frame[[k * 25 // 2 for k in range(24)]])  # shown at k/2 s


@pytest.mark.parametrize("codec", ["libx264", "libvpx-vp9"])
def test_frames_not_taken_that_nothing_refers_to_are_skipped_and_the_taken_ones_are_exact(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clip = encode_video(60, 96, 64, 25, codec=codec)  # a moving picture, one keyframe (x264: with B-frames)
    every = decode_video(clip, VideoDecodeConfig(resize="none", max_frames=60))  # all taken: nothing skipped
    counter = _Counter(monkeypatch)
    out = decode_video(clip, VideoDecodeConfig(num_frames=6, resize="none"))
    assert np.array_equal(out, every[[i * 60 // 6 for i in range(6)]])
    if codec == "libx264":  # x264's non-reference B-frames between the taken frames were never decoded
        assert counter.frames < 50


def test_short_clip_gives_fewer_frames_than_asked() -> None:
    out = decode_video(_clip(5, 10, 5), VideoDecodeConfig(num_frames=8))
    assert out.shape[0] == 5


@pytest.mark.parametrize("resize", ["short_side", "fixed", "none"])
def test_frames_are_resized_by_policy(resize: str) -> None:
    clip = encode_video(6, 80, 60, 10)
    config = VideoDecodeConfig(resize=resize, size=32)  # type: ignore[arg-type]
    out = decode_video(clip, config)
    w, h = resized_size(80, 60, resize, 32, config.max_size)
    assert out.shape == (6, 3, h, w) and out.flags.c_contiguous


@pytest.mark.parametrize("resize", ["none", "short_side"])
def test_frames_are_rgb_as_ffmpeg_converts_them(resize: str) -> None:
    """Red, green and blue land in channels 0, 1, 2, with the values of PyAV's own rgb24 conversion."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream: Any = out.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv444p"
        y, x = np.mgrid[0:48, 0:64]
        for i in range(4):
            img = np.stack([(x * 4 + i * 9) % 256, (y * 5) % 256, np.full_like(x, 60 * i)], axis=-1).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode(None))
    config = VideoDecodeConfig(resize=resize, size=32, num_frames=4)  # type: ignore[arg-type]
    got = decode_video(buf.getvalue(), config)
    w, h = resized_size(64, 48, resize, 32, config.max_size)
    with av.open(io.BytesIO(buf.getvalue())) as container:
        frames = [
            frame.reformat(width=w, height=h, interpolation="BILINEAR") if (w, h) != (64, 48) else frame
            for frame in container.decode(video=0)
        ]
        expected = np.stack([frame.to_ndarray(format="rgb24").transpose(2, 0, 1) for frame in frames])
    assert got.shape == (4, 3, h, w)
    assert np.array_equal(got, expected)  # channels differ here (red across, green down, blue by frame)


def test_a_clip_decodes_to_the_same_bytes_every_time() -> None:
    """Every output column is written by the conversion, also past the last multiple of 16 (resume is byte-identical
    only if decoding is)."""
    clip = encode_video(12, 200, 120, 10)
    config = VideoDecodeConfig(resize="short_side", size=90, num_frames=8)  # 150 x 90: not a multiple of 16 wide
    first = decode_video(clip, config)
    assert all(np.array_equal(first, decode_video(clip, config)) for _ in range(5))


def test_vp9_webm_decodes() -> None:
    out = decode_video(encode_video(8, 64, 48, 10, codec="libvpx-vp9"), VideoDecodeConfig(num_frames=4, resize="none"))
    assert out.shape == (4, 3, 48, 64)


def test_audio_is_resampled_to_16k_mono_with_the_right_length() -> None:
    out = decode_audio(encode_flac(2.0, 22050, 2), AudioDecodeConfig())
    assert out.dtype == np.float32 and out.shape[0] == 1
    assert abs(out.shape[1] - 32000) <= 320
    assert float(np.abs(out).max()) <= 1.0 and float(np.abs(out).max()) > 0.01


def test_audio_stereo_output_keeps_two_channels() -> None:
    out = decode_audio(encode_flac(0.5, 16000, 1), AudioDecodeConfig(channels=2, sample_rate=22050))
    assert out.shape[0] == 2 and abs(out.shape[1] - 11025) <= 111
    assert np.allclose(out[0], out[1])  # mono upmixed to both channels


def test_audio_keeps_the_tone() -> None:
    rate, n = 22050, 22050
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(n) / rate) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as out:
        stream: Any = out.add_stream("flac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(tone[None, :], format="s16", layout="mono")
        frame.sample_rate = rate
        out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    audio = decode_audio(buf.getvalue(), AudioDecodeConfig(sample_rate=16000))[0]
    peak = np.argmax(np.abs(np.fft.rfft(audio))) * 16000 / audio.size
    assert abs(peak - 440) < 5 and abs(np.abs(audio).max() - 0.5) < 0.02


def _ffmpeg_reference(data: bytes, config: AudioDecodeConfig) -> np.ndarray:
    """Every decoded frame through one ``av.AudioResampler``, flushed: FFmpeg's own conversion."""
    layout = "mono" if config.channels == 1 else "stereo"
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=config.sample_rate)
    with av.open(io.BytesIO(data)) as container:
        chunks = [out.to_ndarray() for frame in container.decode(audio=0) for out in resampler.resample(frame)]
    chunks += [out.to_ndarray() for out in resampler.resample(None)]
    return np.clip(np.concatenate(chunks, axis=1).astype(np.float32), -1.0, 1.0)


@pytest.mark.parametrize(
    ("rate", "channels", "config"),
    [
        (16000, 1, AudioDecodeConfig()),  # already the output's rate and layout: converted by numpy
        (16000, 2, AudioDecodeConfig(channels=2)),
        (22050, 2, AudioDecodeConfig()),  # resampled and downmixed by FFmpeg
        (16000, 2, AudioDecodeConfig()),
        (44100, 1, AudioDecodeConfig(channels=2, sample_rate=22050)),
    ],
)
def test_audio_samples_are_ffmpegs_to_the_bit(rate: int, channels: int, config: AudioDecodeConfig) -> None:
    data = encode_flac(1.7, rate, channels, seed=rate + channels)
    out = decode_audio(data, config)
    reference = _ffmpeg_reference(data, config)
    assert out.dtype == np.float32 and out.shape == reference.shape and out.flags.c_contiguous
    assert np.array_equal(out, reference)


_COUNT_THREADS = """
import os, sys, threading
from pathlib import Path
from omnifeed.loader.decode._config import AudioDecodeConfig, VideoDecodeConfig
from omnifeed.loader.decode._registry import decode_audio, decode_video

clip, audio = Path(sys.argv[1]).read_bytes(), Path(sys.argv[2]).read_bytes()
decode_video(clip, VideoDecodeConfig()), decode_audio(audio, AudioDecodeConfig())  # imports and lazy set-up done
seen, stop = [], threading.Event()

def count() -> None:
    while not stop.is_set():
        seen.append(len(os.listdir("/proc/self/task")))

sys.setswitchinterval(1e-5)  # the counter runs between the decoders' steps, not once per 5 ms
counter = threading.Thread(target=count)
counter.start()
while len(seen) < 10:
    pass
before = max(seen)
for _ in range(10):
    decode_video(clip, VideoDecodeConfig()), decode_audio(audio, AudioDecodeConfig())
stop.set()
counter.join()
print(before, max(seen))
"""


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_decoding_a_clip_starts_no_threads_of_ffmpegs(tmp_path: Any) -> None:
    """A decode worker is one thread: FFmpeg's scaler and resampler default to a thread per core, per clip."""
    import subprocess
    import sys

    (tmp_path / "clip.mp4").write_bytes(encode_video(12, 320, 240, 25))  # scaled to 224 and converted to RGB
    (tmp_path / "speech.flac").write_bytes(encode_flac(1.0, 22050, 2))  # resampled to 16 kHz mono
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_THREADS, str(tmp_path / "clip.mp4"), str(tmp_path / "speech.flac")],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout.split()
    before, during = int(out[0]), int(out[1])
    assert during == before, f"{during - before} more threads while decoding"
