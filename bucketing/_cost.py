"""The cost model: per-sample lengths of each padded stream, and what a micro-batch costs.

A *stream* is one padded tensor of a batch: ``text`` (tokens), ``image`` (patches after
the resize policy), ``video`` (frames × patches per frame), ``audio`` (feature frames).
A micro-batch of ``n`` samples is padded, per stream, to its longest member, so it costs

    sum over streams s of  weight_s · n · (max_s + quadratic · max_s²)

— the padding is paid for, which is what makes cost-budgeted batches of similar lengths
cheaper than fixed-size ones. Lengths of 0 mean "absent" and cost nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

STREAMS: tuple[str, ...] = ("text", "image", "video", "audio")
# index length columns each stream is computed from
INDEX_COLUMNS: tuple[str, ...] = (
    "text_tokens",
    "image_width",
    "image_height",
    "video_frames",
    "video_fps",
    "video_width",
    "video_height",
    "audio_seconds",
)


class CostModel(BaseModel):
    """How a sample's index lengths become stream lengths, and how streams are weighed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    patch_size: int = Field(default=14, ge=1, description="Vision patch side, pixels.")
    image_resize: Literal["none", "fixed", "short_side"] = Field(
        default="short_side",
        description="'none': native size; 'fixed': image_size × image_size; 'short_side': short side "
        "scaled to image_size, long side capped at max_image_size. Applies to video frames too.",
    )
    image_size: int = Field(default=224, ge=1, description="Target side for 'fixed' and 'short_side', pixels.")
    max_image_size: int = Field(default=1024, ge=1, description="Cap on the long side after resizing, pixels.")
    video_fps: float | None = Field(default=None, gt=0, description="Frames sampled per second (None: every frame).")
    video_max_frames: int | None = Field(default=None, ge=1, description="Cap on frames per clip.")
    audio_frames_per_second: float = Field(default=50.0, gt=0, description="Audio feature frames per second.")
    weights: dict[str, float] = Field(
        default_factory=lambda: dict.fromkeys(STREAMS, 1.0), description="Cost per stream unit, by stream."
    )
    quadratic: float = Field(
        default=0.0, ge=0, description="Attention term: cost += quadratic × length² per sample slot."
    )

    def weight(self, stream: str) -> float:
        """Weight of ``stream`` (0 for a stream the model does not weigh)."""
        return float(self.weights.get(stream, 0.0))


def _resized(width: np.ndarray, height: np.ndarray, model: CostModel) -> tuple[np.ndarray, np.ndarray]:
    w, h = width.astype(np.float64), height.astype(np.float64)
    if model.image_resize == "fixed":
        side = np.where(w > 0, float(model.image_size), 0.0)
        return side, side
    if model.image_resize == "short_side":
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(np.minimum(w, h) > 0, model.image_size / np.minimum(w, h), 0.0)
            w, h = np.round(w * scale), np.round(h * scale)
            cap = np.where(np.maximum(w, h) > model.max_image_size, model.max_image_size / np.maximum(w, h), 1.0)
        w, h = np.round(w * cap), np.round(h * cap)
    return w, h


def _patches(width: np.ndarray, height: np.ndarray, model: CostModel) -> np.ndarray:
    w, h = _resized(width, height, model)
    p = float(model.patch_size)
    return (np.ceil(w / p) * np.ceil(h / p)).astype(np.int64)


def stream_lengths(columns: Mapping[str, np.ndarray], model: CostModel) -> dict[str, np.ndarray]:
    """Per-sample length of every stream (int64, 0 where absent) from the index's length columns."""
    frames = columns["video_frames"].astype(np.float64)
    if model.video_fps is not None:
        native = columns["video_fps"].astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            sampled = np.where(native > model.video_fps, np.ceil(frames * model.video_fps / native), frames)
        frames = np.where(native > 0, sampled, frames)
    if model.video_max_frames is not None:
        frames = np.minimum(frames, model.video_max_frames)
    return {
        "text": columns["text_tokens"].astype(np.int64),
        "image": _patches(columns["image_width"], columns["image_height"], model),
        "video": frames.astype(np.int64) * _patches(columns["video_width"], columns["video_height"], model),
        "audio": np.ceil(columns["audio_seconds"].astype(np.float64) * model.audio_frames_per_second).astype(np.int64),
    }


def padded_cost(lengths: Mapping[str, np.ndarray], model: CostModel) -> float:
    """Cost of one micro-batch whose members have these stream lengths (padding included)."""
    total = 0.0
    for stream, values in lengths.items():
        if values.size == 0:
            continue
        longest = float(values.max())
        total += model.weight(stream) * values.size * (longest + model.quadratic * longest * longest)
    return total


def sample_costs(lengths: Mapping[str, np.ndarray], model: CostModel) -> np.ndarray:
    """Each sample's own cost, as if it were alone (no padding): float64 per sample."""
    total: np.ndarray | None = None
    for stream, values in lengths.items():
        v = values.astype(np.float64)
        part = model.weight(stream) * (v + model.quadratic * v * v)
        total = part if total is None else total + part
    return np.zeros(0) if total is None else total
