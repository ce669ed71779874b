"""omnifeed.loader: sources and the sample index, the deterministic plan, decoding, the feed engine, the sidecar
service and the drop-in DataLoader (one subpackage per stage; docs/architecture.md).

Importing it does not import torch (the service and the command line never need it): the
engine works in numpy, and the torch-bound names (`DataLoader`, `ElasticBatchSampler`) load
on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._config import StrictModel, load_yaml, validated
from ._config_errors import ConfigError
from ._config_errors import describe as describe_validation_error
from ._errors import IndexFormatError, OmnifeedError, SourceError, StateMismatchError
from ._modalities import FIELD_MODALITIES, META, MODALITIES
from .decode import (
    AudioDecodeConfig,
    DecodeConfig,
    DecodeError,
    ImageDecodeConfig,
    TextDecodeConfig,
    VideoDecodeConfig,
    make_decoder,
)
from .feed import (
    Feed,
    FeedConfig,
    FeedError,
    HorizontalFlip,
    PoolConfig,
    RandomResizedCrop,
    TransformsConfig,
    UserTransform,
)
from .index import (
    FieldLocation,
    IndexConfig,
    IndexedSample,
    IndexReport,
    SampleIndex,
    SampleLengths,
    ShardSpec,
    build_index,
    expand_sources,
    read_field,
)
from .plan import (
    CoverageReport,
    MicroBatch,
    Plan,
    PlanConfig,
    PlanCursor,
    Step,
    delivery_records,
    read_delivery_logs,
    verify_coverage,
)

if TYPE_CHECKING:
    from .dataloader import DataLoader, ElasticBatchSampler

# Names whose modules import torch: loaded on first use (PEP 562), so that `import omnifeed.loader`
# (the service, every CLI command) starts without torch; only a trainer's process pays for it.
_LAZY = {"DataLoader": ".dataloader", "ElasticBatchSampler": ".dataloader"}


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
    "ConfigError",
    "CoverageReport",
    "DataLoader",
    "DecodeConfig",
    "DecodeError",
    "ElasticBatchSampler",
    "FIELD_MODALITIES",
    "Feed",
    "FeedConfig",
    "FeedError",
    "FieldLocation",
    "HorizontalFlip",
    "ImageDecodeConfig",
    "IndexConfig",
    "IndexFormatError",
    "IndexReport",
    "IndexedSample",
    "META",
    "MODALITIES",
    "MicroBatch",
    "OmnifeedError",
    "Plan",
    "PlanConfig",
    "PlanCursor",
    "PoolConfig",
    "RandomResizedCrop",
    "SampleIndex",
    "SampleLengths",
    "ShardSpec",
    "SourceError",
    "StateMismatchError",
    "Step",
    "StrictModel",
    "TextDecodeConfig",
    "TransformsConfig",
    "UserTransform",
    "VideoDecodeConfig",
    "build_index",
    "delivery_records",
    "describe_validation_error",
    "expand_sources",
    "load_yaml",
    "make_decoder",
    "read_delivery_logs",
    "read_field",
    "validated",
    "verify_coverage",
]
