"""The decoder registry: ``make_decoder(modality, config)`` → a picklable ``(bytes, key) -> value``.

Values are numpy arrays (the engine and the service never import torch; the trainer side
turns batches into tensors):

| modality | value | module |
|---|---|---|
| image | uint8 [3, H, W] RGB | `_decode_image` (Pillow), `_decode_dali` (optional) |
| video | uint8 [T, 3, H, W] RGB | `_decode_video` (PyAV) |
| audio | float32 [channels, samples] in [-1, 1] | `_decode_av` (PyAV) |
| text | (str, int64 [tokens] ids) | `_decode_text` |
| meta | the bytes unchanged here; the feed decodes meta by field name and type with `_meta.decode_meta` (it needs the field name) | `_meta` |

Bad input raises `DecodeError` with ``reason`` in `REASONS`. ``image.backend='dali'`` uses
NVIDIA DALI when it is importable and otherwise falls back to Pillow, logging one warning
per process.
"""  # noqa: E501 (Markdown table rows cannot wrap)

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._modalities import FIELD_MODALITIES
from ._audio import decode_audio
from ._common import REASONS, DecodeError, resized_size
from ._config import DecodeConfig, ImageDecodeConfig
from ._image import decode_image
from ._text import decode_text, resolve_tokenizer
from ._video import decode_video

__all__ = [
    "REASONS",
    "DecodeError",
    "Decoder",
    "decode_audio",
    "decode_image",
    "decode_text",
    "decode_video",
    "make_decoder",
    "resized_size",
]

logger = logging.getLogger(__name__)


def _keep_bytes(data: bytes, config: object, key: str = "?") -> bytes:
    return data


@dataclass(frozen=True)
class Decoder:
    """One modality's decode function bound to its config; call it with ``(data, key)``."""

    function: Callable[[bytes, Any, str], object]
    config: object

    def __call__(self, data: bytes, key: str = "?") -> object:
        """Decode ``data`` of sample ``key``; raises DecodeError on bad input."""
        return self.function(data, self.config, key)


@functools.lru_cache(maxsize=1)
def _warn_no_dali() -> None:
    logger.warning("DALI is not installed (pip install 'omnifeed[dali]'); decoding images with Pillow")


def _image_decoder(config: ImageDecodeConfig) -> Callable[[bytes, str], object]:
    if config.backend == "dali":
        try:
            from ._dali import DaliImageDecoder
        except ImportError as exc:
            logger.debug("nvidia.dali import failed: %s", exc)
            _warn_no_dali()
        else:
            return DaliImageDecoder(config)
    return Decoder(decode_image, config)


def make_decoder(modality: str, config: DecodeConfig) -> Callable[[bytes, str], object]:
    """The decoder of ``modality`` ('image', 'video', 'audio', 'text' or 'meta') under ``config``.

    Raises ValueError for an unknown modality or a text tokenizer that cannot be imported.
    """
    if modality == "image":
        return _image_decoder(config.image)
    if modality == "video":
        return Decoder(decode_video, config.video)
    if modality == "audio":
        return Decoder(decode_audio, config.audio)
    if modality == "text":
        resolve_tokenizer(config.text.tokenizer)  # fail now, not on the first sample
        return Decoder(decode_text, config.text)
    if modality == "meta":
        return Decoder(_keep_bytes, None)
    raise ValueError(f"unknown modality {modality!r}: use one of {', '.join(FIELD_MODALITIES)}")
