"""Typed, validated configuration of the per-modality decoders (see docs/decoding.md).

The resize policy names and arithmetic match ``omnifeed.bucketing.CostModel`` (``image_resize``,
``image_size``, ``max_image_size``), so a decoded image has exactly the size the planner
charged for. ``crop='center'`` outputs ``size × size``: plan it with ``image_resize='fixed'``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ResizePolicy = Literal["none", "fixed", "short_side"]
Resample = Literal["bilinear", "bicubic", "lanczos"]
# Formats Pillow may identify input as: the common ones, not every plugin (EPS would run
# Ghostscript; obscure parsers are attack surface). Extend when a dataset needs more.
DEFAULT_IMAGE_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
# The index's built-in text measures (IndexConfig.tokenizer), each with its ids here (see _text.py).
BUILTIN_TOKENIZERS: tuple[str, ...] = ("regex", "whitespace", "bytes")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_sizes(size: int, max_size: int, resize: str) -> None:
    if resize == "short_side" and max_size < size:
        raise ValueError(f"max_size ({max_size}) must be >= size ({size}) for resize='short_side'")


class ImageDecodeConfig(_Model):
    """How an image field becomes a uint8 [3, H, W] RGB tensor."""

    resize: ResizePolicy = Field(
        default="short_side",
        description="'none': native size; 'fixed': size × size (aspect not kept); 'short_side': short side "
        "scaled to size, then the long side capped at max_size (same rounding as the bucketing cost model).",
    )
    size: int = Field(default=224, ge=1, description="Target side for 'fixed' and 'short_side', pixels.")
    max_size: int = Field(default=1024, ge=1, description="Cap on the long side for 'short_side', pixels.")
    crop: Literal["none", "center"] = Field(
        default="none",
        description="'center': the centred square of the short-side-resized image, size × size "
        "(needs resize='short_side'; max_size does not apply).",
    )
    draft: bool = Field(
        default=True,
        description="JPEG draft mode: let libjpeg downscale by 1/2, 1/4 or 1/8 in the DCT domain when the "
        "target is at most half the source in both sides. Faster (half the CPU on camera-sized photos); never "
        "changes the output size; pixels differ from a full decode by about 0.4 levels on average. false: "
        "Pillow's plain decode (and, with scaler 'pillow', its resize), pixel for pixel.",
    )
    max_pixels: int = Field(
        default=89_478_485,
        ge=1,
        description="Decompression-bomb guard: width × height from the header above this is refused "
        "before any pixel is decoded (Pillow's own PIL.Image.MAX_IMAGE_PIXELS guard applies too).",
    )
    backend: Literal["pillow", "dali"] = Field(
        default="pillow",
        description="'dali' decodes with an NVIDIA DALI CPU pipeline when nvidia-dali is installed "
        "(pip install 'omnifeed[dali]'), else falls back to Pillow with one warning.",
    )
    resample: Resample = Field(default="bilinear", description="Resampling filter of the resize.")
    scaler: Literal["ffmpeg", "pillow"] = Field(
        default="ffmpeg",
        description="What resizes: 'ffmpeg': libswscale (through PyAV) scales straight into planar RGB, and "
        "colour or grey JPEGs are decoded by libjpeg-turbo (simplejpeg: Pillow's pixels) straight into an array "
        "for it; less CPU an image (JPEG −27 %, PNG −8 % on 160–640 px pictures, −3.5 % on 640–1600 px photos); "
        "pixels within a level or two of Pillow's resize on photos (0.15–0.2 "
        "on average), more at a hard edge or an upscaled border. A centre crop whose box falls between pixels "
        "is resized by Pillow. 'pillow': Pillow's decode and resize, pixel for pixel.",
    )
    formats: tuple[str, ...] = Field(
        default=DEFAULT_IMAGE_FORMATS,
        min_length=1,
        description="Pillow format names accepted; anything else is refused as 'corrupt'.",
    )

    @field_validator("formats")
    @classmethod
    def _known_formats(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from PIL import Image

        Image.init()
        names = tuple(name.upper() for name in value)
        unknown = [name for name in names if name not in Image.OPEN]
        if unknown:
            raise ValueError(f"unknown image formats {unknown}: Pillow reads {', '.join(sorted(Image.OPEN))}")
        return names

    @model_validator(mode="after")
    def _consistent(self) -> ImageDecodeConfig:
        _check_sizes(self.size, self.max_size, self.resize)
        if self.crop == "center" and self.resize != "short_side":
            raise ValueError(f"crop='center' needs resize='short_side', got resize={self.resize!r}")
        return self


class VideoDecodeConfig(_Model):
    """How a video field becomes a uint8 [T, 3, H, W] RGB tensor of sampled frames."""

    num_frames: int | None = Field(
        default=None,
        ge=1,
        description="Take this many frames spread uniformly over the clip by timestamp (fewer if the clip "
        "has fewer); the first ones when the clip has no timestamps.",
    )
    fps: float | None = Field(default=None, gt=0, description="Sample at this rate, frames per second.")
    max_frames: int = Field(
        default=64,
        ge=1,
        description="Cap on output frames (the leading ones are kept, as the cost model's video_max_frames).",
    )
    resize: ResizePolicy = Field(default="short_side", description="Per-frame resize policy, as for images.")
    size: int = Field(default=224, ge=1, description="Target side for 'fixed' and 'short_side', pixels.")
    max_size: int = Field(default=1024, ge=1, description="Cap on the long side for 'short_side', pixels.")
    resample: Resample = Field(default="bilinear", description="Resampling filter (libswscale) of the resize.")
    max_pixels: int = Field(
        default=33_177_600,
        ge=1,
        description="Guard on the frame size (width × height; 8K by default): the "
        "header's, and every decoded frame's (FFmpeg's own `max_pixels`).",
    )
    max_decoded_frames: int = Field(
        default=10_000, ge=1, description="Guard: more frames decoded than this for one clip is 'too_long'."
    )
    threads: int = Field(
        default=1,
        ge=0,
        description="FFmpeg threads per clip, decoder and scaler (0: FFmpeg's choice, a thread per core each). 1 suits "
        "a pool of decode workers.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> VideoDecodeConfig:
        _check_sizes(self.size, self.max_size, self.resize)
        if self.num_frames is not None and self.fps is not None:
            raise ValueError("set at most one of num_frames and fps")
        if self.num_frames is not None and self.num_frames > self.max_frames:
            raise ValueError(f"num_frames ({self.num_frames}) must be <= max_frames ({self.max_frames})")
        return self


class AudioDecodeConfig(_Model):
    """How an audio field becomes a float32 [channels, samples] tensor in [-1, 1]."""

    sample_rate: int = Field(default=16000, ge=1000, le=384_000, description="Output sample rate, Hz.")
    channels: Literal[1, 2] = Field(default=1, description="Output channels: 1 (mono downmix) or 2 (stereo).")
    max_seconds: float = Field(default=600.0, gt=0, description="Guard: longer audio is 'too_long'.")


class TextDecodeConfig(_Model):
    """How a text field becomes (str, int64 token ids)."""

    tokenizer: str | None = Field(
        default=None,
        description="None: the index's tokenizer (from its manifest), so a text decodes to as many ids as the "
        "index counted and token budgets hold; 'regex' or 'whitespace': the index's pieces, each id the CRC-32 of "
        "the piece's UTF-8 bytes; 'bytes': the UTF-8 byte values; or 'module:function' (function may be a dotted "
        "path) called with the text and returning a sequence of ints. One that differs from the index's is refused "
        "at start.",
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="Guard: more tokens than this is 'too_long' (never truncated silently)."
    )

    @model_validator(mode="after")
    def _known_tokenizer(self) -> TextDecodeConfig:
        name = None if self.tokenizer is None else self.tokenizer.strip()
        if name is not None and name not in BUILTIN_TOKENIZERS and ":" not in name:
            raise ValueError(
                f"unknown tokenizer {self.tokenizer!r}: use {', '.join(map(repr, BUILTIN_TOKENIZERS))} "
                "or 'module:function'"
            )
        return self


class DecodeConfig(_Model):
    """Per-modality decoding: one sub-config per modality."""

    image: ImageDecodeConfig = Field(default_factory=ImageDecodeConfig, description="Images (Pillow or DALI).")
    video: VideoDecodeConfig = Field(default_factory=VideoDecodeConfig, description="Video (PyAV).")
    audio: AudioDecodeConfig = Field(default_factory=AudioDecodeConfig, description="Audio (PyAV).")
    text: TextDecodeConfig = Field(default_factory=TextDecodeConfig, description="Text (UTF-8 + tokenizer).")
