"""`omnifeed index`: scan sources in parallel and write a hash-partitioned, memory-mappable index.

Stages, each with one job:

1. expand source specs into shards (``_sources.expand_sources``);
2. scan shards in worker processes, each into an Arrow table of rows (``_rows_of``);
3. route every row to its partition by ``xxh64(key) % partitions``, spilling each
   partition to an Arrow stream file as shards arrive (memory stays one shard deep);
4. per partition: sort by key, refuse duplicated keys, write Parquet + Arrow copies;
5. write ``by_shard.npy``, ``shards.parquet`` and ``manifest.json`` (counts, length
   statistics, fingerprint). The index appears at ``out`` only when complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash
from tqdm import tqdm

from ._config import IndexConfig
from .._errors import OmnifeedError, SourceError
from ._sample_index import BY_SHARD, INDEX_FORMAT, LENGTH_COLUMNS, MANIFEST, ROW_SCHEMA, SHARDS, partition_file
from ._records import ScannedSample, ShardScan, ShardSpec
from ._scan import scan_shard
from ._sources import expand_sources

log = logging.getLogger(__name__)

_ROW_GROUP_ROWS = 65536
_SCAN_ATTEMPTS, _SCAN_BACKOFF_S = 3, 0.5
_STAT_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}

ScanResult = tuple[int, pa.Table, int, str | None]
"""One scanned shard: (shard id, its rows, its size in bytes, the error that left it out or None)."""
Scanner = Callable[[list[ShardSpec], IndexConfig], Iterator[ScanResult]]
"""Scans every shard once, yielding results in any order (local processes, or Ray tasks)."""


@dataclass
class IndexReport:
    """What `build_index` did: where the index is, its size and fingerprint, and what failed."""

    path: Path
    num_samples: int
    fingerprint: str
    shards: int
    errors: list[dict[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every source was indexed without error."""
        return not self.errors


def build_index(
    sources: Sequence[str], out: str | Path, config: IndexConfig | None = None, *, progress: bool = True,
    scanner: Scanner | None = None,
) -> IndexReport:
    """Scan ``sources`` and write the index to ``out``; shards that fail are reported and left out.

    With ``config.workers > 1`` shards are scanned in worker processes (multiprocessing
    ``forkserver``) that do not import the caller's script, so a script calling this at its
    top level, without an ``if __name__ == "__main__":`` guard, works. ``scanner`` replaces those processes (``_index_ray`` scans on a Ray cluster);
    the index written is the same whatever order it yields shards in.

    ``out`` is replaced only when it is absent, empty, or holds an omnifeed index and nothing
    else; otherwise ``OmnifeedError`` before anything is scanned. Only omnifeed's own files
    are ever deleted. Raises ``SourceError`` when no sample at all could be indexed.
    """
    _exit_if_a_worker_is_importing_the_script()
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
    _index_files_to_replace(out)  # refuse before scanning, not after
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        report = _build_into(work, shards, config, errors, progress, scanner or _scan_all)
        _replace(out, work)
        report.path = out
        return report
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def write_index_from_tables(
    tables: Iterable[pa.Table], shards: Sequence[ShardSpec], shard_bytes: Sequence[int], out: str | Path,
    config: IndexConfig | None = None,
) -> IndexReport:
    """Write an index from already-scanned row tables (``ROW_SCHEMA``); used by benchmarks and tests."""
    config = config or IndexConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spill = _PartitionSpill(out / ".spill", config.partitions)
    for table in tables:
        spill.add(table)
    return _finish(out, spill, list(shards), list(shard_bytes), config, [])


def _build_into(
    work: Path, shards: list[ShardSpec], config: IndexConfig, errors: list[dict[str, str]], progress: bool,
    scanner: Scanner,
) -> IndexReport:
    spill = _PartitionSpill(work / ".spill", config.partitions)
    shard_bytes = [0] * len(shards)
    bar = tqdm(total=len(shards), unit="shard", desc="indexing", disable=not progress, dynamic_ncols=True)
    samples = 0
    failed: dict[int, str] = {}
    for shard_id, table, size, error in scanner(shards, config):
        bar.update(1)
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
    return _finish(work, spill, shards, shard_bytes, config, errors)


