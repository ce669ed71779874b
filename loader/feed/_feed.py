"""`Feed`: this rank's share of the plan as ready batches, decoded per modality, resumable exactly.

Iterating a feed yields this rank's micro-batches in plan order, ``grad_accum`` per step,
until the epoch in progress is delivered (a new ``iter()`` continues with the next epoch).
State keys (``state_dict``): ``format``; ``plan`` — the plan cursor's state at the start of
the step in progress; ``accum_done`` — micro-batches of that step already delivered. Resuming
from it delivers byte-identical batches to those an uninterrupted run would have.
"""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..index import MixtureIndex, SampleIndex
from ..plan import Plan, delivery_record, open_audit_log
from ._collate import Decoded, collate
from ._config import FeedConfig
from ._engine import DecodeEngine, SharedResources, open_feed_index, with_index_tokenizer
from ._healing import ErrorBudget, FeedError, SampleFailure, fallback_positions, replacement_slot
from ._pipeline import PendingBatch, Pipeline, Slot, fields_to_decode
from ._position import FeedPosition


@dataclass
class Taken:
    """One micro-batch taken from the feed, before collation: decoded samples, keys, info, delivery record."""

    samples: list[Decoded]
    keys: list[str]
    info: dict[str, Any]
    record: dict[str, Any]


