"""`WorkerPoolIterator`: batches from worker processes, in order, with exact progress for resume.

Tasks (one per batch) go to workers as torch sends them: round robin in task order (map-style: task
``t`` to worker ``t % num_workers``; iterable: the next worker whose dataset is not exhausted), or
with ``in_order=False`` to the least busy worker; at most ``prefetch_factor * num_workers`` are in
flight. Batches are yielded in task order (``in_order=False``: as they arrive), each task's reply
carrying the worker's dataset state after it. A ``generation`` number on every task lets a restart
(persistent workers) or a re-deal (resize) drop what is in flight: late replies of an older
generation are discarded. Worker failures and timeouts raise as torch raises them.
"""

from __future__ import annotations

import multiprocessing.connection
import queue
import weakref
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing
import torch.utils.data._utils as torch_data_utils
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL, signal_handling

from ._handoff import SlotFlags, SlotReader, slots_per_worker
from ._iterators import LoaderIterator, LoaderMetrics
from ._settings import LoaderSettings
from ._state import EpochProgress
from ._worker_loop import Reply, StartEpoch, Task, WorkerSetup, worker_loop


@dataclass
class _InFlight:
    worker: int
    reply: Reply | None = None


class WorkerPoolIterator(LoaderIterator):
    """Loads in ``num_workers`` worker processes (kept across epochs with ``persistent_workers``)."""

    def __init__(self, settings: LoaderSettings, metrics: LoaderMetrics, resume: EpochProgress | None) -> None:
        if settings.prefetch_factor is None or settings.prefetch_factor <= 0:
            raise AssertionError(
                "prefetch_factor must be greater than 0 with worker processes (torch raises this AssertionError too)"
            )
        super().__init__(settings, metrics, resume)
        self._prefetch = settings.prefetch_factor * self._num_workers
        self._in_order = settings.in_order
        self._persistent = settings.persistent_workers
        context = settings.multiprocessing_context or torch.multiprocessing
        per_worker = slots_per_worker(settings.prefetch_factor)
        flags = SlotFlags(self._num_workers * per_worker)
        self._reader = SlotReader(flags, per_worker)
        self._replies = context.Queue()
        self._done = context.Event()
        self._task_queues: list[Any] = []
        self._workers: list[Any] = []
        assert self.progress.base_seed is not None
        self._finalizer = weakref.finalize(self, _shut_down, self._workers, self._task_queues, self._done, id(self))
        for worker_id in range(self._num_workers):
            tasks = context.Queue()
            tasks.cancel_join_thread()
            setup = WorkerSetup(
                self._dataset,
                self._iterable,
                settings.auto_collation,
                settings.collate_fn,
                settings.drop_last,
                self.progress.base_seed,
                settings.worker_init_fn,
                worker_id,
                self._num_workers,
                flags,
                per_worker,
            )
            process = context.Process(target=worker_loop, args=(setup, tasks, self._replies, self._done), daemon=True)
            process.start()
            self._task_queues.append(tasks)
            self._workers.append(process)
        signal_handling._set_worker_pids(id(self), tuple(w.pid for w in self._workers))
        signal_handling._set_SIGCHLD_handler()
        self._generation = 0
        self._tasks = _task_count(self._index_sampler) if not self._iterable else None
        self._start_epoch()

    # -- epochs ----------------------------------------------------------------------------
    def _start_epoch(self) -> None:
        """Send each worker its fetcher for the epoch and prime the pipeline."""
        ended = self.ended_iterators or [None] * self._num_workers
        for worker_id, tasks in enumerate(self._task_queues):
            tasks.put(StartEpoch(self.progress.datasets[worker_id], ended[worker_id]))
        self.ended_iterators = []
        self._reset_flight()

    def _reset_flight(self) -> None:
        self._generation += 1
        self._flight: dict[int, _InFlight] = {}
        self._next_task = self._stream.pulled
        self._head = self._next_task
        self._busy = [0] * self._num_workers
        self._exhausted_workers = list(self.progress.ended)
        self._rr = self.progress.next_worker
        self._stream_done = False
        while self._dispatch():
            pass

    def restart(self) -> EpochProgress:
        """A new epoch on the same (persistent) workers; torch draws no new base seed here."""
        finished = self.progress
        self.progress = self._begin(None, self.progress.base_seed)
        self._start_epoch()  # the workers' datasets carry their own state into the epoch ...
        if finished.status == "finished":  # ... which is known when the last epoch ran to its end
            self.progress.datasets = finished.next_epoch_datasets()
        return self.progress

    def redeal(self) -> None:
        """Drop the tasks in flight and continue from the last delivered batch."""
        self.progress.forget_dispatched()
        self._stream.pulled = self.progress.consumed
        self._reset_flight()

    # -- dispatch --------------------------------------------------------------------------
    def _choose_worker(self, task: int) -> int | None:
        active = [w for w in range(self._num_workers) if not self._exhausted_workers[w]]
        if not active:
            return None
        if not self._in_order:
            limit = self._prefetch // len(active)
            return next((w for w in active if self._busy[w] < limit), None)
        if not self._iterable:
            return task % self._num_workers
        while self._exhausted_workers[self._rr]:
            self._rr = (self._rr + 1) % self._num_workers
        worker, self._rr = self._rr, (self._rr + 1) % self._num_workers
        return worker

    def _dispatch(self) -> bool:
        """Send the next task if the pipeline has room; False when it has none or nothing is left."""
        if self._stream_done or len(self._flight) >= self._prefetch:
            return False
        while True:
            task = self._next_task
            worker = self._choose_worker(task)
            if worker is None:
                return False
            try:
                index = self._stream.pull()
            except StopIteration:
                self._stream_done = True
                return False
            self._next_task += 1
            if task not in self.progress.also_yielded:
                break
            if self._head == task:
                self._head += 1
        self.progress.dispatched(task, self._stream.snapshot())
        self._flight[task] = _InFlight(worker)
        self._busy[worker] += 1
        wanted = self.progress.wants_state(
            task, in_flight=self._prefetch, in_order=self._in_order, iterable=self._iterable, tasks=self._tasks
        )
        self._task_queues[worker].put(Task(task, self._generation, index, wanted))
        return True

    # -- receiving ---------------------------------------------------------------------------
    def _receive(self) -> None:
        reply: Reply = self._get_reply()
        flight = self._flight.get(reply.task_id) if reply.generation == self._generation else None
        if flight is None or flight.reply is not None:
            if reply.batch is not None:
                self._reader.discard(reply.worker_id, reply.batch)
            return
        flight.reply = reply
        self._busy[reply.worker_id] -= 1
        if reply.kind == "ended":
            self._exhausted_workers[reply.worker_id] = True

    def _get_reply(self) -> Reply:
        if self._timeout > 0:
            got, reply = self._try_get(self._timeout)
            if not got:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
            return reply
        while True:
            got, reply = self._try_get(MP_STATUS_CHECK_INTERVAL)
            if got:
                return reply

    def _try_get(self, timeout: float) -> tuple[bool, Any]:
        try:
            return True, self._replies.get(timeout=timeout)
        except Exception as exc:
            if not isinstance(exc, queue.Empty):  # a reset connection can come just before the process is gone
                ended = multiprocessing.connection.wait([w.sentinel for w in self._workers], timeout=1.0)
                for worker in self._workers:
                    if worker.sentinel in ended:
                        worker.join(timeout=1.0)  # waits for the exit status, which lags the closed sentinel
            failed = [w for w in self._workers if not w.is_alive()]
            if failed:
                pids = ", ".join(str(w.pid) for w in failed)
                self.close()  # and forget the pids, or every later SIGCHLD would raise this again
                raise RuntimeError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly") from exc
            if isinstance(exc, queue.Empty):
                return False, None
            raise

    # -- delivering --------------------------------------------------------------------------
    def _next_ready(self) -> tuple[int, Reply]:
        """The next reply to deliver, in task order (or as they come); StopIteration when none is left."""
        while True:
            if self._in_order:
                while self._head < self._next_task and self._head not in self._flight:
                    self._head += 1
                if self._head == self._next_task:
                    if not self._dispatch():
                        raise StopIteration
                    continue
                flight = self._flight[self._head]
                if flight.reply is None:
                    self._receive()
                    continue
                task = self._head
            else:
                task = min((t for t, f in self._flight.items() if f.reply is not None), default=-1)
                if task < 0:
                    if not self._flight and not self._dispatch():
                        raise StopIteration
                    if self._flight:
                        self._receive()
                    continue
            reply = self._flight.pop(task).reply
            assert reply is not None
            self._dispatch()
            return task, reply

    def _next_data(self) -> Any:
        while True:
            task, reply = self._next_ready()
            if reply.kind == "ended":
                self.progress.worker_ended(task, reply.worker_id, reply.dataset_state)
                continue
            if reply.kind == "error":
                self.progress.delivered(task, reply.worker_id, None, yielded=False)
                assert reply.error is not None
                reply.error.reraise()
            assert reply.batch is not None
            data = self._reader.unpack(reply.worker_id, reply.batch)
            if reply.batch.slot is None:
                self._metrics.pickled_batches += 1
            else:
                self._metrics.shared_memory_batches += 1
            self.progress.delivered(task, reply.worker_id, reply.dataset_state, yielded=True, ended=reply.ended)
            return self._pin(data)

    # -- lifecycle ----------------------------------------------------------------------------
    def _finished(self) -> None:
        if not self._persistent:
            self.close()

    def close(self) -> None:
        """Stop the workers and join them (idempotent); a closed iterator yields nothing more."""
        self.closed = True
        self._finalizer()


def _shut_down(workers: list[Any], task_queues: list[Any], done: Any, key: int) -> None:
    """Tell every worker to stop, join them briefly, terminate stragglers; forget their pids."""
    if torch_data_utils is None or torch_data_utils.python_exit_status in (True, None):
        return
    try:
        done.set()
        for tasks in task_queues:
            try:
                tasks.put(None)
            except (OSError, ValueError):
                pass
        for worker in workers:
            worker.join(timeout=MP_STATUS_CHECK_INTERVAL)
        for tasks in task_queues:
            tasks.cancel_join_thread()
            tasks.close()
    finally:
        try:
            signal_handling._remove_worker_pids(key)
        except RuntimeError:  # never registered (a worker failed to start)
            pass
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=MP_STATUS_CHECK_INTERVAL)


def _task_count(sampler: object) -> int | None:
    """The epoch's number of tasks, when the index sampler tells it."""
    try:
        return len(sampler) if isinstance(sampler, Sized) else None
    except (TypeError, NotImplementedError):
        return None
