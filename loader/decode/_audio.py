"""Audio with PyAV (bytes → float32 [channels, samples] in [-1, 1]), and what video shares with it.

The container is read from memory (``io.BytesIO``; no temporary files). Audio is decoded
packet by packet; when its rate and channels are already the configured ones, numpy turns the
samples into float32 exactly as FFmpeg would (s16 / 32768, s32 / 2³¹); otherwise the whole
stream goes through FFmpeg's resampler (the filter graph ``av.AudioResampler`` builds, on one
thread: ``fltp``, the configured layout and rate; its buffered tail is flushed at the end) as
one frame, each run of one source format its own if the format changes mid-stream, so the output has
``round(seconds × sample_rate)`` samples give or take a few. Stereo becomes mono by FFmpeg's
default downmix; the result is clipped to [-1, 1]. (PyAV's resampler is a filter graph run
under the interpreter lock: per packet it cost 2.6 ms a 1.5 s clip and two threads decoded
less than one.)

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


# FFmpeg's own conversions to float (libswresample), applied by numpy when no resampling is needed.
_TO_FLOAT = {"s16": 1.0 / (1 << 15), "s32": 1.0 / (1 << 31), "flt": 1.0, "dbl": 1.0}
_LAYOUT = {1: "mono", 2: "stereo"}


class _Decoded:
    """The stream's decoded frames as arrays, runs of one (format, layout, rate), with the too-long guard.

    The guard counts the source samples at the output rate, so a long file is refused while it
    decodes, before anything is resampled.
    """

    def __init__(self, config: AudioDecodeConfig, key: str) -> None:
        self.limit = math.ceil(config.max_seconds * config.sample_rate) + config.sample_rate // 50
        self.rate, self.key = config.sample_rate, key
        self.runs: list[tuple[tuple[str, str, int], list[np.ndarray]]] = []
        self.source_total = 0.0

    def too_long(self) -> DecodeError:
        """The error for more samples than ``max_seconds`` (with its 20 ms of slack) at the output rate."""
        return DecodeError(f"more than {self.limit} samples after resampling", self.key, "audio", "too_long")

    def add(self, frame: Any) -> None:
        signature = (frame.format.name, frame.layout.name, int(frame.sample_rate))
        if not self.runs or self.runs[-1][0] != signature:
            self.runs.append((signature, []))
        self.runs[-1][1].append(frame.to_ndarray())
        self.source_total += frame.samples * self.rate / signature[2]
        if self.source_total > self.limit:
            raise self.too_long()


def _as_output(
    signature: tuple[str, str, int], arrays: list[np.ndarray], config: AudioDecodeConfig
) -> np.ndarray | None:
    """float32 [channels, samples] straight from the decoded arrays, or None when FFmpeg must resample or remix."""
    fmt, layout, rate = signature
    scale = _TO_FLOAT.get(fmt.removesuffix("p"))
    if scale is None or rate != config.sample_rate or layout != _LAYOUT[config.channels]:
        return None
    joined = np.concatenate(arrays, axis=1)
    if not fmt.endswith("p"):  # packed: [1, samples × channels], interleaved
        joined = joined.reshape(-1, config.channels).T
    out = joined.astype(np.float32, order="C")  # C order: a packed stereo transpose would otherwise stay F-ordered
    if scale != 1.0:
        out *= np.float32(scale)
    return out


def _resampled(
    signature: tuple[str, str, int], arrays: list[np.ndarray], config: AudioDecodeConfig
) -> list[np.ndarray]:
    """One run of decoded arrays through FFmpeg's resampler as one frame, then its flush: float32 planar chunks.

    The filter graph PyAV's ``AudioResampler`` builds (abuffer, aformat, abuffersink: FFmpeg inserts
    the resampler), on one thread: left to FFmpeg's default, each graph starts and stops a thread
    per core for every clip, which costs more than the resampling does here.
    """
    fmt, layout, rate = signature
    frame = av.AudioFrame.from_ndarray(np.concatenate(arrays, axis=1), format=fmt, layout=layout)
    frame.sample_rate = rate
    graph = av.filter.Graph()
    graph.threads = 1
    source = graph.add("abuffer", sample_rate=str(rate), sample_fmt=fmt, channel_layout=layout)
    convert = graph.add(
        "aformat", sample_rates=str(config.sample_rate), sample_fmts="fltp", channel_layouts=_LAYOUT[config.channels]
    )
    sink = graph.add("abuffersink")
    source.link_to(convert)
    convert.link_to(sink)
    graph.configure()
    graph.push(frame)
    graph.push(None)  # end of stream: the resampler's buffered tail comes out too
    chunks = []
    while True:
        try:
            chunks.append(graph.pull().to_ndarray())
        except (EOFError, BlockingIOError):
            return chunks


def _decode_stream(container: Any, config: AudioDecodeConfig, key: str) -> np.ndarray:
    if not container.streams.audio:
        raise no_stream_error(container, key, "audio")
    stream = container.streams.audio[0]
    seconds = declared_seconds(container, stream)
    if seconds > config.max_seconds:
        raise DecodeError(
            f"header declares {seconds:.1f} s, over max_seconds = {config.max_seconds}", key, "audio", "too_long"
        )
    decoded = _Decoded(config, key)
    codec = stream.codec_context
    for packet, last in with_last(container.demux(stream)):
        try:
            frames = codec.decode(packet)
        except Exception as exc:
            if out_of_memory(exc):
                raise
            raise av_error(exc, key, "audio", last_packet=last) from exc
        for frame in frames:
            decoded.add(frame)
    for frame in codec.decode(None):  # the decoder's delayed frames
        decoded.add(frame)
    if not decoded.runs:
        raise DecodeError("no audio samples could be decoded", key, "audio", "corrupt")
    direct = _as_output(*decoded.runs[0], config) if len(decoded.runs) == 1 else None
    if direct is None:
        chunks = [chunk for signature, arrays in decoded.runs for chunk in _resampled(signature, arrays, config)]
        if sum(chunk.shape[1] for chunk in chunks) > decoded.limit:
            raise decoded.too_long()
        direct = np.concatenate(chunks, axis=1).astype(np.float32, copy=False)
    if direct.shape[1] == 0:
        raise DecodeError("no audio samples could be decoded", key, "audio", "corrupt")
    return np.clip(direct, -1.0, 1.0, out=direct)


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
