"""The built-in procedurally generated multimodal demo dataset (nothing is downloaded).

Every byte is a pure function of the `DemoDatasetSpec`: the sample kind of position *i*
comes from a quota-exact permutation keyed by ``SeedSequence([seed, 0])`` and its content
from ``SeedSequence([seed, 1, i])``. Video is encoded with libx264 at ``threads=1`` (its
output depends on the thread count, which defaults to the number of cores) and both
containers are muxed with ``fflags=+bitexact`` so no FFmpeg version string is embedded.
Tar members get a fixed mtime. Bytes are reproducible for a given Pillow/FFmpeg/x264 build.
"""

from __future__ import annotations

import io
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import webdataset
from PIL import Image

__all__ = [
    "DemoDatasetSpec",
    "DemoSample",
    "FIELDS",
    "demo_samples",
    "encode_flac",
    "encode_image",
    "encode_video",
    "write_folder",
    "write_parquet",
    "write_webdataset",
]

logger = logging.getLogger(__name__)

FIELDS: tuple[str, ...] = ("jpg", "png", "mp4", "flac", "txt", "json")
"""Every field name the demo dataset uses (WebDataset extensions / Parquet columns)."""
_TEXT_FIELDS = frozenset({"txt", "json"})
_KIND_WEIGHTS = {"image": 0.45, "text": 0.25, "video": 0.15, "audio": 0.15}
_KIND_STREAM, _SAMPLE_STREAM = 0, 1
_TAR_MTIME = 946684800.0  # 2000-01-01T00:00:00Z: fixed so tar shards are byte-reproducible
_VOCAB = (
    "the of and to in is that it for on with as was by at from this be are or an not have "
    "which data model train batch image video audio text frame pixel sample token shard "
    "cache node rank loader stream buffer signal noise river mountain forest city light "
    "shadow blue red green small large quick slow bright dark quiet loud old new early late "
    "cat dog bird horse garden window street market music voice song wave tone color shape "
    "circle square line gradient morning evening winter summer café naïve über señor "
    "déjà vu 東京 데이터 always never often sometimes between under over through across"
).split()


@dataclass(frozen=True)
class DemoDatasetSpec:
    """What to generate; every knob is small by default so 240 samples build in seconds."""

    num_samples: int = 240
    num_shards: int = 6
    seed: int = 0
    image_px: tuple[int, int] = (32, 320)  # min/max image side, pixels
    png_fraction: float = 0.3  # share of images stored as PNG instead of JPEG
    max_text_words: int = 2000  # cap of the lognormal text-document length, words
    video_frames: tuple[int, int] = (4, 16)
    video_size: tuple[int, int, int, int] = (64, 48, 160, 120)  # min w, min h, max w, max h
    video_fps: tuple[int, int] = (8, 25)
    audio_seconds: tuple[float, float] = (0.2, 3.0)
    row_group_size: int = 64  # Parquet rows per row group
    folder_parts: int = 2  # subfolders of the folder layout

    def __post_init__(self) -> None:
        if not 1 <= self.num_shards <= self.num_samples:
            raise ValueError(f"need 1 <= num_shards <= num_samples, got {self}")
        if self.row_group_size < 1 or not 1 <= self.folder_parts <= self.num_samples:
            raise ValueError(f"row_group_size and folder_parts must be >= 1, got {self}")


@dataclass(frozen=True)
class DemoSample:
    """One generated sample: its key, field bytes and the true lengths of its media."""

    index: int
    key: str
    kind: str  # "image" | "text" | "video" | "audio"
    fields: dict[str, bytes] = field(repr=False, hash=False)
    words: int  # whitespace-separated words in the ``txt`` field
    width: int | None = None  # image or video, pixels
    height: int | None = None
    frames: int | None = None  # video
    fps: int | None = None  # video, frames per second
    sample_rate: int | None = None  # audio, Hz
    channels: int | None = None  # audio
    audio_samples: int | None = None  # audio, samples per channel

    @property
    def seconds(self) -> float | None:
        """Duration of the video or audio in seconds, None for images and text."""
        if self.frames is not None and self.fps is not None:
            return self.frames / self.fps
        if self.audio_samples is not None and self.sample_rate is not None:
            return self.audio_samples / self.sample_rate
        return None


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(list(key)))


