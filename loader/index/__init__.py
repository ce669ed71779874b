"""omnifeed.loader.index: sources, shard scans, header probes, tokenizers, the index build and the mapped index."""

from ._build import build_index, write_index_from_tables
from ._config import IndexConfig
from ._length_rows import even_positions
from ._mixture_index import MixtureIndex, filter_positions
from ._partition_writer import IndexReport
from ._ray_build import build_index_ray, check_reachable, import_ray, ray_session
from ._records import FieldLocation, SampleLengths, ShardSpec
from ._sample_index import ROW_SCHEMA, IndexedSample, SampleIndex
from ._scan_pool import default_workers
from ._sources import column_kinds, expand_sources, read_field

__all__ = [
    "FieldLocation",
    "IndexConfig",
    "IndexReport",
    "IndexedSample",
    "MixtureIndex",
    "ROW_SCHEMA",
    "SampleIndex",
    "SampleLengths",
    "ShardSpec",
    "build_index",
    "build_index_ray",
    "check_reachable",
    "column_kinds",
    "default_workers",
    "even_positions",
    "expand_sources",
    "filter_positions",
    "import_ray",
    "ray_session",
    "read_field",
    "write_index_from_tables",
]
