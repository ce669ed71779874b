"""omnifeed.loader.decode: per-modality decoders and their configs, meta fields by type, DALI, decode worker processes."""

from ._common import REASONS, DecodeError
from ._config import AudioDecodeConfig, DecodeConfig, ImageDecodeConfig, TextDecodeConfig, VideoDecodeConfig
from ._meta import decode_meta
from ._registry import make_decoder

__all__ = [
    "AudioDecodeConfig",
    "DecodeConfig",
    "DecodeError",
    "ImageDecodeConfig",
    "REASONS",
    "TextDecodeConfig",
    "VideoDecodeConfig",
    "decode_meta",
    "make_decoder",
]
