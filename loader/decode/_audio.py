"""Audio with PyAV (bytes → float32 [channels, samples] in [-1, 1]), and what video shares with it.

The container is read from memory (``io.BytesIO``; no temporary files). Audio is decoded
packet by packet and resampled with ``av.AudioResampler`` (``fltp``, the configured layout
and rate; its buffered tail is flushed at the end), so the output has
``round(seconds × sample_rate)`` samples give or take a few. Stereo becomes mono by
FFmpeg's default downmix; the result is clipped to [-1, 1].

Errors: 'empty'; 'unsupported' (streams, but no audio stream; none at all is 'corrupt');
'too_long' (the header's duration, or the samples decoded, over ``max_seconds``; 20 ms of
slack for resampling); 'truncated' (the container or header ends early, or the LAST packet
fails to decode — a file cut in the middle, as a partial read leaves it); 'corrupt' (any
other container or decoder error, or no samples at all). A file cut exactly at a frame
boundary decodes what it holds.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any

import av
import numpy as np

from ._common import DecodeError
from ._config import AudioDecodeConfig

logger = logging.getLogger(__name__)


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the process running out of memory (to propagate), not FFmpeg refusing a size.

    FFmpeg reports ENOMEM (``av.error.MemoryError``, a MemoryError subclass) when a corrupt
    header asks for more than it will allocate; that is bad input.
    """
    return isinstance(exc, MemoryError) and not isinstance(exc, av.error.FFmpegError)


def av_error(exc: Exception, key: str, modality: str, *, last_packet: bool = False) -> DecodeError:
    """The `DecodeError` for an exception PyAV raised on ``key``'s bytes."""
    if isinstance(exc, av.error.MemoryError):
        return DecodeError(f"FFmpeg would not allocate what the file declares ({exc})", key, modality, "corrupt")
    reason = "truncated" if isinstance(exc, EOFError) or last_packet else "corrupt"
    where = " on the last packet" if last_packet else ""
    return DecodeError(f"{type(exc).__name__}{where}: {exc}", key, modality, reason)


def open_container(data: bytes, key: str, modality: str) -> Any:
    """Open ``data`` with PyAV from memory; a container that cannot be opened is a DecodeError."""
    if not data:
        raise DecodeError("the field is zero bytes long", key, modality, "empty")
    try:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except Exception as exc:
        if out_of_memory(exc):
            raise
        raise av_error(exc, key, modality) from exc


def no_stream_error(container: Any, key: str, modality: str) -> DecodeError:
    """'unsupported' when the container holds other streams only, 'corrupt' when it holds none."""
    kinds = sorted({stream.type for stream in container.streams})
    if not kinds:
        return DecodeError("the container declares no streams at all", key, modality, "corrupt")
    detail = f"the container has no {modality} stream (only {', '.join(kinds)})"
    return DecodeError(detail, key, modality, "unsupported")


def with_last(packets: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Each non-empty packet with whether it is the last one (one packet of look-ahead)."""
    pending = None
    for packet in packets:
        if packet.size == 0:  # the demuxer's end-of-stream marker
            continue
        if pending is not None:
            yield pending, False
        pending = packet
    if pending is not None:
        yield pending, True


def declared_seconds(container: Any, stream: Any) -> float:
    """Duration from the stream header, else the container header, else 0 (unknown)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return float(container.duration / av.time_base)
    return 0.0


class _Samples:
    """Resampled chunks and their running length, with the too-long guard."""

    def __init__(self, limit: int, key: str) -> None:
        self.chunks: list[np.ndarray] = []
        self.total, self.limit, self.key = 0, limit, key

    def add(self, frames: Iterable[Any]) -> None:
        for frame in frames:
            chunk = frame.to_ndarray()
            self.total += chunk.shape[1]
            if self.total > self.limit:
                raise DecodeError(f"more than {self.limit} samples after resampling", self.key, "audio", "too_long")
            self.chunks.append(chunk)


def _decode_stream(container: Any, config: AudioDecodeConfig, key: str) -> np.ndarray:
    if not container.streams.audio:
        raise no_stream_error(container, key, "audio")
    stream = container.streams.audio[0]
    seconds = declared_seconds(container, stream)
    if seconds > config.max_seconds:
        raise DecodeError(
            f"header declares {seconds:.1f} s, over max_seconds = {config.max_seconds}", key, "audio", "too_long"
        )
    layout = "mono" if config.channels == 1 else "stereo"
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=config.sample_rate)
    samples = _Samples(math.ceil(config.max_seconds * config.sample_rate) + config.sample_rate // 50, key)
    codec = stream.codec_context
    for packet, last in with_last(container.demux(stream)):
        try:
            frames = codec.decode(packet)
        except Exception as exc:
            if out_of_memory(exc):
                raise
            raise av_error(exc, key, "audio", last_packet=last) from exc
        for frame in frames:
            samples.add(resampler.resample(frame))
    for frame in codec.decode(None):  # the decoder's delayed frames
        samples.add(resampler.resample(frame))
    samples.add(resampler.resample(None))  # the resampler's buffered tail
    if samples.total == 0:
        raise DecodeError("no audio samples could be decoded", key, "audio", "corrupt")
    out = np.concatenate(samples.chunks, axis=1).astype(np.float32, copy=False)
    return np.clip(out, -1.0, 1.0, out=out)


def decode_audio(data: bytes, config: AudioDecodeConfig, key: str = "?") -> np.ndarray:
    """Decode an audio file into float32 [channels, samples] in [-1, 1] at ``config.sample_rate`` Hz.

    Raises DecodeError ('empty', 'truncated', 'corrupt', 'too_long', 'unsupported') on bad
    input; MemoryError and KeyboardInterrupt propagate.
    """
    container = open_container(data, key, "audio")
    try:
        with container:
            return _decode_stream(container, config, key)
    except DecodeError:
        raise
    except Exception as exc:
        if out_of_memory(exc):
            raise
        raise av_error(exc, key, "audio") from exc
