"""omnifeed.loader.feed: the engine — pipeline, pools, field reads through the caches, transforms, healing, collate,
metrics."""

from ._collate import Decoded, collate
from ._config import FeedConfig, PoolConfig
from ._decoded_codec import encode_decoded
from ._feed import FEED_STATE_FORMAT, Feed, SharedResources, Taken
from ._field_source import FieldSource
from ._healing import FeedError
from ._pipeline import fields_to_decode
from ._torch_batch import to_torch
from ._transform_config import HorizontalFlip, RandomResizedCrop, TransformsConfig, TransformStep, UserTransform
from ._transforms import transform_generators

__all__ = [
    "Decoded",
    "FEED_STATE_FORMAT",
    "Feed",
    "FeedConfig",
    "FeedError",
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
    "to_torch",
    "transform_generators",
]
