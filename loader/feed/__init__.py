"""omnifeed.loader.feed: the engine — `DecodeEngine` (reader, decoders, pools), pipeline, field reads through the
caches, transforms, healing, collate, metrics."""

from ._collate import Decoded, collate, uncollate
from ._config import FeedConfig, PoolConfig
from ._dealing import DealtSteps
from ._decoded_codec import encode_decoded
from ._engine import DecodeEngine, SharedResources, open_feed_index, with_index_tokenizer
from ._feed import Feed, Taken
from ._field_source import FieldSource
from ._healing import FeedError
from ._metrics import FeedMetrics
from ._pipeline import FieldReader, fields_to_decode
from ._pools import DecodePools
from ._position import FEED_STATE_FORMAT, FeedPosition
from ._torch_batch import to_torch
from ._transform_config import HorizontalFlip, RandomResizedCrop, TransformsConfig, TransformStep, UserTransform
from ._transforms import transform_generators

__all__ = [
    "DealtSteps",
    "DecodeEngine",
    "DecodePools",
    "Decoded",
    "FEED_STATE_FORMAT",
    "Feed",
    "FeedConfig",
    "FeedError",
    "FeedMetrics",
    "FeedPosition",
    "FieldReader",
    "FieldSource",
    "HorizontalFlip",
    "PoolConfig",
    "RandomResizedCrop",
    "SharedResources",
    "Taken",
    "TransformStep",
    "TransformsConfig",
    "UserTransform",
    "collate",
    "encode_decoded",
    "fields_to_decode",
    "open_feed_index",
    "to_torch",
    "transform_generators",
    "uncollate",
    "with_index_tokenizer",
]
