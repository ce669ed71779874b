"""Per-modality decode pools: task queues, dedicated and shared worker threads, bounded ready buffers.

Each modality has its own queue, its own workers and its own budget of samples (and bytes)
admitted ahead of the consumer. A micro-batch is admitted only when every modality it needs
has room, except that a modality with nothing outstanding always admits (so a micro-batch
larger than a buffer cannot deadlock). Shared workers serve the modality whose queued work
takes longest to clear at its measured decode time per task (an exponential moving average)
and its dedicated workers, so workers move to the modality that is running dry.

Threads by default: Pillow and PyAV release the GIL while decoding and resizing (two image
threads decode 2× one thread), and threads share the index, the plan and the decoded tensors
without copies. A modality can decode in worker processes instead (``PoolConfig.processes``;
the threads then hand tasks over and wait): measured slower for images here, because each
result crosses a pipe (benchmarks/RESULTS.md), but there for decoders that hold the GIL.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ._feed_config import FEED_MODALITIES, FeedConfig

Task = Callable[[], int]
"""A unit of work: fetch and decode one field, store the result, return the decoded bytes."""


class DecodePools:
    """Worker threads per modality plus shared ones, with bounded per-modality buffers."""

    def __init__(self, config: FeedConfig, on_error: Callable[[BaseException], None]) -> None:
        # One lock; separate conditions so that a finished or submitted task wakes only the
        # threads that can act on it (a notify_all per task woke every worker: GIL churn).
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # admission: the scheduler waits here for room
        self._work_ready = {m: threading.Condition(lock) for m in FEED_MODALITIES}
        self._shared_work = threading.Condition(lock)
        self._limits = {m: config.pool(m) for m in FEED_MODALITIES}
        self._queues: dict[str, deque[Task]] = {m: deque() for m in FEED_MODALITIES}
        self._outstanding = dict.fromkeys(FEED_MODALITIES, 0)  # admitted, not yet released
        self._ready = dict.fromkeys(FEED_MODALITIES, 0)  # decoded, not yet released
        self._ready_bytes = dict.fromkeys(FEED_MODALITIES, 0)
        self._seconds_per_task = dict.fromkeys(FEED_MODALITIES, 0.0)  # measured, moving average
        self._closed = False
        self.read_ahead = 1  # buffer depth multiplier, raised while origin storage is degraded
        self._on_error = on_error
        self._threads: list[threading.Thread] = []
        for modality in FEED_MODALITIES:
            for i in range(self._limits[modality].workers):
                self._start(f"omnifeed-{modality}-{i}", (modality,))
        for i in range(config.shared_workers):
            self._start(f"omnifeed-shared-{i}", None)
        served = {m for m in FEED_MODALITIES if self._limits[m].workers} | (set(FEED_MODALITIES) if config.shared_workers else set())
        self._inline = set(FEED_MODALITIES) - served  # no worker would ever run these: run at submit

    def _start(self, name: str, modalities: tuple[str, ...] | None) -> None:
        thread = threading.Thread(target=self._work, args=(modalities,), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def admit(self, needs: Mapping[str, int], stopping: threading.Event) -> bool:
        """Wait until every modality in ``needs`` has room; reserve it. False if stopping first."""
        with self._cond:
            while not (self._closed or stopping.is_set() or all(self._room(m, n) for m, n in needs.items() if n)):
                self._cond.wait(0.1)
            if self._closed or stopping.is_set():
                return False
            for modality, n in needs.items():
                self._outstanding[modality] += n
            return True

    def _room(self, modality: str, n: int) -> bool:
        limit = self._limits[modality]
        if self._outstanding[modality] == 0:
            return True
        # Deeper read-ahead admits more samples, never more decoded bytes than the budget.
        samples = limit.buffer_samples * self.read_ahead
        return self._outstanding[modality] + n <= samples and self._ready_bytes[modality] < limit.buffer_bytes

    def submit(self, modality: str, task: Task) -> None:
        """Queue one admitted task of ``modality``."""
        if modality in self._inline:
            self._finish(modality, task())
            return
        with self._cond:
            self._queues[modality].append(task)
            self._work_ready[modality].notify()
            self._shared_work.notify()

    def release(self, modality: str, count: int, nbytes: int) -> None:
        """The consumer is done with ``count`` decoded fields (``nbytes``) of ``modality``."""
        with self._cond:
            self._outstanding[modality] -= count
            self._ready[modality] -= count
            self._ready_bytes[modality] -= nbytes
            self._cond.notify_all()

    def _pick(self, modalities: tuple[str, ...] | None) -> tuple[str, Task] | None:
        candidates = [m for m in (modalities or FEED_MODALITIES) if self._queues[m]]
        if not candidates:
            return None
        if modalities is None:  # a shared worker: the longest backlog in seconds of work per worker
            modality = max(candidates, key=self._backlog_seconds)
        else:
            modality = candidates[0]
        return modality, self._queues[modality].popleft()

    def _backlog_seconds(self, modality: str) -> tuple[float, float]:
        per_task = self._seconds_per_task[modality] or 1e-3  # unmeasured yet: assume cheap
        backlog = len(self._queues[modality]) * per_task / (self._limits[modality].workers + 1)
        return backlog, -self._ready[modality] / self._limits[modality].buffer_samples

    def _work(self, modalities: tuple[str, ...] | None) -> None:
        wakeup = self._shared_work if modalities is None else self._work_ready[modalities[0]]
        while True:
            with self._cond:
                picked = self._pick(modalities)
                while picked is None and not self._closed:
                    wakeup.wait(0.5)
                    picked = self._pick(modalities)
                if picked is None:
                    return
            modality, task = picked
            started = time.perf_counter()
            try:
                nbytes = task()
            except BaseException as exc:  # noqa: BLE001  reported to the consumer, who re-raises it
                self._on_error(exc)
                nbytes = 0
            self._finish(modality, nbytes, time.perf_counter() - started)

    def _finish(self, modality: str, nbytes: int, seconds: float = 0.0) -> None:
        with self._cond:
            if seconds:
                previous = self._seconds_per_task[modality]
                self._seconds_per_task[modality] = seconds if not previous else 0.8 * previous + 0.2 * seconds
            self._ready[modality] += 1
            self._ready_bytes[modality] += nbytes  # only shrinks room: nobody to wake

    def buffers(self) -> dict[str, dict[str, Any]]:
        """Per modality: decoded samples waiting for the consumer, their bytes, and queued work."""
        with self._cond:
            return {
                m: {"buffer_samples": self._ready[m], "buffer_bytes": self._ready_bytes[m], "queued": len(self._queues[m])}
                for m in FEED_MODALITIES if self._outstanding[m] or self._ready[m] or self._queues[m]
            }

    def close(self) -> None:
        """Stop every worker (queued tasks are dropped) and wait for them."""
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                queue.clear()
            self._cond.notify_all()
            self._shared_work.notify_all()
            for condition in self._work_ready.values():
                condition.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        self._threads.clear()
