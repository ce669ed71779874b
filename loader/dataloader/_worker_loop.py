"""The worker process of the drop-in loader: seeds like torch's, fetches tasks, replies with batches.

Messages in (per worker queue): ``StartEpoch`` (a new fetcher, from a dataset state when resuming),
``Task`` (one batch to fetch), ``None`` (exit). Every task gets one ``Reply``, in task order:
``"batch"`` (a ``PackedBatch`` and the dataset's state after it), ``"ended"`` (the worker's iterable
dataset is exhausted; every later task of the epoch gets this too) or ``"error"`` (an
``ExceptionWrapper`` the main process re-raises with this worker's traceback). An exception in
``worker_init_fn`` or in starting an epoch is the reply to the worker's next task, as in torch.
"""

from __future__ import annotations

import queue
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data._utils.worker as torch_worker
from torch._utils import ExceptionWrapper
from torch.utils.data._utils import HAS_NUMPY, MP_STATUS_CHECK_INTERVAL, signal_handling

from ._fetch import BatchFetcher
from ._handoff import PackedBatch, SlotWriter


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker process is started with."""

    dataset: Any
    iterable: bool
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    worker_id: int
    num_workers: int
    slot_flags: Any
    slots_per_worker: int


@dataclass(frozen=True)
class StartEpoch:
    """Begin an epoch: a new fetcher over the dataset, from ``dataset_state`` when resuming; ``ended_iterator``: the
    state the last epoch's iterator ended in, restored first (from a state saved at an epoch's end)."""

    dataset_state: Mapping[str, Any] | None
    ended_iterator: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Task:
    """Fetch the batch of ``index``; ``generation`` tells replies to dropped tasks apart."""

    task_id: int
    generation: int
    index: Any
    snapshot: bool = True  # reply with the dataset's state after it (``snapshot_every_n_steps``)


@dataclass(frozen=True)
class Reply:
    """A worker's answer to one task."""

    task_id: int
    generation: int
    worker_id: int
    kind: str  # "batch" | "ended" | "error"
    batch: PackedBatch | None = None
    error: ExceptionWrapper | None = None
    dataset_state: Any = None
    ended: bool = False  # "batch": the iterable dataset ran out while filling it


def _seed(base_seed: int, worker_id: int) -> int:
    """Seed ``random``, ``torch`` and ``numpy`` exactly as torch's workers do; returns the worker seed."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    if HAS_NUMPY:
        import numpy as np

        np.random.seed(torch_worker._generate_state(base_seed, worker_id))
    return seed


def worker_loop(setup: WorkerSetup, tasks: Any, replies: Any, done_event: Any) -> None:
    """Run one worker until told to stop, the main process dies, or ``done_event`` is set."""
    try:
        signal_handling._set_worker_signal_handlers()
        torch.multiprocessing._set_thread_name("pt_data_worker")
        torch.set_num_threads(1)
        seed = _seed(setup.base_seed, setup.worker_id)
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=setup.worker_id, num_workers=setup.num_workers, seed=seed, dataset=setup.dataset
        )
        where = f"in DataLoader worker process {setup.worker_id}"
        pending_error: ExceptionWrapper | None = None
        try:
            if setup.worker_init_fn is not None:
                setup.worker_init_fn(setup.worker_id)
        except Exception:
            pending_error = ExceptionWrapper(where=where)
        writer = SlotWriter(setup.slot_flags, setup.worker_id * setup.slots_per_worker, setup.slots_per_worker)
        fetcher: BatchFetcher | None = None
        watchdog = torch_worker.ManagerWatchdog()
        while watchdog.is_alive():
            try:
                message = tasks.get(timeout=MP_STATUS_CHECK_INTERVAL)
            except queue.Empty:
                continue
            if message is None:
                break
            if done_event.is_set():
                continue
            if isinstance(message, StartEpoch):
                try:
                    fetcher = BatchFetcher(
                        setup.dataset,
                        iterable=setup.iterable,
                        auto_collation=setup.auto_collation,
                        collate_fn=setup.collate_fn,
                        drop_last=setup.drop_last,
                        state=message.dataset_state,
                        in_worker=True,
                        ended_iterator=message.ended_iterator,
                    )
                except Exception:
                    pending_error = pending_error or ExceptionWrapper(where=where)
                continue
            if pending_error is not None:
                reply = Reply(message.task_id, message.generation, setup.worker_id, "error", error=pending_error)
                pending_error = None
            else:
                assert fetcher is not None, "a task before StartEpoch"
                reply = _serve(message, fetcher, writer, setup.worker_id, where)
            replies.put(reply)
            del reply, message
    except KeyboardInterrupt:
        pass
    if done_event.is_set():
        replies.cancel_join_thread()
        replies.close()


def _serve(task: Task, fetcher: BatchFetcher, writer: SlotWriter, worker_id: int, where: str) -> Reply:
    try:
        try:
            batch = fetcher.fetch(task.index)
        except StopIteration:
            if not fetcher.iterable:
                raise
            fetcher.ended = True
            return Reply(task.task_id, task.generation, worker_id, "ended", dataset_state=fetcher.state())
        state = fetcher.state() if task.snapshot else None
        return Reply(
            task.task_id,
            task.generation,
            worker_id,
            "batch",
            batch=writer.pack(batch),
            dataset_state=state,
            ended=fetcher.ended,
        )
    except Exception:
        return Reply(task.task_id, task.generation, worker_id, "error", error=ExceptionWrapper(where=where))
