"""omnifeed.loader.decode: per-modality decoders and their configs, DALI, decode worker processes."""

from ._common import REASONS, DecodeError
from ._config import AudioDecodeConfig, DecodeConfig, ImageDecodeConfig, TextDecodeConfig, VideoDecodeConfig
from ._registry import make_decoder

__all__ = [
    "AudioDecodeConfig",
    "DecodeConfig",
    "DecodeError",
    "ImageDecodeConfig",
    "REASONS",
    "TextDecodeConfig",
    "VideoDecodeConfig",
    "make_decoder",
]
