"""Deterministic augmentation: the transform steps run on a field after decoding, random only through a seeded rng.

Every field's steps draw from generators that are a pure function of (plan seed, epoch, sample
key, field name)::

    SeedSequence([TRANSFORM_STREAM, seed, epoch, xxh3_64(key), xxh3_64(field)]).spawn(len(steps))
    → one numpy.random.Generator(PCG64(...)) per step

so a sample gets a new crop every epoch, the same crop after a resume (or on another rank, or
in the service), and adding a step does not change the draws of the steps before it. Nothing
reads the global numpy, random or torch generators.

Transforms run after the cache: a decoded cache entry (``cache.entries: decoded``) holds the
value before any step, so a random crop is never frozen into the cache (and no step's settings
go into the cache key). They run in the decode worker thread (after a decode process has handed
its value back, for a modality decoding in processes).

Built-in steps (uint8 images ``[3, H, W]``; video ``[T, 3, H, W]`` gets one draw for all its
frames): ``random_resized_crop`` (torchvision's ``RandomResizedCrop.get_params``: ten tries
of a log-uniform aspect ratio and a uniform area fraction, else the centre crop clamped to the
ratio range; then a Pillow resize of that box to ``size``, antialiased as torchvision v2's
default) and ``horizontal_flip``. A ``user`` step is ``function(value, key, epoch, rng,
**kwargs) -> value``; its exception, or a value the batch cannot hold, fails the sample with
reason ``user`` (see `DecodeError`), never the feed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash
from PIL import Image

from .._modalities import MODALITIES
from .._user_code import import_function
from ..decode import DecodeError, as_numpy, function_name, user_code_error
from ._transform_config import HorizontalFlip, RandomResizedCrop, TransformsConfig, UserTransform

TRANSFORM_STREAM = 0x6F6D6E6974726E73  # "omnitrns": keeps these streams apart from any other use of the seed
_FILTERS = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
_NDIM = {"image": 3, "video": 4, "audio": 2}

Step = Callable[[Any, str, int, np.random.Generator], Any]
"""One step: (value, key, epoch, rng) -> value."""


def transform_generators(seed: int, epoch: int, key: str, field: str, count: int) -> list[np.random.Generator]:
    """The generators the ``count`` steps of ``field`` of sample ``key`` draw from in ``epoch`` (see the module
    docstring)."""
    entropy = [
        TRANSFORM_STREAM,
        seed,
        epoch,
        xxhash.xxh3_64_intdigest(key.encode()),
        xxhash.xxh3_64_intdigest(field.encode()),
    ]
    return [np.random.Generator(np.random.PCG64(child)) for child in np.random.SeedSequence(entropy).spawn(count)]


def crop_box(
    height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float], rng: np.random.Generator
) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random crop: torchvision's ``RandomResizedCrop.get_params`` drawing from
    ``rng``."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    in_ratio = width / height  # fallback: the centre crop, its ratio clamped to the range
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _pixels(value: Any, step: str) -> np.ndarray:
    if not (
        isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim in (3, 4) and value.shape[-3] == 3
    ):
        shape = getattr(value, "shape", None)
        raise TypeError(
            f"{step} takes uint8 [3, H, W] images or [T, 3, H, W] video, got {type(value).__name__} "
            f"{getattr(value, 'dtype', '')} {shape}: put built-in steps before user steps that change it"
        )
    return value


def random_resized_crop(settings: RandomResizedCrop) -> Step:
    """The ``random_resized_crop`` step of ``settings``."""
    out_h, out_w = settings.output_size
    resample = _FILTERS[settings.resample]

    def step(value: Any, key: str, epoch: int, rng: np.random.Generator) -> np.ndarray:
        pixels = _pixels(value, "random_resized_crop")
        top, left, h, w = crop_box(pixels.shape[-2], pixels.shape[-1], settings.scale, settings.ratio, rng)
        frames = pixels.reshape(-1, *pixels.shape[-3:])
        out = np.empty((len(frames), 3, out_h, out_w), dtype=np.uint8)
        for i, frame in enumerate(frames):
            image = Image.fromarray(np.ascontiguousarray(frame.transpose(1, 2, 0)))  # H×W×3 uint8: RGB
            resized = image.resize((out_w, out_h), resample, box=(left, top, left + w, top + h))
            out[i] = np.asarray(resized).transpose(2, 0, 1)
        return out if pixels.ndim == 4 else out[0]

    return step


def horizontal_flip(settings: HorizontalFlip) -> Step:
    """The ``horizontal_flip`` step of ``settings``: one draw per field, whether or not it flips."""

    def step(value: Any, key: str, epoch: int, rng: np.random.Generator) -> np.ndarray:
        pixels = _pixels(value, "horizontal_flip")
        flip = rng.random() < settings.p
        return np.ascontiguousarray(pixels[..., ::-1]) if flip else pixels

    return step


def holdable(value: Any, modality: str) -> str | None:
    """Why the batch cannot hold ``value`` as a decoded ``modality`` value (None when it can)."""
    if modality == "text":
        ok = (
            isinstance(value, tuple)
            and len(value) == 2
            and isinstance(value[0], str)
            and isinstance(value[1], np.ndarray)
            and value[1].ndim == 1
            and value[1].dtype.kind in "iu"
        )
        return None if ok else "text must be (str, 1-D integer array)"
    ndim = _NDIM.get(modality)
    if ndim is None:
        return None
    if not isinstance(value, np.ndarray) or value.ndim != ndim or value.dtype.kind not in "uifb":
        return (
            f"{modality} must be a numeric array of {ndim} dimensions, got {type(value).__name__} "
            f"{getattr(value, 'dtype', '')} {getattr(value, 'shape', '')}"
        )
    return None


class Transforms:
    """The steps of a `TransformsConfig`, built once (user functions imported now: ValueError if one cannot be)."""

    def __init__(self, config: TransformsConfig, seed: int) -> None:
        self.seed = seed
        self._steps: dict[str, list[tuple[Step, str | None]]] = {}
        for modality in MODALITIES:
            built = [self._build(step.settings) for step in config.steps(modality)]
            if built:
                self._steps[modality] = built

    @staticmethod
    def _build(settings: RandomResizedCrop | HorizontalFlip | UserTransform) -> tuple[Step, str | None]:
        """(the step, the user function's name or None for a built-in)."""
        if isinstance(settings, RandomResizedCrop):
            return random_resized_crop(settings), None
        if isinstance(settings, HorizontalFlip):
            return horizontal_flip(settings), None
        function, kwargs = import_function(settings.function, "transform"), dict(settings.kwargs)

        def step(value: Any, key: str, epoch: int, rng: np.random.Generator) -> Any:
            return function(value, key, epoch, rng, **kwargs)

        return step, function_name(function)

    def apply(self, modality: str, field: str, key: str, epoch: int, value: Any, where: str) -> Any:
        """``value`` (a decoded field of sample ``key``) through the steps of ``modality``.

        ``where`` names the field's file for messages. Raises DecodeError 'user' when a user step
        raises or returns what the batch cannot hold; a ``DecodeError`` it raises keeps its reason.
        """
        steps = self._steps.get(modality)
        if not steps:
            return value
        for (step, user), rng in zip(steps, transform_generators(self.seed, epoch, key, field, len(steps))):
            if user is None:
                try:
                    value = step(value, key, epoch, rng)
                except TypeError as exc:  # a value a user step (or decoder) changed into what the step cannot take
                    raise DecodeError(f"{exc} ({where})", key, modality, "user") from exc
                continue
            try:
                value = as_numpy(step(value, key, epoch, rng))
            except DecodeError:
                raise
            except Exception as exc:
                raise user_code_error(f"transform {user}", exc, key, modality, where) from exc
            problem = holdable(value, modality)
            if problem is not None:
                raise DecodeError(
                    f"transform {user} returned a value the batch cannot hold: {problem} ({where})",
                    key,
                    modality,
                    "user",
                )
        return value
