"""omnifeed.loader.feed: the engine — pipeline, pools, field reads through the caches, healing, collate, metrics."""

from ._collate import Decoded, collate
from ._config import FeedConfig, PoolConfig
from ._decoded_codec import encode_decoded
from ._feed import FEED_STATE_FORMAT, Feed
from ._field_source import FieldSource
from ._healing import FeedError
from ._pipeline import fields_to_decode
from ._torch_batch import to_torch

__all__ = [
    "Decoded",
    "FEED_STATE_FORMAT",
    "Feed",
    "FeedConfig",
    "FeedError",
    "FieldSource",
    "PoolConfig",
    "collate",
    "encode_decoded",
    "fields_to_decode",
    "to_torch",
]
