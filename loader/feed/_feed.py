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

from .._modalities import MODALITIES
from ..decode import follow_index_tokenizer, make_decoder
from ..index import SampleIndex
from ..plan import Plan, PlanCursor, delivery_record, open_audit_log, steps_left_in_epoch
from ._collate import Decoded, collate
from ._config import FeedConfig
from ._dealing import DealtSteps
from ._healing import ErrorBudget, FeedError, SampleFailure, fallback_positions, replacement_slot
from ._metrics import FeedMetrics
from ._pipeline import FieldReader, Handover, PendingBatch, Pipeline, Slot, fields_to_decode
from ._pools import DecodePools

FEED_STATE_FORMAT = "omnifeed.feed-state/1"


def feed_state(plan: Plan, state: Mapping[str, Any] | None, *, world_size: int, grad_accum: int) -> dict[str, Any]:
    """``state`` checked against ``plan`` and moved to this topology (a resize); the plan's start for None.

    Raises ``StateMismatchError`` for another index or batching config, ``ValueError`` for a
    malformed state, ``FeedError`` for a state in the middle of a step at another topology.
    """
    cursor = PlanCursor(plan, world_size=world_size, grad_accum=grad_accum)
    if state is None:
        return {"format": FEED_STATE_FORMAT, "plan": cursor.state_dict(), "accum_done": 0}
    if (
        not isinstance(state, Mapping)
        or set(state) != {"format", "plan", "accum_done"}
        or state["format"] != FEED_STATE_FORMAT
    ):
        raise ValueError(f"not a feed state (expected keys format, plan, accum_done with format {FEED_STATE_FORMAT!r})")
    accum_done = state["accum_done"]
    if not isinstance(accum_done, int) or isinstance(accum_done, bool) or not 0 <= accum_done < grad_accum:
        raise ValueError(f"feed state accum_done {accum_done!r} outside 0..{grad_accum - 1}")
    if not isinstance(state["plan"], Mapping):
        raise ValueError("feed state 'plan' must be a plan cursor state")
    cursor.load_state_dict(state["plan"])
    if accum_done and cursor.topology_version != state["plan"]["topology_version"]:
        raise FeedError("the state is in the middle of a step; resume it at the world size it was saved with")
    return {"format": FEED_STATE_FORMAT, "plan": cursor.state_dict(), "accum_done": accum_done}


@dataclass(frozen=True)
class SharedResources:
    """What the feeds of one owner share (the service's streams): its plan, field reader (cache tiers, I/O threads),
    metrics, decode pools, where a micro-batch a retired feed already decoded is taken from (``handover``), and the
    steps of the plan dealt once for all of them (``dealt``)."""

    plan: Plan
    reader: FieldReader
    metrics: FeedMetrics
    pools: DecodePools | None = None
    handover: Handover | None = None
    dealt: DealtSteps | None = None


@dataclass
class Taken:
    """One micro-batch taken from the feed, before collation: decoded samples, keys, info, delivery record."""

    samples: list[Decoded]
    keys: list[str]
    info: dict[str, Any]
    record: dict[str, Any]


def with_index_tokenizer(config: FeedConfig, index: SampleIndex, users_text_decoder: bool = False) -> FeedConfig:
    """``config`` with ``decode.text.tokenizer`` the index's when unset; ValueError when a set one differs from it."""
    decode = follow_index_tokenizer(config.decode, index.manifest, users_text_decoder)
    return config if decode is config.decode else config.model_copy(update={"decode": decode})


