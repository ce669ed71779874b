"""`omnifeed index`: scan sources in parallel and write a hash-partitioned, memory-mappable index.

The build driver; each stage has its module:

1. expand source specs into shards (``_sources.expand_sources``);
2. scan shards in worker processes, each into an Arrow table of rows (``_scan_pool``);
3. route every row to its partition by ``xxh64(key) % partitions``, spilling each
   partition to an Arrow stream file as shards arrive (memory stays one shard deep);
4. per partition: sort by key, refuse duplicated keys, write Parquet + Arrow copies;
5. write ``by_shard.npy``, ``shards.parquet`` and ``manifest.json`` (counts, length
   statistics, fingerprint) — steps 3 to 5 in ``_partition_writer``.

The index is built in a fresh folder beside ``out`` and appears at ``out`` only when
complete; what may be replaced there, and how, is ``_out_dir``'s.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

from .._errors import SourceError
from ._config import IndexConfig
from ._out_dir import index_files_to_replace, replace_index
from ._partition_writer import IndexReport, PartitionSpill, write_index_files
from ._records import ShardSpec
from ._scan_pool import Scanner, exit_if_a_worker_is_importing_the_script, scan_all
from ._sources import expand_sources

log = logging.getLogger(__name__)


def build_index(
    sources: Sequence[str], out: str | Path, config: IndexConfig | None = None, *, progress: bool = True,
    scanner: Scanner | None = None,
) -> IndexReport:
    """Scan ``sources`` and write the index to ``out``; shards that fail are reported and left out,
    and so are damaged samples (``IndexReport.damaged``; with ``config.strict`` they fail their shard).

    With ``config.workers > 1`` shards are scanned in worker processes (multiprocessing
    ``forkserver``) that do not import the caller's script, so a script calling this at its
    top level, without an ``if __name__ == "__main__":`` guard, works. ``scanner`` replaces those processes (``_ray_build`` scans on a Ray cluster);
    the index written is the same whatever order it yields shards in.

    ``out`` is replaced only when it is absent, empty, or holds an omnifeed index and nothing
    else; otherwise ``OmnifeedError`` before anything is scanned. Only omnifeed's own files
    are ever deleted. Raises ``SourceError`` when no sample at all could be indexed.
    """
    exit_if_a_worker_is_importing_the_script()
    config = config or IndexConfig()
    out = Path(out)
    errors: list[dict[str, str]] = []
    shards: list[ShardSpec] = []
    for spec in sources:
        try:
            shards.extend(s for s in expand_sources([spec]) if s not in shards)
        except SourceError as exc:
            errors.append({"source": spec, "error": str(exc)})
    if not shards:
        raise SourceError("; ".join(e["error"] for e in errors) if errors else "no sources given")
    index_files_to_replace(out)  # refuse before scanning, not after
    return _write_replacing(out, lambda work: _build_into(work, shards, config, errors, progress, scanner or scan_all))


def write_index_from_tables(
    tables: Iterable[pa.Table], shards: Sequence[ShardSpec], shard_bytes: Sequence[int], out: str | Path,
    config: IndexConfig | None = None,
) -> IndexReport:
    """Write an index from already-scanned row tables (``ROW_SCHEMA``); used by benchmarks and tests.

    ``out`` is replaced by the same rule as `build_index`'s (only an omnifeed index, else ``OmnifeedError``).
    """
    config = config or IndexConfig()
    out = Path(out)
    index_files_to_replace(out)

    def write(work: Path) -> IndexReport:
        spill = PartitionSpill(work / ".spill", config.partitions)
        for table in tables:
            spill.add(table)
        return write_index_files(work, spill, list(shards), list(shard_bytes), config, [])

    return _write_replacing(out, write)


def _write_replacing(out: Path, write: Callable[[Path], IndexReport]) -> IndexReport:
    """``write`` an index into a fresh folder beside ``out``, which then replaces ``out`` (`replace_index`); the
    folder is removed if ``write`` raises."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        report = write(work)
        replace_index(out, work)
        report.path = out
        return report
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def _build_into(
    work: Path, shards: list[ShardSpec], config: IndexConfig, errors: list[dict[str, str]], progress: bool,
    scanner: Scanner,
) -> IndexReport:
    spill = PartitionSpill(work / ".spill", config.partitions)
    shard_bytes = [0] * len(shards)
    bar = tqdm(total=len(shards), unit="shard", desc="indexing", disable=not progress, dynamic_ncols=True)
    samples = 0
    failed: dict[int, str] = {}
    damaged: dict[int, list[dict[str, str]]] = {}
    for shard_id, table, size, error, shard_damaged in scanner(shards, config):
        bar.update(1)
        if shard_damaged:
            damaged[shard_id] = shard_damaged
        if error is not None:
            failed[shard_id] = error
            log.error("%s", error)
            continue
        shard_bytes[shard_id] = size
        spill.add(table)  # rows are sorted per partition later: arrival order does not matter
        samples += table.num_rows
        bar.set_postfix(samples=samples, failed=len(errors) + len(failed), refresh=False)
    bar.close()
    errors.extend({"source": shards[i].url, "error": failed[i]} for i in sorted(failed))  # in shard order
    left_out = [entry for i in sorted(damaged) for entry in damaged[i]]
    return write_index_files(work, spill, shards, shard_bytes, config, errors, left_out)