def _scan_all(shards: list[ShardSpec], config: IndexConfig) -> Iterator[ScanResult]:
    """Scan results in shard order, from a process pool when more than one worker is configured."""
    jobs = [(i, shard, config) for i, shard in enumerate(shards)]
    if config.workers == 1 or len(shards) == 1:
        yield from map(scan_job, jobs)
        return
    # forkserver: workers fork from a clean server that imported the scanner once (no threads
    # inherited from this process, unlike fork; no per-worker imports, unlike spawn). Each
    # worker still imports the caller's main script, as with spawn (multiprocessing's rule).
    context = get_context("forkserver")
    context.set_forkserver_preload([__name__])
    workers: list[Any] = []
    try:
        with ProcessPoolExecutor(max_workers=min(config.workers, len(shards)), mp_context=context) as pool:
            with _main_script_not_reimported():
                results = pool.map(scan_job, jobs)  # submits every job, so the workers exist now
            workers = list((getattr(pool, "_processes", None) or {}).values())
            yield from results
    except BrokenProcessPool as exc:
        if any(worker.exitcode == _SCRIPT_REIMPORT_EXIT for worker in workers):
            raise OmnifeedError(
                "build_index was called while a scan worker imported your script: put the call under "
                "`if __name__ == '__main__':`") from None
        raise OmnifeedError(
            "a scan worker process died (killed, out of memory, or crashed in a decoder); "
            "re-run with --workers 1 to see which shard, and check the machine's memory"
        ) from exc


