"""The running part of a feed: a scheduler thread that plans ahead, the decode pools, and the queue of
micro-batches waiting for the consumer in plan order.

Lifecycle::

    Pipeline(start state) ─▶ scheduler: cursor.next_step() → this rank's micro-batches
                                   │  admit (per-modality buffers) → tasks to DecodePools
                                   ▼
              pending micro-batches (plan order) ─▶ next_ready() ─▶ the Feed assembles
    close(): stop the scheduler, stop the pools, join every thread (idempotent)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._cursor import PlanCursor, Step
from ._decode import DecodeError
from ._errors import SourceError
from ._feed_config import FeedConfig
from ._feed_metrics import FeedMetrics
from ._healing import FeedError, SampleFailure
from ._index import IndexedSample, SampleIndex
from ._plan import MicroBatch, Plan
from ._pools import DecodePools
from ._records import FieldLocation
from ._fetch import TRANSIENT, Decoder, fetch_and_decode, fetch_and_decode_in_process, from_process


@dataclass
class Slot:
    """One sample of a pending micro-batch: its index row, decoded fields, and failure if any."""

    position: int
    sample: IndexedSample
    decoded: dict[str, Any] = field(default_factory=dict)
    failure: SampleFailure | None = None


@dataclass
class PendingBatch:
    """A micro-batch of this rank on its way: the step it belongs to and its slots."""

    step: Step
    accum: int
    micro_batch: MicroBatch
    state_before: dict[str, Any]
    state_after: dict[str, Any]
    slots: list[Slot]
    counts: dict[str, int] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    remaining: int = 0


def fields_to_decode(sample: IndexedSample) -> list[tuple[str, FieldLocation]]:
    """The fields the feed decodes: the first of each media/text modality (by name), and every meta field."""
    chosen: dict[str, FieldLocation] = {}
    metas = []
    for location in sample.fields:
        if location.modality == "meta":
            metas.append(("meta", location))
        else:
            chosen.setdefault(location.modality, location)
    return [*chosen.items(), *metas]


def tensor_bytes(value: Any) -> int:
    """Bytes held by a decoded value (tensors, (text, tokens) pairs, raw bytes)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, (bytes, str)):
        return len(value)
    return 0


class FieldReader:
    """Fetches and decodes one field into a slot, in this thread or in the modality's worker processes."""

    def __init__(self, config: FeedConfig, decoders: Mapping[str, Decoder], metrics: FeedMetrics,
                 custom: frozenset[str] = frozenset()) -> None:
        self.config, self.decoders, self.metrics = config, decoders, metrics
        self._executors: dict[str, ProcessPoolExecutor] = {}
        context = get_context("forkserver")  # workers fork from a clean server, not from this threaded process
        context.set_forkserver_preload(["omnifeed.loader"])
        for modality in ("text", "image", "video", "audio"):
            processes = config.pool(modality).processes
            if processes and modality not in custom:  # a user's decoder may not pickle: it runs in threads
                self._executors[modality] = ProcessPoolExecutor(max_workers=processes, mp_context=context)

    def read(self, sample: IndexedSample, location: FieldLocation) -> tuple[Any, int]:
        """(decoded value, bytes read); raises DecodeError, SourceError or a storage error."""
        args = (sample.shard, location, sample.row_group, sample.row, sample.key)
        tail = (self.config.retries, self.config.retry_backoff_s)
        executor = self._executors.get(location.modality)
        if executor is not None:
            future = executor.submit(fetch_and_decode_in_process, *args, self.config.decode, *tail)
            value, read, retried = future.result()
            value = from_process(value)
        else:
            value, read, retried = fetch_and_decode(*args, self.decoders.get(location.modality), *tail)
        for _ in range(retried):
            self.metrics.retried()
        return value, read

    def fill(self, slot: Slot, modality: str, location: FieldLocation) -> int:
        """Read and decode one field into ``slot``; a failure is recorded on the slot. Returns bytes held."""
        if slot.failure is not None:  # another field of the sample failed: it will be replaced anyway
            return 0
        started = time.perf_counter()
        try:
            value, read = self.read(slot.sample, location)
        except DecodeError as exc:
            slot.failure = SampleFailure(slot.sample.key, slot.sample.shard.url, modality, exc.reason, str(exc))
            return 0
        except SourceError as exc:
            slot.failure = SampleFailure(slot.sample.key, slot.sample.shard.url, modality, "read", str(exc))
            return 0
        except (*TRANSIENT, OSError) as exc:
            slot.failure = SampleFailure(slot.sample.key, slot.sample.shard.url, modality, "storage", f"{type(exc).__name__}: {exc}")
            return 0
        self.metrics.decoded(modality, time.perf_counter() - started, read)
        if modality == "meta":
            slot.decoded.setdefault("meta", {})[location.name] = value
        else:
            slot.decoded[modality] = value
        return tensor_bytes(value)

    def close(self) -> None:
        """Shut the worker processes down and wait for them (idempotent)."""
        for executor in self._executors.values():
            executor.shutdown(wait=True, cancel_futures=True)
        self._executors.clear()


