"""The running part of a feed: a scheduler thread that plans ahead, the decode pools, and the queue of
micro-batches waiting for the consumer in plan order.

Lifecycle::

    Pipeline(start state) ─▶ scheduler: cursor.next_step() → this rank's micro-batches
                                   │  admit (per-modality buffers; deeper while storage is degraded)
                                   ▼
              I/O threads: each field through the cache chain (RAM → NVMe → origin)
                                   │  when its bytes are in: a task to DecodePools (decode, then the transforms)
                                   ▼
              pending micro-batches (plan order) ─▶ next_ready() ─▶ the Feed assembles
    close(): stop the scheduler, close its pools owner (and the pools, if it made them), join (idempotent)

Several pipelines (one per rank a sidecar serves) can share one ``DecodePools`` and one
``FieldReader``: each takes its own owner handle with its own buffers; closing one pipeline
leaves the shared workers and the other pipelines running.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ...cache import is_local
from .._errors import SourceError
from .._modalities import MODALITIES
from ..decode import DecodeError, WorkerDied, make_decoder
from ..index import FieldLocation, IndexedSample, SampleIndex
from ..plan import DealingStopped, MicroBatch, Plan, PlanCursor, Step
from ._config import FeedConfig
from ._dealing import DealtSteps
from ._decoded_codec import tensor_bytes
from ._field_decoders import FieldDecoders
from ._field_source import FieldSource, Loaded
from ._healing import FeedError, SampleFailure
from ._metrics import FeedMetrics
from ._pools import DecodePools, PoolOwner, Task
from ._remote import remote_decoders
from ._remote_state import RemoteSlot
from ._transforms import Transforms

Handover = Callable[[MicroBatch], "list[dict[str, Any]] | None"]
"""Decoded samples of a micro-batch that another stream already holds (the service, after a resize), or None."""


@dataclass
class Slot:
    """One sample of a pending micro-batch: its index row, decoded fields, failure if any, and its epoch."""

    position: int
    sample: IndexedSample
    decoded: dict[str, Any] = field(default_factory=dict)
    failure: SampleFailure | None = None
    epoch: int = 0  # of its micro-batch: the transforms draw by (plan seed, epoch, key)


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
    due: float = 0.0  # planned cost of this pipeline's micro-batches before it: when its consumer needs it


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


class FieldReader:
    """Loads fields through the cache chain in I/O threads, decodes them (`FieldDecoders`) and runs the transforms.

    ``decoders``: the user's, by modality or field name (see `_field_decoders`); the built-in ones come
    from ``config.decode``. Built by `DecodeEngine`.
    """

    def __init__(
        self,
        config: FeedConfig,
        metrics: FeedMetrics,
        namespace: str,
        decoders: Mapping[str, Callable[..., Any]] | None = None,
    ) -> None:
        self.config, self.metrics = config, metrics
        users = dict(decoders or {})
        custom = frozenset(users)
        # the built-ins first, once, from the decode config: a config they refuse starts nothing
        chosen = {**{m: make_decoder(m, config.decode) for m in MODALITIES}, **users}
        self.transforms = Transforms(config.transforms, config.plan.seed)  # ValueError: a user step does not import
        self.source = FieldSource(config.cache, namespace, config.decode, custom)
        self.decoders = FieldDecoders(config, chosen, custom)
        self.remote = remote_decoders(config, self.source, self.decoders, metrics)  # Ray actors (pools.*.remote)
        self._io = ThreadPoolExecutor(config.cache.remote.io_threads, thread_name_prefix="omnifeed-io")

    def prefetch(self, sample: IndexedSample, location: FieldLocation) -> Future[Loaded] | None:
        """Start loading a field's bytes (or cached decoded value) in an I/O thread; None for a local file.

        A local file is read by the decode worker itself, as part of its task: reading it takes
        less than handing it between threads (with 16 I/O threads the feed lost 40 % of its
        local-disk throughput to thread hand-offs; benchmarks/RESULTS.md).
        """
        if is_local(sample.shard.url) or self.remote is not None and location.modality in self.remote.modalities:
            return None  # a remote modality's field is read by whichever side decodes it
        return self._io.submit(self.source.load, sample, location)

    def _value(
        self,
        slot: Slot,
        modality: str,
        location: FieldLocation,
        loading: Future[Loaded] | None,
        where: str,
        remote: RemoteSlot | None,
    ) -> tuple[Any, int]:
        """(the field's value after the transforms, the raw bytes read for it)."""
        sample = slot.sample
        done = self.remote.decode(sample, location, remote) if self.remote is not None and loading is None else None
        if done is not None:  # decoded by a Ray actor
            return self.transforms.apply(modality, location.name, sample.key, slot.epoch, done[0], where), done[1]
        kind, payload = loading.result() if loading is not None else self.source.load(sample, location)
        if kind == "decoded":
            value, read = payload, 0
            self.metrics.from_cache(modality)
        else:
            column = self.source.column_kind(sample, location) if modality == "meta" else None
            value, read = self.decoders.decode(modality, location, sample.key, payload, where, column), len(payload)
            self.source.remember(sample, location, value)  # before the transforms: a random crop is never cached
        return self.transforms.apply(modality, location.name, sample.key, slot.epoch, value, where), read

    def fill(
        self,
        slot: Slot,
        modality: str,
        location: FieldLocation,
        loading: Future[Loaded] | None = None,
        remote: RemoteSlot | None = None,
    ) -> int:
        """Decode and transform one field into ``slot`` (loading it now unless ``loading`` did; on ``remote``'s actor
        when given, else here); a failure is recorded on the slot. Returns the bytes the value holds.
        """
        if slot.failure is not None:  # another field of the sample failed: it will be replaced anyway
            return 0
        started = time.perf_counter()
        sample = slot.sample
        where = f"field {location.name!r} of {sample.shard.url}, member {location.member!r}"

        def failed(reason: str, message: str) -> int:
            slot.failure = SampleFailure(
                sample.key, sample.shard.url, modality, reason, message, location.name, location.member
            )
            return 0

        try:
            value, read = self._value(slot, modality, location, loading, where, remote)
        except CancelledError:  # the pipeline is closing
            return 0
        except DecodeError as exc:
            return failed(exc.reason, str(exc))
        except SourceError as exc:
            return failed("read", str(exc))
        except WorkerDied as exc:  # twice on this field: the decoder itself brings its process down
            return failed("worker", str(exc))
        except MemoryError:
            raise
        except Exception as exc:  # storage errors after the remote tier's retries, from any fsspec backend
            return failed("storage", f"{type(exc).__name__}: {exc}")
        self.metrics.decoded(modality, time.perf_counter() - started, read)
        if modality == "meta":
            slot.decoded.setdefault("meta", {})[location.name] = value
        else:
            slot.decoded[modality] = value
        return tensor_bytes(value)

    def read_ahead(self) -> int:
        """How many times the usual depth to read ahead now (more while origin storage is degraded)."""
        return self.config.cache.remote.degraded_read_ahead if self.source.degraded else 1

    def close(self) -> None:
        """Stop the I/O threads and the worker processes and wait for them (idempotent)."""
        self._io.shutdown(wait=True, cancel_futures=True)
        if self.remote is not None:
            self.remote.close()
        self.decoders.close()
        self.source.close()


class Pipeline:
    """Scheduler thread + decode pools + the ordered queue of pending micro-batches.

    ``pools``: decode workers shared with other pipelines (this pipeline takes an owner handle
    with the buffers of ``config`` and closes only that); None makes and closes its own.
    ``self.pools`` is this pipeline's ``PoolOwner`` either way. ``dealt``: steps dealt once for
    the pipelines sharing it (`DealtSteps`); None deals its own. Each decode task carries when
    its consumer needs it (``due``: the planned cost of the micro-batches before its own), so
    shared workers serve the pipeline that needs its next micro-batch soonest.
    """

    def __init__(
        self,
        index: SampleIndex,
        plan: Plan,
        config: FeedConfig,
        reader: FieldReader,
        *,
        world_size: int,
        rank: int,
        grad_accum: int,
        state: Mapping[str, Any],
        skip: int,
        pools: DecodePools | None = None,
        handover: Handover | None = None,
        dealt: DealtSteps | None = None,
    ) -> None:
        self.index, self.plan, self.config, self.reader = index, plan, config, reader
        self._handover = handover
        self.rank = rank
        start = PlanCursor(plan, world_size=world_size, grad_accum=grad_accum)
        start.load_state_dict(state)  # at another topology: a resize
        self._state = start.state_dict()  # where the next step starts
        self._dealt = dealt if dealt is not None else DealtSteps(plan, keep=1, cursors=1)
        self._planned = 0.0  # planned cost of the micro-batches enqueued so far
        self._skip = skip
        self._cond = threading.Condition()
        self._pending: deque[PendingBatch] = deque()
        self._max_pending = config.prefetch_steps * grad_accum
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._loading: set[Future[Loaded]] = set()
        self._own_pools: DecodePools | None = None
        if pools is None:
            pools = self._own_pools = DecodePools(config, remote=reader.remote)
        self.pools: PoolOwner = pools.owner(self._fail, config)
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
                    while not self._stopping.is_set():
                        depth = self.reader.read_ahead()
                        self.pools.read_ahead = depth
                        if len(self._pending) < self._max_pending * depth:
                            break
                        self._cond.wait(0.1)
                if self._stopping.is_set():
                    return
                before = self._state
                try:  # a step of a large world deals many micro-batches: close() must not wait for all of them
                    step, after = self._dealt.next_step(before, self._stopping.is_set)
                except DealingStopped:
                    return
                self._state = after
                mine = step.for_rank(self.rank)
                # what a pending batch keeps of its step: the step's numbers, not the W × A micro-batches it dealt
                step = step.numbers()
                for accum, micro_batch in enumerate(mine):
                    if self._skip:
                        self._skip -= 1
                        continue
                    if not self._enqueue(PendingBatch(step, accum, micro_batch, before, after, [])):
                        return
        except BaseException as exc:  # noqa: BLE001  handed to the consumer, who re-raises it
            self._fail(exc)

    def _enqueue(self, pending: PendingBatch) -> bool:
        pending.due, self._planned = self._planned, self._planned + pending.micro_batch.cost
        held = self._handover(pending.micro_batch) if self._handover is not None else None
        if held is not None:  # decoded already, by another rank's stream before a resize: no read, no decode
            for sample, decoded in zip(self.index.samples(pending.micro_batch.positions), held):
                pending.slots.append(Slot(sample.position, sample, decoded))
            with self._cond:
                self._pending.append(pending)
                self._cond.notify_all()
            return True
        fields: list[tuple[Slot, str, FieldLocation]] = []
        for sample in self.index.samples(pending.micro_batch.positions):
            slot = Slot(sample.position, sample, epoch=pending.micro_batch.epoch)
            pending.slots.append(slot)
            for modality, location in fields_to_decode(slot.sample):
                pending.counts[modality] = pending.counts.get(modality, 0) + 1
                fields.append((slot, modality, location))
        pending.remaining = len(fields)
        if not self.pools.admit(pending.counts, self._stopping):
            return False
        with self._cond:
            self._pending.append(pending)
            self._cond.notify_all()
        for slot, modality, location in fields:
            loading = self.reader.prefetch(slot.sample, location)
            if loading is None:
                self.pools.submit(modality, self._task(pending, slot, modality, location, None), pending.due)
                continue
            with self._cond:
                self._loading.add(loading)
            loading.add_done_callback(self._loaded(pending, slot, modality, location))
        return True

    def _loaded(
        self, pending: PendingBatch, slot: Slot, modality: str, location: FieldLocation
    ) -> Callable[[Future[Loaded]], None]:
        # The task is made here, not captured: a future keeps its done-callbacks, so a callback holding a
        # task that holds the future is a reference cycle, and the whole micro-batch (its slots' decoded
        # arrays, the read bytes) would wait for a full garbage collection: the service's memory climbed
        # by tens of MiB per epoch with an http:// origin (benchmarks/bench_service_memory.py).
        def hand_to_decoder(loading: Future[Loaded]) -> None:
            with self._cond:
                self._loading.discard(loading)
            self.pools.submit(modality, self._task(pending, slot, modality, location, loading), pending.due)

        return hand_to_decoder

    def _task(
        self, pending: PendingBatch, slot: Slot, modality: str, location: FieldLocation, loading: Future[Loaded] | None
    ) -> Task:
        def run(remote: RemoteSlot | None) -> int:
            nbytes = 0
            try:
                nbytes = self.reader.fill(slot, modality, location, loading, remote)
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
                if self._stopping.is_set():  # closed from another thread (the service closing a stream)
                    raise FeedError("the feed was closed")
                self._cond.wait(0.1)
            if self._error is not None:
                raise FeedError(f"the feed stopped: {type(self._error).__name__}: {self._error}") from self._error
            pending = self._pending.popleft()
            self._cond.notify_all()
        return pending

    def release(self, pending: PendingBatch) -> None:
        """Give the batch's buffer space back to the pools; its consumer has moved past its planned cost."""
        for modality, count in pending.counts.items():
            self.pools.release(modality, count, pending.nbytes.get(modality, 0))
        self.pools.consumed(pending.micro_batch.cost)

    def close(self) -> None:
        """Stop the scheduler and this pipeline's share of the pools and join their threads (idempotent).

        Its queued decode tasks are dropped and its running ones waited for; shared pools keep running.
        """
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
            loading = list(self._loading)
        for future in loading:  # reads not started yet are dropped; running ones finish into a closed owner
            future.cancel()
        self.pools.close()
        if self._own_pools is not None:
            self._own_pools.close()
        if self._scheduler is not threading.current_thread():
            self._scheduler.join()