def _picture(width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """A float32 RGB gradient with a few flat shapes on it, shape (height, width, 3)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0.0, 2 * math.pi)
    t = x * math.cos(angle) + y * math.sin(angle)
    t = (t - t.min()) / (np.ptp(t) + 1e-6)
    c0, c1 = rng.uniform(0, 255, (2, 3)).astype(np.float32)
    img = c0 + (c1 - c0) * t[..., None]
    for _ in range(int(rng.integers(0, 6))):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        rx, ry = rng.uniform(3, width / 2 + 3), rng.uniform(3, height / 2 + 3)
        if rng.random() < 0.5:
            mask = ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 <= 1.0
        else:
            mask = (np.abs(x - cx) <= rx) & (np.abs(y - cy) <= ry)
        img[mask] = rng.uniform(0, 255, 3)
    return img


def encode_image(width: int, height: int, fmt: str, *, seed: int = 0) -> bytes:
    """Encode a procedural RGB picture as ``fmt`` ("jpg"/"jpeg" or "png") in memory."""
    rng = _rng(seed, width, height)
    img = _picture(width, height, rng)
    img += rng.normal(0.0, rng.uniform(0.0, 24.0), img.shape).astype(np.float32)
    buf = io.BytesIO()
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
    if fmt.lower() in ("jpg", "jpeg"):
        pil.save(buf, format="JPEG", quality=85)
    elif fmt.lower() == "png":
        pil.save(buf, format="PNG", compress_level=6)
    else:
        raise ValueError(f"unsupported image format {fmt!r}: use 'jpg' or 'png'")
    return buf.getvalue()


def encode_video(frames: int, width: int, height: int, fps: int, *, codec: str = "libx264", seed: int = 0) -> bytes:
    """Encode ``frames`` frames of a moving picture as yuv420p MP4 (webm for VP8/VP9)."""
    if width % 2 or height % 2 or frames < 1:
        raise ValueError(f"yuv420p needs even sizes and >= 1 frame: {frames}x{width}x{height}")
    rng = _rng(seed, frames, width, height, fps)
    base = _picture(width, height, rng).astype(np.uint8)
    side, (dx, dy) = max(4, min(width, height) // 4), rng.integers(-6, 7, 2)
    fmt = "webm" if codec.startswith("libvpx") else "mp4"
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt, container_options={"fflags": "+bitexact"}) as out:
        stream = cast(av.VideoStream, out.add_stream(codec, rate=fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1  # x264 output depends on its thread count
        if codec == "libx264":
            # Same picture, same bytes: x264's threads only go through x264-params (thread_count does not reach
            # them), and its macroblock-tree lookahead gave different bytes from run to run (measured with PyAV 18)
            stream.codec_context.options = {
                "preset": "veryfast",
                "x264-params": "threads=1:lookahead-threads=1:sliced-threads=0:no-mbtree=1:rc-lookahead=0",
            }
        for i in range(frames):
            img = np.roll(base, (i * int(dy), i * 3), axis=(0, 1))
            x0, y0 = (i * int(dx)) % (width - side), (i * 2) % (height - side)
            img[y0 : y0 + side, x0 : x0 + side] = (255 - 16 * i) % 256
            out.mux(stream.encode(_yuv420_frame(img)))
        out.mux(stream.encode(None))
    return buf.getvalue()


def _yuv420_frame(rgb: np.ndarray) -> av.VideoFrame:
    """An RGB picture as a yuv420p frame, converted in numpy (BT.601, limited range) into zeroed planes.

    Neither swscale nor the planes' line padding (left uninitialised by PyAV) reaches the
    encoder, so the same picture always encodes to the same bytes.
    """
    r, g, b = (rgb[..., c].astype(np.float32) for c in range(3))
    y = 16 + 0.257 * r + 0.504 * g + 0.098 * b
    u = 128 - 0.148 * r - 0.291 * g + 0.439 * b
    v = 128 + 0.439 * r - 0.368 * g - 0.071 * b
    height, width = rgb.shape[:2]
    frame = av.VideoFrame(width, height, "yuv420p")
    for plane, data in zip(frame.planes, (y, _halve(u), _halve(v))):
        view = np.frombuffer(memoryview(plane), np.uint8)
        view[:] = 0
        view.reshape(-1, plane.line_size)[: data.shape[0], : data.shape[1]] = np.clip(np.rint(data), 0, 255)
    return frame


def _halve(plane: np.ndarray) -> np.ndarray:
    """2x2 average (chroma subsampling)."""
    return (plane[0::2, 0::2] + plane[1::2, 0::2] + plane[0::2, 1::2] + plane[1::2, 1::2]) / 4


def encode_flac(seconds: float, sample_rate: int, channels: int, *, seed: int = 0) -> bytes:
    """Encode ``round(seconds * sample_rate)`` s16 samples of tones and noise as FLAC."""
    if channels not in (1, 2):
        raise ValueError(f"channels must be 1 or 2, got {channels}")
    rng = _rng(seed, sample_rate, channels, round(seconds * sample_rate))
    n = round(seconds * sample_rate)
    t = np.arange(n, dtype=np.float64) / sample_rate
    wave = np.zeros((n, channels))
    for _ in range(int(rng.integers(1, 4))):
        freq, phase = rng.uniform(80, 2000), rng.uniform(0, 2 * math.pi, channels)
        wave += rng.uniform(0.05, 0.3) * np.sin(2 * math.pi * freq * t[:, None] + phase)
    wave += rng.normal(0.0, rng.uniform(0.0, 0.05), wave.shape)
    pcm = (np.clip(wave, -1, 1) * 32767).astype("<i2").reshape(1, -1)
    layout = "mono" if channels == 1 else "stereo"
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac", container_options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream("flac", rate=sample_rate, layout=layout)
        stream.format = "s16"
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout=layout)
        frame.sample_rate, frame.pts = sample_rate, 0
        out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def _text(n_words: int, rng: np.random.Generator) -> str:
    """``n_words`` Zipf-distributed vocabulary words in capitalised sentences."""
    p = 1.0 / np.arange(1, len(_VOCAB) + 1)
    words = [_VOCAB[i] for i in rng.choice(len(_VOCAB), n_words, p=p / p.sum())]
    out, i = [], 0
    while i < n_words:
        sentence = words[i : i + int(rng.integers(4, 19))]
        i += len(sentence)
        out.append(" ".join([sentence[0].capitalize(), *sentence[1:]]) + ".")
    return " ".join(out)


def _kinds(spec: DemoDatasetSpec) -> list[str]:
    """Kinds in exact quota (largest remainder), permuted by the seed."""
    raw = {k: w * spec.num_samples for k, w in _KIND_WEIGHTS.items()}
    counts = {k: int(v) for k, v in raw.items()}
    short = spec.num_samples - sum(counts.values())
    for k in sorted(raw, key=lambda k: counts[k] - raw[k])[:short]:
        counts[k] += 1
    kinds = [k for k, c in counts.items() for _ in range(c)]
    return [kinds[i] for i in _rng(spec.seed, _KIND_STREAM).permutation(len(kinds))]


def _sample(spec: DemoDatasetSpec, index: int, kind: str) -> DemoSample:
    rng = _rng(spec.seed, _SAMPLE_STREAM, index)
    sub = int(rng.integers(2**31))
    key = f"sample-{index:06d}"
    fields: dict[str, bytes] = {}
    extra: dict[str, int] = {}
    if kind == "image":
        w, h = (int(v) for v in rng.integers(spec.image_px[0], spec.image_px[1] + 1, 2))
        fmt = "png" if rng.random() < spec.png_fraction else "jpg"
        fields[fmt] = encode_image(w, h, fmt, seed=sub)
        extra, words = {"width": w, "height": h}, int(rng.integers(4, 25))
    elif kind == "text":
        words = int(np.clip(rng.lognormal(math.log(60), 1.3), 5, spec.max_text_words))
    elif kind == "video":
        w0, h0, w1, h1 = spec.video_size
        w = 2 * int(rng.integers(w0 // 2, w1 // 2, endpoint=True))
        h = 2 * int(rng.integers(h0 // 2, h1 // 2, endpoint=True))
        n = int(rng.integers(*spec.video_frames, endpoint=True))
        fps = int(rng.integers(*spec.video_fps, endpoint=True))
        fields["mp4"] = encode_video(n, w, h, fps, seed=sub)
        extra, words = {"width": w, "height": h, "frames": n, "fps": fps}, int(rng.integers(4, 25))
    else:
        rate, ch = int(rng.choice([16000, 22050])), int(rng.integers(1, 3))
        seconds = float(rng.uniform(*spec.audio_seconds))
        fields["flac"] = encode_flac(seconds, rate, ch, seed=sub)
        extra = {"sample_rate": rate, "channels": ch, "audio_samples": round(seconds * rate)}
        words = max(1, round(seconds * float(rng.uniform(1.5, 3.5))))
    fields["txt"] = _text(words, rng).encode("utf-8")
    meta = {"source": "omnifeed-demo", "index": index, "kind": kind, "seed": spec.seed}
    fields["json"] = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return DemoSample(index, key, kind, dict(sorted(fields.items())), words, **extra)


def demo_samples(spec: DemoDatasetSpec) -> list[DemoSample]:
    """Generate every sample of ``spec`` in memory, in key order, with its ground truth."""
    return [_sample(spec, i, kind) for i, kind in enumerate(_kinds(spec))]


def _blocks(n: int, parts: int) -> list[range]:
    return [range(j * n // parts, (j + 1) * n // parts) for j in range(parts)]


def write_webdataset(
    out_dir: str | Path, spec: DemoDatasetSpec, *, samples: list[DemoSample] | None = None
) -> list[Path]:
    """Write ``shard-{i:04d}.tar`` WebDataset shards of contiguous samples; return their paths."""
    samples = demo_samples(spec) if samples is None else samples
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, block in enumerate(_blocks(len(samples), spec.num_shards)):
        path = out / f"shard-{i:04d}.tar"
        with open(path, "wb") as f:
            with webdataset.TarWriter(f, encoder=False, mtime=_TAR_MTIME) as tw:
                for s in (samples[j] for j in block):
                    tw.write({"__key__": s.key, **s.fields})
        paths.append(path)
    logger.info("wrote %d samples in %d shards to %s", len(samples), len(paths), out)
    return paths


def write_parquet(out_path: str | Path, spec: DemoDatasetSpec, *, samples: list[DemoSample] | None = None) -> Path:
    """Write one Parquet file: ``__key__`` plus a column per field, null where absent."""
    samples = demo_samples(spec) if samples is None else samples
    columns = {"__key__": pa.array([s.key for s in samples], pa.string())}
    for name in FIELDS:
        values = [s.fields.get(name) for s in samples]
        if name in _TEXT_FIELDS:
            text = [v.decode("utf-8") if v is not None else None for v in values]
            columns[name] = pa.array(text, pa.string())
        else:
            columns[name] = pa.array(values, pa.binary())
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=spec.row_group_size)
    logger.info("wrote %d samples to %s", len(samples), path)
    return path


def write_folder(out_dir: str | Path, spec: DemoDatasetSpec, *, samples: list[DemoSample] | None = None) -> Path:
    """Write ``part-{j:02d}/{key}.{field}`` files, contiguous samples per part; return the root."""
    samples = demo_samples(spec) if samples is None else samples
    root = Path(out_dir)
    for j, block in enumerate(_blocks(len(samples), spec.folder_parts)):
        part = root / f"part-{j:02d}"
        part.mkdir(parents=True, exist_ok=True)
        for s in (samples[i] for i in block):
            for name, data in s.fields.items():
                (part / f"{s.key}.{name}").write_bytes(data)
    logger.info("wrote %d samples to %s", len(samples), root)
    return root
