"""omnifeed.loader: sources, the sample index, the deterministic plan, the feed engine, the drop-in DataLoader and delivery checks."""

from ._audit import CoverageReport, delivery_records, read_delivery_logs, verify_coverage
from ._config import IndexConfig, PlanConfig
from ._cursor import PlanCursor, Step
from ._dataloader import DataLoader
from ._dataloader_elastic import ElasticBatchSampler
from ._decode import DecodeError, make_decoder
from ._decode_config import AudioDecodeConfig, DecodeConfig, ImageDecodeConfig, TextDecodeConfig, VideoDecodeConfig
from ._errors import IndexFormatError, OmnifeedError, SourceError, StateMismatchError
from ._feed import Feed
from ._feed_config import FeedConfig, PoolConfig
from ._healing import FeedError
from ._index import IndexedSample, SampleIndex
from ._index_build import IndexReport, build_index
from ._plan import MicroBatch, Plan
from ._records import FieldLocation, SampleLengths, ShardSpec
from ._sources import expand_sources, read_field

__all__ = [
    "AudioDecodeConfig",
    "CoverageReport",
    "DataLoader",
    "DecodeConfig",
    "DecodeError",
    "ElasticBatchSampler",
    "Feed",
    "FeedConfig",
    "FeedError",
    "FieldLocation",
    "ImageDecodeConfig",
    "IndexConfig",
    "IndexFormatError",
    "IndexReport",
    "IndexedSample",
    "MicroBatch",
    "OmnifeedError",
    "Plan",
    "PlanConfig",
    "PlanCursor",
    "PoolConfig",
    "SampleIndex",
    "SampleLengths",
    "ShardSpec",
    "SourceError",
    "StateMismatchError",
    "Step",
    "TextDecodeConfig",
    "VideoDecodeConfig",
    "build_index",
    "delivery_records",
    "expand_sources",
    "make_decoder",
    "read_delivery_logs",
    "read_field",
    "verify_coverage",
]