@contextlib.contextmanager
def _main_script_not_reimported() -> Iterator[None]:
    """Worker processes started inside do not import the caller's main script.

    multiprocessing's spawn and forkserver make every worker import ``__main__`` from its file
    (for functions defined there); a scan worker needs nothing from it, and a script calling
    `build_index` at its top level (a README snippet pasted into a file) would run again in each
    worker. The main module's ``__file__``/``__spec__``, which tell multiprocessing where it is,
    are hidden while the workers start.
    """
    main = sys.modules.get("__main__")
    saved: dict[str, Any] = {name: main.__dict__[name] for name in ("__file__", "__spec__") if main is not None and name in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


_SCRIPT_REIMPORT_EXIT = 87
"""Exit status of a scan worker that found ``build_index`` called while it imported the main script."""


def _exit_if_a_worker_is_importing_the_script() -> None:
    """In a worker process importing the main script (multiprocessing's spawn and forkserver
    do, before running any task), end the worker at once with ``_SCRIPT_REIMPORT_EXIT``.

    The call comes from an unguarded script: going on would start a build in every worker,
    and raising would print a traceback per worker before its pool breaks. The parent's
    pool sees the status and raises the one-line error that says what to do.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.flush()
        os._exit(_SCRIPT_REIMPORT_EXIT)


def scan_job(job: tuple[int, ShardSpec, IndexConfig]) -> ScanResult:
    """Scan one shard (retrying storage errors) into its rows; an error is returned, never raised."""
    shard_id, shard, config = job
    try:
        scan = _scan_with_retries(shard, config)
        return shard_id, _rows_of(shard_id, shard, scan.samples), scan.size_bytes, None
    except OmnifeedError as exc:
        return shard_id, ROW_SCHEMA.empty_table(), 0, str(exc)
    except (ConnectionError, TimeoutError) as exc:
        return shard_id, ROW_SCHEMA.empty_table(), 0, (
            f"{shard.url}: storage error after {_SCAN_ATTEMPTS} attempts ({type(exc).__name__}: {exc}); "
            "check the storage and re-run `omnifeed index`")
    except Exception as exc:  # a malformed file can make a third-party parser fail any way it likes
        return shard_id, ROW_SCHEMA.empty_table(), 0, f"{shard.url}: unexpected {type(exc).__name__}: {exc}"


def _scan_with_retries(shard: ShardSpec, config: IndexConfig) -> ShardScan:
    """Scan a shard, retrying storage errors that may pass (connection errors, time-outs) with backoff."""
    for attempt in range(_SCAN_ATTEMPTS):
        try:
            return scan_shard(shard, config)
        except (ConnectionError, TimeoutError) as exc:
            if attempt + 1 == _SCAN_ATTEMPTS:
                raise
            log.warning("%s: %s; retrying (%d/%d)", shard.url, exc, attempt + 1, _SCAN_ATTEMPTS - 1)
            time.sleep(_SCAN_BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")


def _rows_of(shard_id: int, shard: ShardSpec, samples: list[ScannedSample]) -> pa.Table:
    """Arrow rows for one shard's samples, each with a digest of everything the row says."""
    columns: dict[str, list[Any]] = {name: [] for name in ROW_SCHEMA.names}
    for shard_row, sample in enumerate(samples):
        lengths = asdict(sample.lengths)
        fields = [asdict(f) for f in sample.fields]
        canonical = json.dumps([sample.key, shard.url, sample.row_group, sample.row, fields, lengths, sample.digest])
        values = {
            "key": sample.key, "shard": shard_id, "shard_row": shard_row, "row_group": sample.row_group,
            "row": sample.row, "fields": fields, **lengths, "row_digest": xxhash.xxh64_intdigest(canonical.encode()),
        }
        for name, value in values.items():
            columns[name].append(value)
    return pa.table(columns, schema=ROW_SCHEMA)


class _PartitionSpill:
    """Routes rows to partitions by key hash, appending each to its own Arrow stream file."""

    def __init__(self, directory: Path, partitions: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.partitions = partitions
        self._writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}

    def add(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        keys = table["key"].to_pylist()
        part = np.fromiter((xxhash.xxh64_intdigest(k.encode()) % self.partitions for k in keys), np.int64, len(keys))
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(self.partitions + 1))
        for p in np.flatnonzero(np.diff(bounds)):
            chunk = table.take(pa.array(order[bounds[p] : bounds[p + 1]]))
            self._writer(int(p)).write_table(chunk)

    def _writer(self, p: int) -> pa.ipc.RecordBatchStreamWriter:
        if p not in self._writers:
            self._writers[p] = pa.ipc.new_stream(str(self.directory / f"{p}.arrows"), ROW_SCHEMA)
        return self._writers[p]

    def partitions_in_order(self) -> Iterator[pa.Table]:
        """Each partition's rows (possibly none), closing the spill files first."""
        for writer in self._writers.values():
            writer.close()
        for p in range(self.partitions):
            path = self.directory / f"{p}.arrows"
            if p in self._writers:
                with pa.memory_map(str(path), "r") as source:
                    yield pa.ipc.open_stream(source).read_all()
            else:
                yield ROW_SCHEMA.empty_table()
        shutil.rmtree(self.directory, ignore_errors=True)


def _finish(
    out: Path, spill: _PartitionSpill, shards: list[ShardSpec], shard_bytes: list[int], config: IndexConfig,
    errors: list[dict[str, str]],
) -> IndexReport:
    partitions, digests, shard_cols, length_cols = [], [], [], []
    for p, table in enumerate(spill.partitions_in_order()):
        table = _dedupe_sorted(table.sort_by([("key", "ascending"), ("shard", "ascending")]), shards, errors)
        pq.write_table(table, out / partition_file(p, "parquet"), row_group_size=_ROW_GROUP_ROWS, compression="zstd")
        with pa.OSFile(str(out / partition_file(p, "arrow")), "wb") as sink, pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
            writer.write_table(table, max_chunksize=_ROW_GROUP_ROWS)
        partitions.append({"file": partition_file(p, "parquet"), "rows": table.num_rows})
        digests.append(xxhash.xxh3_64_hexdigest(table["row_digest"].to_numpy().astype("<u8").tobytes()))
        shard_cols.append(table.select(["shard", "shard_row"]))
        length_cols.append(table.select(list(LENGTH_COLUMNS)))
    placement = pa.concat_tables(shard_cols)
    num_samples = placement.num_rows
    if num_samples == 0:
        raise SourceError("no sample could be indexed: " + "; ".join(e["error"] for e in errors))
    shard_ids = placement["shard"].to_numpy()
    np.save(out / BY_SHARD, np.lexsort((placement["shard_row"].to_numpy(), shard_ids)).astype(np.int64))
    counts = np.bincount(shard_ids, minlength=len(shards))
    pq.write_table(
        pa.table({
            "shard": pa.array(range(len(shards)), pa.int32()), "url": [s.url for s in shards],
            "kind": [s.kind for s in shards], "size_bytes": pa.array(shard_bytes, pa.int64()),
            "num_samples": pa.array(counts, pa.int64()),
        }),
        out / SHARDS,
    )
    content = {
        "format": INDEX_FORMAT, "config": config.model_dump(include={"tokenizer", "modalities", "key_column"}),
        "shards": [[s.url, s.kind, b] for s, b in zip(shards, shard_bytes)], "partitions": digests,
    }
    fingerprint = xxhash.xxh3_128_hexdigest(json.dumps(content, sort_keys=True).encode())
    lengths = pa.concat_tables(length_cols)
    manifest = {
        "format": INDEX_FORMAT, "num_samples": num_samples, "fingerprint": fingerprint,
        "partitions": partitions, "shards": len(shards), "key_hash": "xxh64(utf-8 key) % partitions",
        "modalities": _modality_counts(lengths, num_samples), "lengths": _length_stats(lengths),
        "config": config.model_dump(), "errors": errors,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return IndexReport(path=out, num_samples=num_samples, fingerprint=fingerprint, shards=len(shards), errors=errors)


def _dedupe_sorted(table: pa.Table, shards: list[ShardSpec], errors: list[dict[str, str]]) -> pa.Table:
    """Keep the first of rows sharing a key (table sorted by key, shard); report each duplicate."""
    if table.num_rows < 2:
        return table
    keys = table["key"]
    same = pc.equal(keys.slice(1), keys.slice(0, table.num_rows - 1)).to_numpy(zero_copy_only=False)
    dup_rows = np.flatnonzero(same) + 1
    if dup_rows.size == 0:
        return table
    shard_ids = table["shard"].to_numpy()
    for r in dup_rows.tolist():
        key, first, again = keys[r].as_py(), shards[shard_ids[r - 1]].url, shards[shard_ids[r]].url
        errors.append({
            "source": again, "key": key,
            "error": f"duplicate key {key!r} in {again} (also in {first}); kept the first. "
            "Keys must be unique across sources: rename one, or index the sources separately",
        })
    keep = np.ones(table.num_rows, dtype=bool)
    keep[dup_rows] = False
    return table.filter(pa.array(keep))


def _modality_counts(lengths: pa.Table, num_samples: int) -> dict[str, int]:
    has = {
        "text": lengths["text_tokens"], "image": lengths["image_width"],
        "video": lengths["video_frames"], "audio": lengths["audio_seconds"],
    }
    counts = {m: int(pc.sum(pc.greater(col, 0)).as_py() or 0) for m, col in has.items()}
    return {"samples": num_samples, **counts}


def _length_stats(lengths: pa.Table) -> dict[str, dict[str, float]]:
    stats: dict[str, dict[str, float]] = {}
    for name in LENGTH_COLUMNS:
        values = lengths[name].to_numpy()
        values = values[values > 0]
        if values.size == 0:
            continue
        q = np.quantile(values, list(_STAT_QUANTILES.values()))
        stats[name] = {
            "count": int(values.size), "min": float(values.min()), "max": float(values.max()),
            "mean": float(values.mean()), "sum": float(values.sum(dtype=np.float64)),
            **{k: float(v) for k, v in zip(_STAT_QUANTILES, q)},
        }
    return stats


_OWN_FILE = re.compile(r"part-\d{5,}\.(parquet|arrow|arrow\.tmp)")  # partitions, and an Arrow copy being re-made
_OWN_NAMES = {MANIFEST, SHARDS, BY_SHARD}


def _index_files_to_replace(out: Path) -> list[str]:
    """The entries of ``out`` that replacing it deletes: none when absent or empty, an omnifeed
    index's own files when it holds one and nothing else; OmnifeedError (one line) otherwise."""
    what_to_do = f"choose another --out, or remove {out} yourself"
    if out.is_symlink():
        raise OmnifeedError(f"{out}: a symbolic link; omnifeed writes an index only to a real path: {what_to_do}")
    if not out.exists():
        return []
    if not out.is_dir():
        raise OmnifeedError(f"{out}: exists and is not a folder; {what_to_do}")
    names = sorted(entry.name for entry in out.iterdir())
    if not names:
        return []
    foreign = [name for name in names if not (
        (name in _OWN_NAMES or _OWN_FILE.fullmatch(name)) and (out / name).is_file() and not (out / name).is_symlink())]
    if MANIFEST not in names or not _is_omnifeed_manifest(out / MANIFEST):
        raise OmnifeedError(f"{out}: not empty and not an omnifeed index (no omnifeed manifest.json); omnifeed "
                            f"replaces only an empty folder or an index it wrote: {what_to_do}")
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OmnifeedError(f"{out}: holds an omnifeed index and files omnifeed did not write ({shown}), which it "
                            f"will not delete: move them away, {what_to_do}")
    return names


def _is_omnifeed_manifest(path: Path) -> bool:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith(INDEX_FORMAT.split("/")[0] + "/")


def _replace(out: Path, work: Path) -> None:
    """Move the finished index ``work`` to ``out``, deleting only the old index's own files."""
    old = _index_files_to_replace(out)  # again: the folder may have changed while the sources were scanned
    if not out.exists():
        work.rename(out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, aside)  # onto the empty folder just made: out never holds a mix of two indexes
    work.rename(out)
    for name in old:
        (aside / name).unlink(missing_ok=True)
    try:
        aside.rmdir()
    except OSError:  # something was written into out while it was checked: left where it is now
        log.warning("%s: files appeared in the old index while it was replaced; they are kept in %s", out, aside)


def default_workers() -> int:
    """Scan processes to use by default: the CPUs this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
