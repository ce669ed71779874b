"""Running precache tasks: in this process, in local worker processes, or as Ray tasks (``_ray``).

Lifecycle of a local run::

    precache(job, partitions, workers)
      ├─ workers == 1: run_partition(...) here, partition after partition
      └─ else: a forkserver process pool, one task per partition; progress comes back on a queue
               └─ each worker opens the index and the NVMe tier itself (LMDB after fork)
    RunTracker: a tqdm bar in bytes (rate, ETA) fed by progress; results summed into a PrecacheReport

A worker whose driver died (kill -9 of the driver alone) exits at once, busy or idle.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context, parent_process
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omnifeed.cache import CacheError, NvmeTier
from omnifeed.loader import OmnifeedError, SampleIndex

from ._output_dir import check_cache_dir
from ._precache import Counts, Failure, PartitionResult, PrecacheJob, partition_bytes, run_partition

_POLL_S = 0.2


@dataclass
class PrecacheReport:
    """What a precache run did, summed over its tasks (every node's tier counts separately under Ray)."""

    cache: str
    entries: str
    partitions: list[int]
    nodes: int
    counts: Counts
    failures: list[Failure]
    degraded: list[str]
    seconds: float

    @property
    def could_not_run(self) -> str | None:
        """Why the run did nothing useful (the tier stopped caching, or no entry could be read), or None."""
        if self.degraded:
            return f"the NVMe tier stopped caching: {self.degraded[0]}"
        counts = self.counts
        if counts.failed and not (counts.cached or counts.present):
            return f"no entry could be read ({counts.failed} failed); first: {self.failures[0]}"
        return None

    def summary(self) -> dict[str, Any]:
        """The one-line JSON summary the command prints."""
        c = self.counts
        return {
            "cache": self.cache,
            "entries": self.entries,
            "partitions": len(self.partitions),
            "nodes": self.nodes,
            "cached": c.cached,
            "present": c.present,
            "failed": c.failed,
            "not_held": c.not_held,
            "fetched_bytes": c.fetched_bytes,
            "stored_bytes": c.stored_bytes,
            "seconds": round(self.seconds, 3),
            "fetched_bytes_per_s": round(c.fetched_bytes / self.seconds) if self.seconds > 0 else 0,
        }


class RunTracker:
    """The progress bar (bytes handled, bytes/s, ETA) and the sum of the tasks' results."""

    def __init__(self, job: PrecacheJob, partitions: Sequence[int], *, nodes: int = 1, progress: bool = True) -> None:
        self.job, self.partitions, self.nodes = job, list(partitions), nodes
        index = SampleIndex(job.index)
        self.total_bytes = nodes * sum(partition_bytes(index, p) for p in self.partitions)
        self.results: list[PartitionResult] = []
        self.started = time.perf_counter()
        self._shown = Counts()
        self.bar = tqdm(
            total=self.total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="precaching",
            disable=not progress,
            dynamic_ncols=True,
            smoothing=0.1,
        )

    def update(self, delta: Counts) -> None:
        """Progress from a running task."""
        self._shown.add(delta)
        self.bar.update(delta.handled_bytes)
        shown = self._shown
        self.bar.set_postfix(cached=shown.cached, present=shown.present, failed=shown.failed, refresh=False)

    def finish(self, result: PartitionResult) -> None:
        """A task's final result."""
        self.results.append(result)

    def report(self) -> PrecacheReport:
        """Close the bar; the sum of every result."""
        counts, failures, degraded = Counts(), [], []
        for result in sorted(self.results, key=lambda r: (r.partition, r.node)):
            counts.add(result.counts)
            failures.extend(result.failures)
            if result.degraded is not None:
                degraded.append(f"{result.node}: {result.degraded}" if result.node else result.degraded)
        self.bar.n = counts.handled_bytes  # progress that was still in flight when its task ended
        self.bar.set_postfix(cached=counts.cached, present=counts.present, failed=counts.failed, refresh=False)
        self.bar.close()
        return PrecacheReport(
            self.job.nvme.path,
            self.job.entries,
            self.partitions,
            self.nodes,
            counts,
            failures,
            degraded,
            time.perf_counter() - self.started,
        )


def precache_local(
    job: PrecacheJob, partitions: Sequence[int], *, workers: int = 1, progress: bool = True
) -> PrecacheReport:
    """Precache ``partitions`` with ``workers`` local processes (1: in this process).

    Raises OmnifeedError when a worker process dies (what was cached before stays cached), and when the tier's
    folder holds files that are not a tier's.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    check_cache_dir(Path(job.nvme.path))  # a folder of other files is not a cache to write into
    try:
        tier = NvmeTier(job.nvme)  # fail once, here, rather than once per task
    except CacheError as exc:  # another user's folder, or one open to others
        raise OmnifeedError(f"cannot cache in {job.nvme.path}: {exc}") from None
    with tier:
        if tier.degraded is not None:
            raise OmnifeedError(
                f"cannot cache in {job.nvme.path}: {tier.degraded}; give --cache a writable local directory"
            )
    tracker = RunTracker(job, partitions, progress=progress)
    try:
        if workers == 1 or len(partitions) == 1:
            for partition in partitions:
                for item in run_partition(job, partition):
                    if isinstance(item, PartitionResult):
                        tracker.finish(_on_this_node(item))
                    else:
                        tracker.update(item)
        else:
            _run_pool(job, partitions, min(workers, len(partitions)), tracker)
    except BaseException:
        tracker.bar.close()
        raise
    return tracker.report()


def _run_pool(job: PrecacheJob, partitions: Sequence[int], workers: int, tracker: RunTracker) -> None:
    # forkserver: workers fork from a clean server (no threads inherited) that imported this module once
    context = get_context("forkserver")
    context.set_forkserver_preload([__name__])
    progress: Any = context.Queue()
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_init_worker, initargs=(progress,))
    clean = False
    try:
        running: dict[Future[PartitionResult], int] = {pool.submit(_pool_task, job, p): p for p in partitions}
        while running:
            done, _ = wait(running, timeout=_POLL_S, return_when=FIRST_COMPLETED)
            _drain(progress, tracker)
            for future in done:
                running.pop(future)
                tracker.finish(future.result())
        _drain(progress, tracker)
        clean = True
    except BrokenProcessPool as exc:
        raise OmnifeedError(
            "a precache worker process died (killed, or out of memory); run the command again: "
            "entries already written are kept and skipped"
        ) from exc
    finally:
        if not clean:  # an error or Ctrl-C: stop the workers now rather than after their partitions
            for process in list(getattr(pool, "_processes", {}).values()):
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        progress.close()


def _drain(progress: Any, tracker: RunTracker) -> None:
    while True:
        try:
            tracker.update(progress.get_nowait())
        except queue.Empty:
            return


_WORKER: dict[str, Any] = {}  # set once per worker process by _init_worker: its progress queue


def _init_worker(progress: Any) -> None:
    _WORKER["progress"] = progress
    threading.Thread(target=_exit_with_driver, name="omnifeed-driver-watch", daemon=True).start()


def _exit_with_driver() -> None:
    """Exit this worker when the driver dies (killed alone), busy or idle: nobody would read its results,
    and an idle worker would wait for tasks forever. A write in progress is rolled back (LMDB)."""
    driver = parent_process()  # the driver, even though a forkserver forked this process
    if driver is not None:
        driver.join()
        os._exit(1)


def _pool_task(job: PrecacheJob, partition: int) -> PartitionResult:
    """One partition in a worker process; progress goes to the driver's queue."""
    for item in run_partition(job, partition):
        if isinstance(item, PartitionResult):
            return _on_this_node(item)
        _WORKER["progress"].put(item)
    raise AssertionError("run_partition ended without a result")


def _on_this_node(result: PartitionResult) -> PartitionResult:
    result.node = socket.gethostname()
    return result