class Feed:
    """Ready batches for one data-parallel rank: an iterable with state, resize and close.

    ``decoders`` replaces the decoder of a modality (``(bytes, key) -> value``; raise
    ``DecodeError`` for bad input). ``audit_log`` appends one delivery record per batch
    (the shape `omnifeed verify` reads). ``shared``: use another owner's plan, field reader,
    metrics, decode pools and hand-over (the service's streams, `SharedResources`); the feed
    never closes them, and ``decoders`` then belong to that reader's owner (ValueError).
    """

    def __init__(
        self,
        index: SampleIndex | str | Path,
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
        self.index = index if isinstance(index, SampleIndex) else SampleIndex(index)
        self.config = with_index_tokenizer(config or FeedConfig(), self.index, "text" in (decoders or {}))
        self.plan = shared.plan if shared is not None else Plan.from_index(self.index, self.config.plan)
        self._check_rank(world_size, rank)
        self._audit: IO[str] | None = open_audit_log(audit_log) if audit_log else None
        self.world_size, self.rank, self.grad_accum = world_size, rank, grad_accum
        self._position = PlanCursor(self.plan, world_size=world_size, grad_accum=grad_accum).state_dict()
        self._accum_done = 0
        self._budget = ErrorBudget(self.config.error_budget, self.config.error_budget_min_samples)
        self._pipeline: Pipeline | None = None
        if shared is None:
            self._metrics = FeedMetrics()
            chosen = {m: make_decoder(m, self.config.decode) for m in MODALITIES}
            self._reader = FieldReader(
                self.config,
                {**chosen, **(decoders or {})},
                self._metrics,
                self.index.fingerprint,
                frozenset(decoders or ()),
            )
            self._shared_pools: DecodePools | None = None
            self._handover: Handover | None = None
            self._dealt: DealtSteps | None = None
        else:
            self._metrics, self._reader = shared.metrics, shared.reader
            self._shared_pools, self._handover, self._dealt = shared.pools, shared.handover, shared.dealt
        self._owns_reader = shared is None
        self._finalizer = weakref.finalize(
            self, _close_resources, [None], self._reader if self._owns_reader else None, self._audit
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
        return steps_left_in_epoch(self.plan, self._position) * self.grad_accum - self._accum_done

    @property
    def epoch(self) -> int:
        """Epoch of the next micro-batch this feed will deliver."""
        return int(self._position["epoch"])

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
        self._position, self._accum_done = (
            (pending.state_after, 0) if done == self.grad_accum else (pending.state_before, done)
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
                state=self._position,
                skip=self._accum_done,
                pools=self._shared_pools,
                handover=self._handover,
                dealt=self._dealt,
            )
            self._finalizer.detach()
            reader = self._reader if self._owns_reader else None
            self._finalizer = weakref.finalize(self, _close_resources, [self._pipeline], reader, self._audit)
        return self._pipeline

    def _assemble(self, pending: PendingBatch) -> Taken:
        healthy = [slot.failure is None for slot in pending.slots]
        failures: list[SampleFailure] = []
        chosen: list[Slot] = []
        replaced: list[list[Any]] = []
        for i, slot in enumerate(pending.slots):
            if slot.failure is None:
                chosen.append(slot)
                continue
            failures.append(slot.failure)
            j = replacement_slot(i, healthy)
            chosen.append(pending.slots[j] if j is not None else self._stand_in(slot))
            replaced.append([i, slot.sample.key, slot.failure.reason])
            self._metrics.bad(slot.failure.modality, slot.failure.reason)
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
        for position in fallback_positions(failed.position, self.index.num_samples):
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

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The feed's whole data state: the plan cursor at the step in progress and its progress."""
        return {"format": FEED_STATE_FORMAT, "plan": dict(self._position), "accum_done": self._accum_done}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (strict); another world size than the state's is a resize."""
        checked = feed_state(self.plan, state, world_size=self.world_size, grad_accum=self.grad_accum)
        self._stop_pipeline()
        self._position, self._accum_done = checked["plan"], checked["accum_done"]

    def resize(self, world_size: int, rank: int, grad_accum: int | None = None) -> None:
        """Deal the following steps to ``world_size`` ranks, this one being ``rank`` (at a step boundary)."""
        self._check_rank(world_size, rank)
        if self._accum_done:
            raise FeedError(
                f"resize at a step boundary: {self._accum_done} of {self.grad_accum} micro-batches "
                f"of step {self._position['step']} are delivered; finish the step first"
            )
        cursor = PlanCursor(self.plan, world_size=world_size, grad_accum=grad_accum or self.grad_accum)
        cursor.load_state_dict(self._position)
        self._stop_pipeline()
        self.world_size, self.rank, self.grad_accum = world_size, rank, grad_accum or self.grad_accum
        self._position = cursor.state_dict()

    # -- lifecycle and metrics -------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Per-modality buffers and decode latency, throughput, bytes read, bad samples, consumer wait."""
        buffers = self._pipeline.pools.buffers() if self._pipeline is not None else {}
        return {
            **self._metrics.snapshot(buffers),
            "cache": self._reader.source.stats(),
            "storage_degraded": self._reader.source.degraded,
            "read_ahead": self._reader.read_ahead(),
        }

    def _stop_pipeline(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def close(self) -> None:
        """Stop every thread and release every resource (idempotent)."""
        self._closed = True
        self._stop_pipeline()
        if self._owns_reader:
            self._reader.close()
        self._finalizer.detach()
        if self._audit is not None:
            self._audit.close()
            self._audit = None

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_resources(pipelines: list[Pipeline | None], reader: FieldReader | None, audit: IO[str] | None) -> None:
    """Safety net for a feed that is garbage-collected without ``close()``."""
    for pipeline in pipelines:
        if pipeline is not None:
            pipeline.close()
    if reader is not None:
        reader.close()
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
        if self._feed._accum_done == 0 and self._feed.epoch > self._epoch:
            raise StopIteration
        return self._feed.next_batch()
