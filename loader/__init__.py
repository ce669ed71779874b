"""omnifeed.loader: sources, the sample index, the deterministic plan and delivery checks."""

from ._audit import CoverageReport, delivery_records, read_delivery_logs, verify_coverage
from ._config import IndexConfig, PlanConfig
from ._cursor import PlanCursor, Step
from ._errors import IndexFormatError, OmnifeedError, SourceError, StateMismatchError
from ._index import IndexedSample, SampleIndex
from ._index_build import IndexReport, build_index
from ._plan import MicroBatch, Plan
from ._records import FieldLocation, SampleLengths, ShardSpec
from ._sources import expand_sources, read_field

__all__ = [
    "CoverageReport",
    "FieldLocation",
    "IndexConfig",
    "IndexFormatError",
    "IndexReport",
    "IndexedSample",
    "MicroBatch",
    "OmnifeedError",
    "Plan",
    "PlanConfig",
    "PlanCursor",
    "SampleIndex",
    "SampleLengths",
    "ShardSpec",
    "SourceError",
    "StateMismatchError",
    "Step",
    "build_index",
    "delivery_records",
    "expand_sources",
    "read_delivery_logs",
    "read_field",
    "verify_coverage",
]
