"""`CpuWindows`: the node's producer processes, each on a window of its own of the CPUs the service may use.

With ``producer_cpus: split`` the service divides its CPUs (its own affinity, so a cgroup's or
``taskset``'s limit holds) into one window per live producer process, in the order they started,
and confines each process, every thread of it and its decode processes, to its window; a producer
that starts or goes re-divides them all. Each window spans at least its share of the CPUs: where
the producers do not divide them evenly, adjacent windows share the CPU on their boundary (3 CPUs,
2 producers: {0, 1} and {1, 2}), so no data-parallel rank's producer gets less than another's.

Why: a producer's decode threads drop and retake its interpreter lock for each chunk or frame
they decode. Spread over every core with the other producers' threads, the one holding it is
often preempted by another process while its own threads wait for it; on a window of its own
they take turns. On 2 cores and 2 ranks that was 4 % less CPU a batch (benchmarks/RESULTS.md,
"2026-12-05: producers on CPU windows"). Threads a producer starts later inherit their creator's
window, so confining every thread once is enough; a thread started between the listing and the
confining is caught by a second pass.

On its window a producer decodes on one thread a CPU (`decode_on_windows`, where the feed config
leaves ``pools`` and ``shared_workers`` unset): the default pools' six decode threads took turns at
one interpreter lock on one core, and cost more CPU a batch than one thread doing it all in the
order the plan needs it (benchmarks/RESULTS.md, "Producers' decode threads"). The threads follow
the window as it is re-divided (``shared_workers: cpus``: those beyond its CPUs wait).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

import psutil

from ..feed import FeedConfig

log = logging.getLogger("omnifeed.service")

_PASSES = 3  # listings of a process's threads while confining it (a thread may start between two)


def windows(cpus: Iterable[int], count: int) -> list[frozenset[int]]:
    """``count`` windows of ``cpus`` in order: window i covers [i·C/count, (i+1)·C/count) of the C CPUs, widened to
    whole CPUs (so adjacent windows share a CPU where the division is not exact)."""
    ordered = sorted(set(cpus))
    total = len(ordered)
    if count <= 0 or not total:
        return []
    return [frozenset(ordered[i * total // count : -(-(i + 1) * total // count)]) for i in range(count)]


class CpuWindows:
    """The live producer processes, each confined to its window of the service's CPUs (re-divided on every change).
    Locks itself."""

    def __init__(self, cpus: Iterable[int] | None = None) -> None:
        """``cpus``: the CPUs to divide (default: those the service's process may run on)."""
        self._cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
        self._lock = threading.Lock()
        self._pids: dict[object, int] = {}  # producer -> its process id, in the order they started

    def add(self, producer: object, pid: int) -> None:
        """``producer``'s process ``pid`` started: give every producer its window again."""
        with self._lock:
            self._pids.pop(producer, None)
            self._pids[producer] = pid
            self._apply()

    def remove(self, producer: object) -> None:
        """``producer``'s process is gone (or going): the others share its CPUs."""
        with self._lock:
            if self._pids.pop(producer, None) is not None:
                self._apply()

    def placed(self) -> dict[int, frozenset[int]]:
        """Each live producer process's window, by process id."""
        with self._lock:
            return dict(zip(self._pids.values(), windows(self._cpus, len(self._pids))))

    def _apply(self) -> None:
        for pid, window in zip(self._pids.values(), windows(self._cpus, len(self._pids))):
            _confine(pid, window)


def _confine(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of process ``pid`` and of its descendants (decode processes) on ``cpus``; a process that is gone
    meanwhile is skipped (its producer is being replaced)."""
    try:
        processes = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return
    for process in processes:
        done: set[int] = set()
        for _ in range(_PASSES):
            try:
                threads = {int(tid) for tid in os.listdir(f"/proc/{process}/task")} - done
            except OSError:
                break
            if not threads:
                break
            for tid in threads:
                try:
                    os.sched_setaffinity(tid, cpus)
                except OSError as exc:  # gone meanwhile (ESRCH), or not ours to place (EPERM)
                    if not isinstance(exc, ProcessLookupError):
                        log.debug("thread %d of producer process %d not placed: %s", tid, process, exc)
            done |= threads


def decode_on_windows(config: FeedConfig) -> FeedConfig:
    """``config`` for a producer process on a CPU window: every modality that decodes in threads decodes on shared
    workers that follow the process's CPUs (``shared_workers: cpus``, one a CPU of its window), its buffers kept."""
    pools = {
        modality: pool.model_copy(update={"workers": 0}) if pool.executor == "threads" else pool
        for modality, pool in config.pools.items()
    }
    return config.model_copy(update={"pools": pools, "shared_workers": "cpus"})
