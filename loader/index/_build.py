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
complete; what may be replaced there, and how, is ``_out_dir``'s (and so is removing the building
folder a killed run left behind). Stopped early (an error, Ctrl-C, SIGTERM), the scan workers are
stopped and the building folder removed.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

from .._errors import SourceError
from ._config import IndexConfig
from ._out_dir import building_folder, index_files_to_replace, release_building_folder, replace_index
from ._partition_writer import IndexReport, PartitionSpill, write_index_files
from ._records import ShardSpec
from ._scan_pool import Scanner, exit_if_a_worker_is_importing_the_script, scan_all
from ._sources import expand_sources

log = logging.getLogger(__name__)


def build_index(
    sources: Sequence[str],
    out: str | Path,
    config: IndexConfig | None = None,
    *,
    progress: bool = True,
    scanner: Scanner | None = None,
) -> IndexReport:
    """Scan ``sources`` and write the index to ``out``; shards that fail are reported and left out,
    and so are damaged samples (``IndexReport.damaged``; with ``config.strict`` they fail their shard).

    With ``config.workers > 1`` shards are scanned in worker processes (multiprocessing
    ``forkserver``) that do not import the caller's script, so a script calling this at its
    top level, without an ``if __name__ == "__main__":`` guard, works. ``scanner`` replaces those processes
    (``_ray_build`` scans on a Ray cluster); the index written is the same whatever order it yields shards in.

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
    tables: Iterable[pa.Table],
    shards: Sequence[ShardSpec],
    shard_bytes: Sequence[int],
    out: str | Path,
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
    work = building_folder(out)
    try:
        report = write(work)
        release_building_folder(work)
        replace_index(out, work)
        report.path = out
        return report
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def _build_into(
    work: Path,
    shards: list[ShardSpec],
    config: IndexConfig,
    errors: list[dict[str, str]],
    progress: bool,
    scanner: Scanner,
) -> IndexReport:
    spill = PartitionSpill(work / ".spill", config.partitions)
    shard_bytes = [0] * len(shards)
    bar = tqdm(total=len(shards), unit="shard", desc="indexing", disable=not progress, dynamic_ncols=True)
    samples = 0
    failed: dict[int, str] = {}
    damaged: dict[int, list[dict[str, str]]] = {}
    classes: dict[int, list[str]] = {}
    results = scanner(shards, config)
    try:
        for shard_id, table, size, error, shard_damaged, shard_classes in results:
            bar.update(1)
            if shard_damaged:
                damaged[shard_id] = shard_damaged
            if error is not None:
                failed[shard_id] = error
                log.info("%s", error)  # reported once, by the caller (IndexReport.errors)
                continue
            shard_bytes[shard_id] = size
            spill.add(table)  # rows are sorted per partition later: arrival order does not matter
            samples += table.num_rows
            if shard_classes:
                classes[shard_id] = shard_classes
            bar.set_postfix(samples=samples, failed=len(errors) + len(failed), refresh=False)
    finally:
        close = getattr(results, "close", None)
        if close is not None:  # stopped early (Ctrl-C, SIGTERM, an error): the scanner stops its workers now
            close()
        bar.close()
    errors.extend({"source": shards[i].url, "error": failed[i]} for i in sorted(failed))  # in shard order
    left_out = [entry for i in sorted(damaged) for entry in damaged[i]]
    return write_index_files(
        work, spill, shards, shard_bytes, config, errors, left_out, classes=_one_class_list(shards, classes)
    )


def _one_class_list(shards: list[ShardSpec], classes: dict[int, list[str]]) -> list[str]:
    """The class names every labelled folder shares; SourceError when two folders have different ones."""
    lists = sorted(classes.items())
    for shard_id, names in lists[1:]:
        first_id, first = lists[0]
        if names != first:
            only = sorted(set(first) ^ set(names))
            raise SourceError(
                f"the class folders of {shards[first_id].url} and {shards[shard_id].url} differ ({len(first)} and "
                f"{len(names)} classes; not in both: {', '.join(only[:5])}{' ...' if len(only) > 5 else ''}), so "
                "their labels would not mean the same classes; index them separately, or give them the same class "
                "folders",
                url=shards[shard_id].url,
            )
    return lists[0][1] if lists else []
