"""Video with PyAV: bytes → uint8 [T, 3, H, W] RGB frames, sampled by timestamp, decoding only what is needed.

1. The container is read from memory and the video stream's packets are demuxed (cheap:
   no decoding), giving every frame's timestamp and the keyframes.
2. Frames are chosen by timestamp: ``num_frames`` at ``start + i·duration/N`` (i < N), or
   ``fps`` at ``start + k/fps`` (while inside the clip), or every frame; the frame shown at
   that time is taken, each frame at most once, the leading ``max_frames`` kept. For a
   constant-rate clip of n frames at r fps this gives ``ceil(n·fps/r)`` frames when r > fps,
   as the bucketing cost model counts. A clip without timestamps gives its first
   ``num_frames`` (or ``max_frames``) frames.
3. Only the packets needed are decoded: from the nearest keyframe at or before each chosen
   frame (skipping whole GOPs between sparse samples), stopping as soon as the last chosen
   frame is out; on the way, a frame that is not chosen and that no other frame refers to
   (FFmpeg's ``skip_frame='NONREF'``: most B-frames) is not decoded at all, which leaves the
   chosen frames' pixels unchanged. Each chosen frame is resized in the decoder's pixel format,
   then converted to RGB, in libswscale (two passes with reused contexts: measured faster than
   one ``reformat(width, height, 'rgb24')``, as the frame is scaled before it is converted).

Errors: 'empty'; 'unsupported' (streams, but no video stream; none at all is 'corrupt');
'bomb' (frame size over ``max_pixels``: the header's, or a size that grows mid-stream, which
FFmpeg, told the guard, refuses before allocating the frame; or packets adding up to more bytes
than the file could hold); 'too_long' (more than ``max_decoded_frames`` decoded); 'truncated' (the
container ends early, or the last packet fails to decode); 'corrupt' (other container or
decoder errors, or no frame out).
Damage the decoder conceals (H.264 error concealment) comes out as damaged frames; damage it
reports fails the clip. A chosen frame the decoder never outputs is left out (T shrinks).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
from av.video.reformatter import VideoReformatter

from ._audio import av_error, no_stream_error, open_container, out_of_memory
from ._common import SWSCALE_INTERPOLATION, DecodeError, plane_rows, resized_size
from ._config import VideoDecodeConfig

logger = logging.getLogger(__name__)


def _demux(container: Any, stream: Any, byte_budget: int, key: str) -> list[Any]:
    """The stream's non-empty packets in decode order, refusing more bytes than ``byte_budget``."""
    packets, total = [], 0
    for packet in container.demux(stream):
        if packet.size == 0:
            continue
        total += packet.size
        if total > byte_budget:
            raise DecodeError(f"packets add up to more than {byte_budget} bytes", key, "video", "bomb")
        packets.append(packet)
    return packets


