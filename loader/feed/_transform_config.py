"""`TransformsConfig`: the augmentation steps run on each decoded field, per modality, as validated data.

YAML (a list per modality; each step is a mapping with one key, the transform's name)::

    transforms:
      image:
        - random_resized_crop: {size: 224, scale: [0.08, 1.0], ratio: [0.75, 1.3333333]}
        - horizontal_flip: {p: 0.5}
        - user: {function: "my_augment:color_jitter", kwargs: {strength: 0.4}}

The built-in steps work on images (uint8 ``[3, H, W]``) and video (uint8 ``[T, 3, H, W]``,
the same crop and flip for every frame); ``user`` steps work on every modality.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator, model_validator

from .._config import StrictModel


def _size_pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else value


class RandomResizedCrop(StrictModel):
    """torchvision's RandomResizedCrop: a random area and aspect ratio of the source, resized to ``size``."""

    size: int | tuple[int, int] = Field(description="Output size, pixels: one side (a square) or [height, width].")
    scale: tuple[float, float] = Field(
        default=(0.08, 1.0), description="Range of the crop's area as a fraction of the source's area."
    )
    ratio: tuple[float, float] = Field(
        default=(3 / 4, 4 / 3), description="Range of the crop's aspect ratio (width / height), drawn log-uniformly."
    )
    resample: str = Field(default="bilinear", description="Resampling filter: nearest, bilinear, bicubic, lanczos.")

    @field_validator("size")
    @classmethod
    def _positive(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        if min(_size_pair(value)) < 1:
            raise ValueError(f"size {value} must be at least 1 pixel")
        return value

    @field_validator("scale", "ratio")
    @classmethod
    def _ordered_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not (0 < value[0] <= value[1] and math.isfinite(value[1])):
            raise ValueError(f"{list(value)} must be [low, high] with 0 < low <= high")
        return value

    @field_validator("resample")
    @classmethod
    def _known_filter(cls, value: str) -> str:
        if value not in ("nearest", "bilinear", "bicubic", "lanczos"):
            raise ValueError(f"resample {value!r} is not one of nearest, bilinear, bicubic, lanczos")
        return value

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of the output, pixels."""
        return _size_pair(self.size)


class HorizontalFlip(StrictModel):
    """Mirror left to right with probability ``p``."""

    p: float = Field(default=0.5, ge=0, le=1, description="Probability of flipping.")


class UserTransform(StrictModel):
    """A function of yours, ``function(value, key, epoch, rng, **kwargs) -> value``, imported by path."""

    function: str = Field(
        description="'module:function' (a dotted attribute path is allowed), imported where the feed decodes "
        "(the service's process too: the module must be importable there)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed on every call.")

    @field_validator("function")
    @classmethod
    def _import_path(cls, value: str) -> str:
        module, _, attribute = value.strip().partition(":")
        if not module or not attribute:
            raise ValueError(f"{value!r} is not 'module:function'")
        return value.strip()


class TransformStep(StrictModel):
    """One step: exactly one of its keys."""

    random_resized_crop: RandomResizedCrop | None = None
    horizontal_flip: HorizontalFlip | None = None
    user: UserTransform | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> TransformStep:
        given = [name for name in type(self).model_fields if getattr(self, name) is not None]
        if len(given) != 1:
            names = ", ".join(type(self).model_fields)
            raise ValueError(f"a transform step has exactly one of {names}; got {', '.join(given) or 'none'}")
        return self

    @property
    def name(self) -> str:
        """The step's kind: 'random_resized_crop', 'horizontal_flip' or 'user'."""
        return next(name for name in type(self).model_fields if getattr(self, name) is not None)

    @property
    def settings(self) -> RandomResizedCrop | HorizontalFlip | UserTransform:
        """The step's own settings."""
        value = getattr(self, self.name)
        assert value is not None
        return value  # type: ignore[no-any-return]


_PIXEL_STEPS = ("random_resized_crop", "horizontal_flip")


class TransformsConfig(StrictModel):
    """Steps run in order on each decoded field of a modality, seeded by (plan seed, epoch, sample key, field)."""

    image: tuple[TransformStep, ...] = Field(default=(), description="Steps for images (uint8 [3, H, W]).")
    video: tuple[TransformStep, ...] = Field(default=(), description="Steps for video (uint8 [T, 3, H, W]).")
    audio: tuple[TransformStep, ...] = Field(default=(), description="Steps for audio (user steps only).")
    text: tuple[TransformStep, ...] = Field(
        default=(), description="Steps for text ((str, int64 ids); user steps only)."
    )

    @model_validator(mode="after")
    def _pixels_only_for_pixels(self) -> TransformsConfig:
        for modality in ("audio", "text"):
            for step in getattr(self, modality):
                if step.name in _PIXEL_STEPS:
                    raise ValueError(f"{step.name} works on images and video, not {modality}")
        return self

    def steps(self, modality: str) -> tuple[TransformStep, ...]:
        """The steps of ``modality`` (none for 'meta')."""
        steps: tuple[TransformStep, ...] = getattr(self, modality, ())
        return steps

    def final_image_size(self) -> tuple[int, int] | None:
        """(height, width) every image has after the steps, when a built-in crop fixes it (else None)."""
        size = None
        for step in self.image:
            if isinstance(step.settings, RandomResizedCrop):
                size = step.settings.output_size
        return size