class Feed:
    """Ready batches for one data-parallel rank: an iterable with state, resize and close.

    ``decoders`` replaces the decoder of a modality (``(bytes, key) -> value``; raise
    ``DecodeError`` for bad input). ``audit_log`` appends one delivery record per batch
    (the shape `omnifeed verify` reads). ``shared``: use another owner's plan, engine (field
    reader, metrics, decode pools) and hand-over (the service's streams, `SharedResources`); the
    feed never closes them, and ``decoders`` then belong to that engine's owner (ValueError).
    Without it the feed builds its own `DecodeEngine` (its pipeline makes the decode pools).
    """

    def __init__(
        self,
        index: SampleIndex | MixtureIndex | str | Path | None,
        config: FeedConfig | None = None,
        *,
        world_size: int = 1,
        rank: int = 0,
        grad_accum: int = 1,
        audit_log: str | Path | None = None,
        decoders: Mapping[str, Callable[..., Any]] | None = None,
        shared: SharedResources | None = None,
    ) -> None:
        if shared is not None and decoders:
            raise ValueError("decoders belong to the shared field reader: give them to its owner")
        self.index = open_feed_index(index, config)
        self.config = with_index_tokenizer(config or FeedConfig(), self.index, "text" in (decoders or {}))
        self.plan = shared.plan if shared is not None else Plan.from_index(self.index, self.config.plan)
        self._check_rank(world_size, rank)
        self._audit: IO[str] | None = open_audit_log(audit_log) if audit_log else None
        self.world_size, self.rank, self.grad_accum = world_size, rank, grad_accum
        self._position = FeedPosition.start(self.plan, world_size=world_size, grad_accum=grad_accum)
        self._budget = ErrorBudget(self.config.error_budget, self.config.error_budget_min_samples)
        self._pipeline: Pipeline | None = None
        self._owns_engine = shared is None
        if shared is None:  # pools=None: each pipeline makes its own
            shared = DecodeEngine.build(self.index, self.config, decoders=decoders, with_pools=False).shared(self.plan)
        self._engine = shared.engine
        self._metrics, self._reader = shared.engine.metrics, shared.engine.reader
        self._shared_pools, self._handover, self._dealt = shared.engine.pools, shared.handover, shared.dealt
        self._finalizer = weakref.finalize(
            self, _close_resources, [None], self._engine if self._owns_engine else None, self._audit
        )
        self._closed = False

    @staticmethod
    def _check_rank(world_size: int, rank: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return _EpochIterator(self)

    def __len__(self) -> int:
        """Micro-batches this rank receives in the epoch in progress from here (what ``iter(feed)`` yields).

        At an epoch's start, the whole epoch's share. Plans the rest of the epoch (no data read).
        """
        return self._position.micro_batches_left(self.plan)

    @property
    def epoch(self) -> int:
        """Epoch of the next micro-batch this feed will deliver."""
        return self._position.epoch

    @property
    def position(self) -> FeedPosition:
        """Where this feed is: the plan cursor at the step in progress and the micro-batches of it delivered."""
        return self._position

    def next_batch(self) -> dict[str, Any]:
        """The next batch of this rank (crossing epochs freely), its arrays as torch tensors.

        The engine collates in numpy; torch is imported here, on the first batch a trainer
        takes, and each array becomes a tensor sharing its memory (``torch.from_numpy``).
        """
        from ._torch_batch import to_torch

        taken = self.take()
        batch: dict[str, Any] = to_torch(collate(taken.samples, taken.keys, taken.info))
        return batch

    def take(self) -> Taken:
        """The next micro-batch of this rank before collation (decoded samples, keys, info, delivery record); the
        position moves past it. `next_batch` is this collated into tensors; the service collates it into shared
        memory instead. Raises ``FeedError`` when the feed is closed or its error budget is spent."""
        if self._closed:
            raise FeedError("the feed is closed")
        pipeline = self._running()
        started = time.perf_counter()
        pending = pipeline.next_ready()
        waited = time.perf_counter() - started
        try:
            taken = self._assemble(pending)
        finally:
            pipeline.release(pending)
        done = pending.accum + 1
        self._position = (
            FeedPosition(pending.state_after, checked=True)
            if done == self.grad_accum
            else FeedPosition(pending.state_before, done, checked=True)
        )
        self._metrics.delivered(len(pending.slots), waited)
        return taken

    def _running(self) -> Pipeline:
        if self._pipeline is None:
            self._pipeline = Pipeline(
                self.index,
                self.plan,
                self.config,
                self._reader,
                world_size=self.world_size,
                rank=self.rank,
                grad_accum=self.grad_accum,
                state=self._position.plan_state,
                skip=self._position.accum_done,
                pools=self._shared_pools,
                handover=self._handover,
                dealt=self._dealt,
            )
            self._finalizer.detach()
            engine = self._engine if self._owns_engine else None
            self._finalizer = weakref.finalize(self, _close_resources, [self._pipeline], engine, self._audit)
        return self._pipeline

    def _assemble(self, pending: PendingBatch) -> Taken:
        healthy = [slot.failure is None for slot in pending.slots]
        sources = self._sources_of([slot.position for slot in pending.slots])
        failures: list[SampleFailure] = []
        chosen: list[Slot] = []
        replaced: list[list[Any]] = []
        for i, slot in enumerate(pending.slots):
            if slot.failure is None:
                chosen.append(slot)
                continue
            failures.append(slot.failure)
            j = replacement_slot(i, healthy, sources)
            chosen.append(pending.slots[j] if j is not None else self._stand_in(slot))
            replaced.append([i, slot.sample.key, slot.failure.reason])
            self._metrics.bad(slot.failure.modality, slot.failure.reason)
        if sources is not None:  # a replacement is of its slot's source: the planned sources are the delivered ones
            self._metrics.from_sources(
                np.asarray(sources),
                [slot.sample.lengths.text_tokens for slot in chosen],
                np.asarray([sources[i] for i, _, _ in replaced], dtype=np.int64),
            )
        self._budget.record(len(pending.slots), failures)
        info = {
            "epoch": pending.micro_batch.epoch,
            "step": pending.step.step,
            "micro_batch": pending.micro_batch.index,
            "rank": self.rank,
            "accum": pending.accum,
            "topology_version": pending.step.topology_version,
            "replaced": replaced,
        }
        if pending.micro_batch.pack is not None:  # packing: each key's token range in the pack
            info["segments"] = [[seg.start, seg.stop] for seg in pending.micro_batch.pack.segments]
        planned = [slot.sample.key for slot in pending.slots]
        record = {
            **delivery_record(pending.step, self.rank, pending.accum, pending.micro_batch, planned),
            "replaced": replaced,
        }
        if self._audit is not None:
            self._audit.write(json.dumps(record) + "\n")
            self._audit.flush()
        return Taken([slot.decoded for slot in chosen], [slot.sample.key for slot in chosen], info, record)

    def _stand_in(self, failed: Slot) -> Slot:
        """A decoded sample with the same modalities to replace one whose whole micro-batch failed."""
        wanted = {m for m, _ in fields_to_decode(failed.sample) if m != "meta"}
        start, size = 0, self.index.num_samples
        if isinstance(self.index, MixtureIndex):  # a stand-in of the failed sample's own source
            source = int(self.index.locate([failed.position])[0][0])
            start, size = int(self.index.offsets[source]), int(self.index.sizes[source])
        for position in fallback_positions(failed.position, size, start):
            slot = Slot(position, self.index.sample(position), epoch=failed.epoch)
            fields = fields_to_decode(slot.sample)
            if {m for m, _ in fields if m != "meta"} != wanted:
                continue
            for modality, location in fields:
                self._reader.fill(slot, modality, location)
            if slot.failure is None:
                return slot
        raise FeedError(
            f"sample {failed.sample.key!r} failed ({failed.failure}) and no stand-in with the same "
            f"modalities could be decoded; {SampleFailure.advice_for(failed.failure)}"
        )

    def _sources_of(self, positions: list[int]) -> list[int] | None:
        """Each position's source in a mixture (None for one index: every sample is of the same)."""
        if not isinstance(self.index, MixtureIndex):
            return None
        return self.index.locate(positions)[0].tolist()

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The feed's whole data state: the plan cursor at the step in progress and its progress."""
        return self._position.to_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Continue from ``state`` (strict); another world size than the state's is a resize. A state of other
        mixture weights or phases is refused unless ``allow_mixture_change`` (`change_mixture`: each source goes on
        from its position under this feed's weights after the window in progress)."""
        position = FeedPosition.from_dict(state)
        if allow_mixture_change and self.plan.mixture is not None:
            position = position.with_mixture_changed(self.plan)
        self.seek(position)

    def seek(self, position: FeedPosition) -> None:
        """Continue from ``position``: checked against this feed's plan unless it is a checked one (``checked``) of
        this plan at this feed's topology; another topology is a resize (as `load_state_dict`)."""
        here = (position.world_size, position.grad_accum) == (self.world_size, self.grad_accum)
        if not (position.checked and here and position.of(self.plan)):
            position = position.moved_to(self.plan, world_size=self.world_size, grad_accum=self.grad_accum)
        self._stop_pipeline()
        self._position = position

    def resize(self, world_size: int, rank: int, grad_accum: int | None = None) -> None:
        """Deal the following steps to ``world_size`` ranks, this one being ``rank`` (at a step boundary)."""
        self._check_rank(world_size, rank)
        if self._position.accum_done:
            raise FeedError(
                f"resize at a step boundary: {self._position.accum_done} of {self.grad_accum} micro-batches "
                f"of step {self._position.step} are delivered; finish the step first"
            )
        position = self._position.moved_to(self.plan, world_size=world_size, grad_accum=grad_accum or self.grad_accum)
        self._stop_pipeline()
        self.world_size, self.rank, self.grad_accum = world_size, rank, grad_accum or self.grad_accum
        self._position = position

    # -- lifecycle and metrics -------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Per-modality buffers and decode latency, throughput, bytes read, bad samples, consumer wait; in a
        mixture, per source (``sources``) the samples delivered, their text tokens and the samples replaced."""
        return self._engine.snapshot(self._pipeline.pools.buffers() if self._pipeline is not None else {})

    def _stop_pipeline(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def close(self) -> None:
        """Stop every thread and release every resource (idempotent)."""
        self._closed = True
        self._stop_pipeline()
        if self._owns_engine:
            self._engine.close()
        self._finalizer.detach()
        if self._audit is not None:
            self._audit.close()
            self._audit = None

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_resources(pipelines: list[Pipeline | None], engine: DecodeEngine | None, audit: IO[str] | None) -> None:
    """Safety net for a feed that is garbage-collected without ``close()``."""
    for pipeline in pipelines:
        if pipeline is not None:
            pipeline.close()
    if engine is not None:
        engine.close()
    if audit is not None and not audit.closed:
        audit.close()


class _EpochIterator:
    """Batches of a feed until the epoch in progress when it was created is delivered."""

    def __init__(self, feed: Feed) -> None:
        self._feed = feed
        self._epoch = feed.epoch

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._feed.position.accum_done == 0 and self._feed.epoch > self._epoch:
            raise StopIteration
        return self._feed.next_batch()