def choose_frames(pts: list[int], end: int, time_base: Fraction, config: VideoDecodeConfig) -> list[int]:
    """Presentation indices into sorted ``pts`` (ticks; the clip ends at ``end``) to output."""
    first = pts[0]
    if config.num_frames is not None:
        span = max(end - first, 0)
        thresholds: list[int] = [first + span * i // config.num_frames for i in range(config.num_frames)]
        picks = [bisect.bisect_right(pts, t) - 1 for t in thresholds]
    elif config.fps is not None:
        step = 1 / (Fraction(config.fps) * time_base)  # ticks between samples
        picks, k = [], 0
        while first + math.floor(k * step) < max(end, first + 1) and len(picks) < config.max_frames:
            j = bisect.bisect_right(pts, first + math.floor(k * step)) - 1
            picks.append(j)
            if j + 1 >= len(pts):
                break
            k = max(k + 1, math.ceil((pts[j + 1] - first) / step))  # next sample that can land on a new frame
    else:
        picks = list(range(len(pts)))
    return list(dict.fromkeys(picks))[: config.max_frames]


class _Decoder:
    """Feeds packets to the codec, counts frames out, keeps the wanted ones converted."""

    def __init__(
        self,
        codec: Any,
        wanted: set[int] | None,
        limit: int,
        convert: Callable[[Any], Any],
        key: str,
        max_pixels: int,
    ) -> None:
        self.codec, self.wanted, self.limit, self.convert, self.key = codec, wanted, limit, convert, key
        self.max_pixels = max_pixels
        self.decoded, self.drained, self.skipping = 0, False, False
        self.frames: dict[int, Any] = {}  # slot -> the frame converted to rgb24

    def feed(self, packet: Any, last: bool) -> None:
        if self.drained:
            self.codec.flush_buffers()
            self.drained = False
        if self.wanted is not None and (packet.pts not in self.wanted) != self.skipping:
            # a frame no other frame refers to (most B-frames) is not decoded unless it is wanted
            self.skipping = not self.skipping
            self.codec.skip_frame = "NONREF" if self.skipping else "DEFAULT"
        try:
            frames = self.codec.decode(packet)
        except Exception as exc:
            if out_of_memory(exc):
                raise
            width, height = int(self.codec.width), int(self.codec.height)
            if width * height > self.max_pixels:  # FFmpeg refused a frame size that changed mid-stream
                raise DecodeError(
                    f"frames of {width}x{height} in the stream, over max_pixels = {self.max_pixels}",
                    self.key,
                    "video",
                    "bomb",
                ) from exc
            raise av_error(exc, self.key, "video", last_packet=last) from exc
        self._take(frames)

    def drain(self) -> None:
        if not self.drained:
            self.drained = True
            self._take(self.codec.decode(None))

    def _take(self, frames: list[Any]) -> None:
        for frame in frames:
            self.decoded += 1
            if self.decoded > self.limit:
                raise DecodeError(
                    f"more than max_decoded_frames = {self.limit} frames decoded", self.key, "video", "too_long"
                )
            slot = self.decoded if self.wanted is None else frame.pts
            if self.wanted is None or (slot in self.wanted and slot not in self.frames):
                self.frames[slot] = self.convert(frame)


def _decode_chosen(packets: list[Any], wanted: list[int], decoder: _Decoder) -> None:
    """Decode just enough packets for the frames with pts in ``wanted`` (presentation order)."""
    position = {p.pts: i for i, p in enumerate(packets)}
    keyframes = [i for i, p in enumerate(packets) if p.is_keyframe]
    cursor = 0
    for pts in wanted:
        if pts in decoder.frames:
            continue
        at = position[pts]
        k = bisect.bisect_right(keyframes, at) - 1
        while k >= 0 and packets[keyframes[k]].pts > pts:  # an open GOP's leading frame: one GOP back
            k -= 1
        if k >= 0 and keyframes[k] > cursor:  # a keyframe past the cursor: skip what lies between
            decoder.drain()
            cursor = keyframes[k]
        while pts not in decoder.frames and cursor < len(packets):
            decoder.feed(packets[cursor], cursor == len(packets) - 1)
            cursor += 1
        if pts not in decoder.frames:
            decoder.drain()
        if len(decoder.frames) == len(wanted):
            return


def _decode_clip(container: Any, size: int, config: VideoDecodeConfig, key: str) -> np.ndarray:
    if not container.streams.video:
        raise no_stream_error(container, key, "video")
    stream = container.streams.video[0]
    codec = stream.codec_context
    width, height = int(codec.width), int(codec.height)
    if width < 1 or height < 1:
        raise DecodeError(f"stream declares {width}x{height} frames", key, "video", "corrupt")
    if width * height > config.max_pixels:
        raise DecodeError(
            f"stream declares {width}x{height} frames, over max_pixels = {config.max_pixels}", key, "video", "bomb"
        )
    # FFmpeg allocates no frame over the guard either: the size can change mid-stream (a new SPS)
    codec.options = {**codec.options, "max_pixels": str(config.max_pixels)}
    codec.thread_count = config.threads
    if config.threads != 1:
        codec.thread_type = "AUTO"
    out_w, out_h = resized_size(width, height, config.resize, config.size, config.max_size)
    interpolation = SWSCALE_INTERPOLATION[config.resample]

    # One libswscale context per step, reused for every frame of the clip (a frame's own
    # reformat() builds a new one each time), and scaling in the decoder's pixel format before
    # the RGB conversion: ~10x less time per frame than frame.reformat(width, height, "rgb24").
    # Threads as the decoder's: PyAV 17 made a context start a thread per core by default, twice a clip.
    scaler, to_rgb = VideoReformatter(), VideoReformatter()

    def convert(frame: Any) -> Any:
        if (frame.width, frame.height) != (out_w, out_h):
            frame = scaler.reformat(
                frame, width=out_w, height=out_h, interpolation=interpolation, threads=config.threads
            )
        return to_rgb.reformat(frame, format="rgb24", threads=config.threads)  # a frame of its own buffer

    packets = _demux(container, stream, 2 * size + 2**20, key)
    timed = [p for p in packets if not p.is_discard]  # an edit list's discarded frames are never output
    if timed and stream.time_base and all(p.pts is not None for p in packets):
        pts = sorted({p.pts for p in timed})
        last = max(timed, key=lambda p: p.pts)
        end = pts[-1] + (last.duration or (pts[-1] - pts[0]) // max(len(pts) - 1, 1))
        chosen = [pts[j] for j in choose_frames(pts, end, Fraction(stream.time_base), config)]
        decoder = _Decoder(codec, set(chosen), config.max_decoded_frames, convert, key, config.max_pixels)
        _decode_chosen(packets, chosen, decoder)
    else:  # no timestamps: the first frames in output order
        limit = min(config.num_frames or config.max_frames, config.max_frames)
        decoder = _Decoder(codec, None, config.max_decoded_frames, convert, key, config.max_pixels)
        for i, packet in enumerate(packets):
            decoder.feed(packet, i == len(packets) - 1)
            if len(decoder.frames) >= limit:
                break
        else:
            decoder.drain()
        decoder.frames = dict(list(decoder.frames.items())[:limit])
    if not decoder.frames:
        raise DecodeError("no frame could be decoded", key, "video", "corrupt")
    frames = [decoder.frames[slot] for slot in sorted(decoder.frames)]
    out = np.empty((len(frames), 3, out_h, out_w), dtype=np.uint8)
    for i, frame in enumerate(frames):
        out[i] = _rgb_rows(frame, out_w, out_h).transpose(2, 0, 1)  # one copy: no to_ndarray() in between
    logger.debug("video %s: %d of %d packets' frames decoded, %d kept", key, decoder.decoded, len(packets), len(frames))
    return out


def _rgb_rows(frame: Any, width: int, height: int) -> np.ndarray:
    """An rgb24 frame's pixels as a uint8 [H, W, 3] view of its plane (rows are ``line_size`` bytes apart)."""
    return plane_rows(frame.planes[0], height)[:, : 3 * width].reshape(height, width, 3)


def decode_video(data: bytes, config: VideoDecodeConfig, key: str = "?") -> np.ndarray:
    """Decode a video's sampled frames into a uint8 [T, 3, H, W] RGB array, resized by ``config``.

    Raises DecodeError ('empty', 'truncated', 'corrupt', 'bomb', 'too_long', 'unsupported')
    on bad input; MemoryError and KeyboardInterrupt propagate.
    """
    container = open_container(data, key, "video")
    try:
        with container:
            return _decode_clip(container, len(data), config, key)
    except DecodeError:
        raise
    except Exception as exc:
        if out_of_memory(exc):
            raise
        raise av_error(exc, key, "video") from exc
