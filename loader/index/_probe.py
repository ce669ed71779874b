"""Per-modality length measurement from headers only: nothing is fully decoded at index time.

- images: Pillow's ``Image.open`` reads the header; pixels are never loaded;
- video: PyAV container and stream headers; frames from ``stream.frames``, else duration x
  average rate, else the number of demuxed video packets (demuxed, never decoded);
- audio: PyAV; seconds from the stream duration, else the container duration, else the sum
  of the demuxed packets' durations;
- text: UTF-8 decoded and measured by a token counter (see ``_text``).

Every probe raises SourceError on unreadable input; ``probe_lengths`` raises `FieldProbeError`,
which adds the URL, member, sample key, what to do, and the damage reason (``_damage``):
``bomb`` for a header declaring too many pixels, ``encoding`` for text that is not UTF-8,
``header`` for anything else.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO, TypeVar

import av
from PIL import Image

from .._errors import SourceError, add_context
from ._records import FieldLocation, SampleLengths

ProbeInput = bytes | Callable[[], BinaryIO]
_T = TypeVar("_T")
_ADVICE = "remove or re-encode the file, or map the field to 'meta' in IndexConfig.modalities"


class _TooLarge(SourceError):
    """A header declaring more pixels than allowed (a possible decompression bomb)."""


class _NotUtf8(SourceError):
    """A text field that is not UTF-8."""


class FieldProbeError(SourceError):
    """One field of a sample cannot be probed; ``reason``: 'header', 'bomb' or 'encoding'; ``member``: its member."""

    def __init__(self, message: str, *, url: str | None, key: str | None, reason: str, member: str) -> None:
        super().__init__(message, url=url, key=key)
        self.reason = reason
        self.member = member


def probe_image(fileobj: BinaryIO) -> tuple[int, int]:
    """Return (width, height) in pixels from the image header, without decoding pixels.

    A header declaring more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels (a possible
    decompression bomb) raises SourceError, not just Pillow's warning.
    """
    try:
        with Image.open(fileobj) as image:
            width, height = image.size
    except Image.DecompressionBombError as exc:
        raise _TooLarge(f"image header declares a decompression bomb: {exc}") from exc
    except Image.UnidentifiedImageError as exc:
        raise SourceError("unreadable image header (not an image format Pillow recognises)") from exc
    except MemoryError:
        raise
    except Exception as exc:
        raise SourceError(f"unreadable image header ({type(exc).__name__}: {exc})") from exc
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise _TooLarge(
            f"image header declares {width}x{height} = {width * height} pixels, over "
            f"PIL.Image.MAX_IMAGE_PIXELS = {limit} (a possible decompression bomb); "
            "raise PIL.Image.MAX_IMAGE_PIXELS if such images are genuine"
        )
    return width, height


def _seconds(container: Any, stream: Any) -> float:
    """Duration in seconds from the stream header, else the container header, else 0."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / av.time_base
    return 0.0


def _with_container(fileobj: BinaryIO, what: str, probe: Callable[[Any], _T]) -> _T:
    """Open ``fileobj`` with PyAV and run ``probe`` on the container, wrapping library errors."""
    try:
        with av.open(fileobj, mode="r") as container:
            return probe(container)
    except (SourceError, MemoryError):
        raise
    except Exception as exc:
        raise SourceError(f"unreadable {what} ({type(exc).__name__}: {exc})") from exc


def _video_header(container: Any) -> tuple[int, float, int, int]:
    if not container.streams.video:
        raise SourceError("no video stream in the container")
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    frames = int(stream.frames or 0)
    if frames <= 0 and fps > 0:
        frames = round(_seconds(container, stream) * fps)
    if frames <= 0:
        frames = sum(1 for packet in container.demux(stream) if packet.size)
    return frames, fps, int(stream.codec_context.width), int(stream.codec_context.height)


def probe_video(fileobj: BinaryIO) -> tuple[int, float, int, int]:
    """Return (frames, frames per second, width, height) from container and stream headers."""
    return _with_container(fileobj, "video", _video_header)


def _audio_header(container: Any) -> tuple[float, int]:
    if not container.streams.audio:
        raise SourceError("no audio stream in the container")
    stream = container.streams.audio[0]
    rate = int(stream.sample_rate or stream.codec_context.sample_rate or 0)
    seconds = _seconds(container, stream)
    if seconds <= 0:
        seconds = float(sum(p.duration * p.time_base for p in container.demux(stream) if p.duration))
    return seconds, rate


def probe_audio(fileobj: BinaryIO) -> tuple[float, int]:
    """Return (seconds, sample rate in Hz) from container and stream headers."""
    return _with_container(fileobj, "audio", _audio_header)


def probe_text(data: bytes, count_tokens: Callable[[str], int]) -> int:
    """Return the token count of UTF-8 ``data``; invalid UTF-8 raises SourceError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _NotUtf8(f"text is not valid UTF-8 (byte {exc.start}: {exc.reason})") from exc
    return int(count_tokens(text))


def _probe_field(
    location: FieldLocation, value: ProbeInput, probe: Callable[[BinaryIO], _T], url: str | None, key: str | None
) -> _T:
    """Run one probe on one field's bytes (or lazily opened file), naming the field on failure."""
    fileobj = io.BytesIO(value) if isinstance(value, (bytes, bytearray, memoryview)) else value()
    try:
        return probe(fileobj)
    except SourceError as exc:
        reason = "bomb" if isinstance(exc, _TooLarge) else "encoding" if isinstance(exc, _NotUtf8) else "header"
        raise FieldProbeError(
            f"{url}: member {location.member!r} of sample {key!r} ({location.modality} field "
            f"{location.name!r}): {exc}; {_ADVICE}",
            url=url,
            key=key,
            reason=reason,
            member=location.member,
        ) from exc
    except Exception as exc:
        add_context(exc, f"field={location.name} member={location.member} key={key} source={url}")
        raise
    finally:
        fileobj.close()


def probe_lengths(
    fields: Sequence[tuple[FieldLocation, ProbeInput]],
    count_tokens: Callable[[str], int],
    *,
    url: str | None = None,
    key: str | None = None,
) -> SampleLengths:
    """Measure one sample: text tokens summed over text fields; image, video and audio from
    the first field of that modality in field-name order ('meta' fields are not read).

    Each value is the field's bytes or a callable opening them. Raises FieldProbeError (a
    SourceError) naming ``url``, the member and ``key`` when a field cannot be probed.
    """
    tokens = 0
    found: dict[str, Any] = {}
    probes: dict[str, Callable[[BinaryIO], Any]] = {"image": probe_image, "video": probe_video, "audio": probe_audio}
    for location, value in sorted(fields, key=lambda item: item[0].name):
        modality = location.modality
        if modality == "text":
            tokens += _probe_field(location, value, lambda f: probe_text(f.read(), count_tokens), url, key)
        elif modality in probes and modality not in found:
            found[modality] = _probe_field(location, value, probes[modality], url, key)
    width, height = found.get("image", (0, 0))
    frames, fps, video_width, video_height = found.get("video", (0, 0.0, 0, 0))
    seconds, sample_rate = found.get("audio", (0.0, 0))
    return SampleLengths(
        text_tokens=tokens,
        image_width=width,
        image_height=height,
        video_frames=frames,
        video_fps=fps,
        video_width=video_width,
        video_height=video_height,
        audio_seconds=seconds,
        audio_sample_rate=sample_rate,
    )
