"""omnifeed.loader: sources, the sample index, the deterministic plan, the feed engine, the drop-in DataLoader and delivery checks.

Importing it does not import torch (the service and the command line never need it): the
engine works in numpy, and the torch-bound names (`DataLoader`, `ElasticBatchSampler`) load
on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._audit import CoverageReport, delivery_records, read_delivery_logs, verify_coverage
from ._config import IndexConfig, PlanConfig
from ._cursor import PlanCursor, Step
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

if TYPE_CHECKING:
    from ._dataloader import DataLoader
    from ._dataloader_elastic import ElasticBatchSampler

# Names whose modules import torch: loaded on first use (PEP 562), so that `import omnifeed.loader`
# (the service, every CLI command) starts without torch; only a trainer's process pays for it.
_LAZY = {"DataLoader": "._dataloader", "ElasticBatchSampler": "._dataloader_elastic"}


def __getattr__(name: str) -> Any:
    """The torch-bound names of ``__all__``, imported on first access and kept."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
