"""Scanning every shard once into Arrow rows: in this process, or in a pool of worker processes.

A scan job never raises: a shard that cannot be scanned comes back with its error, and the
build reports it and leaves it out; the samples left out as damaged come back with every shard. Storage errors that may
pass (connection errors, time-outs) are retried with backoff first. A run stopped early (an error, Ctrl-C, SIGTERM)
terminates the workers at once instead of letting them scan every remaining shard, and a worker whose driver was killed
exits by itself.

Workers are started with multiprocessing's ``forkserver``, which makes every worker import the
caller's main script; a scan needs nothing from it, so the script is hidden while the workers
start (``_main_script_not_reimported``), and a worker that finds ``build_index`` called while
importing it anyway ends at once with ``SCRIPT_REIMPORT_EXIT`` (``exit_if_a_worker_is_importing_the_script``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from dataclasses import fields as dataclass_fields
from multiprocessing import get_context
from typing import Any

import pyarrow as pa
import xxhash

from .._errors import OmnifeedError
from ._config import IndexConfig
from ._damage import ShardDamaged
from ._records import DamagedSample, FieldLocation, SampleLengths, ScannedSample, ShardScan, ShardSpec
from ._sample_index import ROW_SCHEMA
from ._scan import scan_shard

log = logging.getLogger(__name__)

_SCAN_ATTEMPTS, _SCAN_BACKOFF_S = 3, 0.5

ScanResult = tuple[int, pa.Table, int, str | None, list[dict[str, str]], list[str]]
"""One scanned shard: (shard id, its rows, its size in bytes, the error that left it out or None, its
damaged samples as ``DamagedSample`` dicts: file, key, member, reason, error; its class names, when
its samples have ImageFolder labels, else [])."""
Scanner = Callable[[list[ShardSpec], IndexConfig], Iterator[ScanResult]]
"""Scans every shard once, yielding results in any order (local processes, or Ray tasks)."""


def scan_all(shards: list[ShardSpec], config: IndexConfig) -> Iterator[ScanResult]:
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
    pool = ProcessPoolExecutor(
        max_workers=min(config.workers, len(shards)), mp_context=context, initializer=_init_worker
    )
    finished = False
    try:
        with _main_script_not_reimported():
            results = pool.map(scan_job, jobs)  # submits every job, so the workers exist now
        workers = list((getattr(pool, "_processes", None) or {}).values())
        yield from results
        finished = True
    except BrokenProcessPool as exc:
        if any(worker.exitcode == SCRIPT_REIMPORT_EXIT for worker in workers):
            raise OmnifeedError(
                "build_index was called while a scan worker imported your script: put the call under "
                "`if __name__ == '__main__':`"
            ) from None
        raise OmnifeedError(
            "a scan worker process died (killed, out of memory, or crashed in a decoder); "
            "re-run with --workers 1 to see which shard, and check the machine's memory"
        ) from exc
    finally:
        if not finished:  # an error, Ctrl-C, SIGTERM or the consumer gone: stop the scans now, not after every shard
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)


def _init_worker() -> None:
    threading.Thread(target=_exit_with_driver, name="omnifeed-driver-watch", daemon=True).start()


def _exit_with_driver() -> None:
    """Exit this scan worker when the driver dies (killed alone): nobody would read its rows, and an idle worker
    would wait for shards forever, holding the pool's semaphores."""
    driver = multiprocessing.parent_process()  # the driver, even though a forkserver forked this process
    if driver is not None:
        driver.join()
        os._exit(1)


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
    saved: dict[str, Any] = {
        name: main.__dict__[name] for name in ("__file__", "__spec__") if main is not None and name in main.__dict__
    }
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


SCRIPT_REIMPORT_EXIT = 87
"""Exit status of a scan worker that found ``build_index`` called while it imported the main script."""


def exit_if_a_worker_is_importing_the_script() -> None:
    """In a worker process importing the main script (multiprocessing's spawn and forkserver
    do, before running any task), end the worker at once with ``SCRIPT_REIMPORT_EXIT``.

    The call comes from an unguarded script: going on would start a build in every worker,
    and raising would print a traceback per worker before its pool breaks. The parent's
    pool sees the status and raises the one-line error that says what to do.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.flush()
        os._exit(SCRIPT_REIMPORT_EXIT)


def scan_job(job: tuple[int, ShardSpec, IndexConfig]) -> ScanResult:
    """Scan one shard (retrying storage errors) into its rows; an error is returned, never raised."""
    shard_id, shard, config = job
    try:
        scan = _scan_with_retries(shard, config)
        return (
            shard_id,
            _rows_of(shard_id, shard, scan.samples),
            scan.size_bytes,
            None,
            _dicts(scan.damaged),
            scan.classes,
        )
    except ShardDamaged as exc:
        return shard_id, ROW_SCHEMA.empty_table(), 0, str(exc), _dicts(exc.damaged), []
    except OmnifeedError as exc:
        return shard_id, ROW_SCHEMA.empty_table(), 0, str(exc), [], []
    except (ConnectionError, TimeoutError) as exc:
        return (
            shard_id,
            ROW_SCHEMA.empty_table(),
            0,
            (
                f"{shard.url}: storage error after {_SCAN_ATTEMPTS} attempts ({type(exc).__name__}: {exc}); "
                "check the storage and re-run `omnifeed index`"
            ),
            [],
            [],
        )
    except Exception as exc:  # a malformed file can make a third-party parser fail any way it likes
        return shard_id, ROW_SCHEMA.empty_table(), 0, f"{shard.url}: unexpected {type(exc).__name__}: {exc}", [], []


def _dicts(damaged: list[DamagedSample]) -> list[dict[str, str]]:
    return [asdict(d) for d in damaged]


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


_LENGTH_NAMES = tuple(f.name for f in dataclass_fields(SampleLengths))
_FIELD_NAMES = tuple(f.name for f in dataclass_fields(FieldLocation))


def _rows_of(shard_id: int, shard: ShardSpec, samples: list[ScannedSample]) -> pa.Table:
    """Arrow rows for one shard's samples, each with a digest of everything the row says."""
    columns: dict[str, list[Any]] = {name: [] for name in ROW_SCHEMA.names}
    for shard_row, sample in enumerate(samples):
        lengths = {name: getattr(sample.lengths, name) for name in _LENGTH_NAMES}  # asdict's, without its deepcopy
        fields = [{name: getattr(f, name) for name in _FIELD_NAMES} for f in sample.fields]
        canonical = json.dumps([sample.key, shard.url, sample.row_group, sample.row, fields, lengths, sample.digest])
        values = {
            "key": sample.key,
            "shard": shard_id,
            "shard_row": shard_row,
            "row_group": sample.row_group,
            "row": sample.row,
            "fields": fields,
            **lengths,
            "row_digest": xxhash.xxh64_intdigest(canonical.encode()),
        }
        for name, value in values.items():
            columns[name].append(value)
    return pa.table(columns, schema=ROW_SCHEMA)


def default_workers() -> int:
    """Scan processes to use by default: the CPUs this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