class Pipeline:
    """Scheduler thread + decode pools + the ordered queue of pending micro-batches."""

    def __init__(self, index: SampleIndex, plan: Plan, config: FeedConfig, reader: FieldReader, *,
                 world_size: int, rank: int, grad_accum: int, state: Mapping[str, Any], skip: int) -> None:
        self.index, self.plan, self.config, self.reader = index, plan, config, reader
        self.rank = rank
        self.cursor = PlanCursor(plan, world_size=world_size, grad_accum=grad_accum)
        self.cursor.load_state_dict(state)
        self._skip = skip
        self._cond = threading.Condition()
        self._pending: deque[PendingBatch] = deque()
        self._max_pending = config.prefetch_steps * grad_accum
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self.pools = DecodePools(config, self._fail)
        self._scheduler = threading.Thread(target=self._schedule, name="omnifeed-scheduler", daemon=True)
        self._scheduler.start()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = self._error or exc
            self._cond.notify_all()

    def _schedule(self) -> None:
        try:
            while not self._stopping.is_set():
                with self._cond:
                    while len(self._pending) >= self._max_pending and not self._stopping.is_set():
                        self._cond.wait(0.1)
                if self._stopping.is_set():
                    return
                before = self.cursor.state_dict()
                step = self.cursor.next_step()
                after = self.cursor.state_dict()
                for accum, micro_batch in enumerate(step.for_rank(self.rank)):
                    if self._skip:
                        self._skip -= 1
                        continue
                    if not self._enqueue(PendingBatch(step, accum, micro_batch, before, after, [])):
                        return
        except BaseException as exc:  # noqa: BLE001  handed to the consumer, who re-raises it
            self._fail(exc)

    def _enqueue(self, pending: PendingBatch) -> bool:
        tasks = []
        for sample in self.index.samples(pending.micro_batch.positions):
            slot = Slot(sample.position, sample)
            pending.slots.append(slot)
            for modality, location in fields_to_decode(slot.sample):
                pending.counts[modality] = pending.counts.get(modality, 0) + 1
                tasks.append((modality, self._task(pending, slot, modality, location)))
        pending.remaining = len(tasks)
        if not self.pools.admit(pending.counts, self._stopping):
            return False
        with self._cond:
            self._pending.append(pending)
            self._cond.notify_all()
        for modality, task in tasks:
            self.pools.submit(modality, task)
        return True

    def _task(self, pending: PendingBatch, slot: Slot, modality: str, location: FieldLocation) -> Callable[[], int]:
        def run() -> int:
            nbytes = 0
            try:
                nbytes = self.reader.fill(slot, modality, location)
            finally:
                with self._cond:
                    pending.nbytes[modality] = pending.nbytes.get(modality, 0) + nbytes
                    pending.remaining -= 1
                    if pending.remaining == 0:
                        self._cond.notify_all()
            return nbytes
        return run

    def next_ready(self) -> PendingBatch:
        """The next micro-batch in plan order once all its fields are done (blocks)."""
        with self._cond:
            while self._error is None and not (self._pending and self._pending[0].remaining == 0):
                self._cond.wait(0.1)
            if self._error is not None:
                raise FeedError(f"the feed stopped: {type(self._error).__name__}: {self._error}") from self._error
            pending = self._pending.popleft()
            self._cond.notify_all()
        return pending

    def release(self, pending: PendingBatch) -> None:
        """Give the batch's buffer space back to the pools."""
        for modality, count in pending.counts.items():
            self.pools.release(modality, count, pending.nbytes.get(modality, 0))

    def close(self) -> None:
        """Stop the scheduler and the pools and join their threads (idempotent)."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        self.pools.close()
        if self._scheduler is not threading.current_thread():
            self._scheduler.join()
