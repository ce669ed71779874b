"""A stream of the feed service: one data-parallel rank's batches, produced ahead into shared memory.

A `Stream` is a `Feed` for one (data-parallel size, rank, accumulation) plus a producer thread
that collates each batch straight into one of the stream's segments. Clients attached to it
(tensor/context-parallel peers) each have a cursor; a client is served the batch that starts at
its cursor. A batch is dropped when every client of the group is past it; its segment is reused
once no client holds its tensors. See `_service` for the service around streams.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..plan._audit import delivery_record
from ..feed._collate import collate, uncollate
from ..plan._cursor import PlanCursor
from .._errors import OmnifeedError
from ..feed._feed import Feed
from ._arena import Segment, SegmentWriter, array_decoder, encode_batch, grown_size
from ._protocol import decode, encode

if TYPE_CHECKING:
    from ._server import FeedService

log = logging.getLogger("omnifeed.service")

class RequestError(OmnifeedError):
    """A request the service refuses: sent back to the client as an error reply of kind ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _order(state: Mapping[str, Any]) -> tuple[int, int]:
    """Where a feed state is in its stream: (steps dealt, micro-batches of the step delivered)."""
    return int(state["plan"]["step"]), int(state["accum_done"])


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a["accum_done"] == b["accum_done"] and a["plan"] == b["plan"]


@dataclass(eq=False)
class Ready:
    """A collated batch in a segment: where it starts and ends in the stream, who took and still holds it."""

    seq: int
    before: dict[str, Any]
    after: dict[str, Any]
    segment: Segment
    frame: bytes
    record: dict[str, Any]
    takers: set[int] = field(default_factory=set)
    holders: set[str] = field(default_factory=set)  # tokens of the clients whose trainer still holds its tensors
    abandoned: bool = False  # a client left holding it: its segment is never reused (the client may still read it)
    audited: bool = False


@dataclass(eq=False)
class _Attached:
    """A client of a stream: its cursor, its attempt, its waiting."""

    client: int
    token: str
    rank: int
    position: dict[str, Any]
    since: str | None = None  # the attempt its deliveries belong to (they are tagged with it)
    group: int = 1  # the peer group it says it belongs to (world size / data-parallel size)
    batches: int = 0
    waited_s: float = 0.0
    last_wait_s: float = 0.0


class Stream:
    """One data-parallel rank's batches: a feed, a producer thread, ready batches in shared memory."""

    def __init__(self, service: FeedService, key: tuple[int, int, int], group: int, start: dict[str, Any]) -> None:
        self.service, self.key, self.group = service, key, group
        dp_world, dp_rank, accum = key
        self.feed = Feed._sharing(service.index, service.plan, service.config.feed, service.reader,
                                  service.feed_metrics, service.pools, service.take_handover,
                                  world_size=dp_world, rank=dp_rank, grad_accum=accum)
        self.resize_started: float | None = None  # set when this stream serves a new topology
        self.feed.load_state_dict(start)
        self.cond = threading.Condition()
        self.ready: list[Ready] = []
        self.clients: dict[int, _Attached] = {}
        self.head = self.feed.state_dict()  # where the producer continues
        self.restart_to: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.closed = False
        self.idle_since: float | None = time.monotonic()
        self._slots: list[Segment | None] = []  # None: a slot given up when the peer group shrank
        self._free: list[Segment] = []
        self._next_generation: dict[int, int] = {}  # of slots given up: a new segment there is never mistaken for the old
        self._segment_size = 0  # for new and reused segments: grown_size of the largest batch so far
        self.one_offs = 0  # batches sent in one-off segments because clients held every slot
        self._prefetch = service.config.prefetch_batches
        self._thread = threading.Thread(target=self._produce, name=f"omnifeed-stream-{dp_rank}", daemon=True)
        self._thread.start()

    # -- producer --------------------------------------------------------------------------
    def _waiting(self) -> int:
        return sum(1 for b in self.ready if not self._done_with(b))

    def _room(self) -> bool:
        untaken = sum(1 for b in self.ready if not b.takers)
        return untaken < self._prefetch and self._waiting() < self._prefetch + 2 * self.group

    def _slot_limit(self) -> int:
        return self._prefetch + 2 * self.group + 2

    def _regroup(self) -> None:
        """The peer group is the largest any attached client declares: it shrinks when clients leave; then free
        segments beyond what the smaller group needs are closed (holding the lock)."""
        if self.clients:
            self.group = max(c.group for c in self.clients.values())
        self._trim()

    def _trim(self) -> None:
        limit = self._slot_limit()
        for segment in [s for s in self._free if s.slot >= limit]:
            self._free.remove(segment)
            if 0 <= segment.slot < len(self._slots) and self._slots[segment.slot] is segment:
                self._slots[segment.slot] = None
                self._next_generation[segment.slot] = segment.generation + 1
            segment.close()
        while self._slots and self._slots[-1] is None:
            self._slots.pop()

    def _produce(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.closed and self.restart_to is None and not self._room():
                        self.cond.wait(0.5)
                    if self.closed:
                        return
                    if self.restart_to is not None:
                        self._restart(self.restart_to)
                        continue
                    before = self.head
                taken = self.feed._take()
                after = self.feed.state_dict()
                with self.cond:
                    if self.closed:
                        return
                    if self.restart_to is not None:  # a client asked for an earlier position meanwhile
                        continue
                    segment = self._segment()
                self._publish(taken, before, after, segment)
        except BaseException as exc:  # noqa: BLE001  handed to the clients, who get an error reply
            with self.cond:
                if not self.closed:
                    log.error("stream %s stopped: %s: %s", self.key, type(exc).__name__, exc)
                    self.error = exc
                self.cond.notify_all()

    def _restart(self, state: dict[str, Any]) -> None:
        """Continue production at ``state`` (called by the producer, holding the lock)."""
        self.restart_to = None
        for ready in list(self.ready):
            self._drop(ready)
        self.feed.load_state_dict(state)
        self.head = self.feed.state_dict()

    def _segment(self) -> Segment:
        """A segment for the next batch, at least as large as the largest batch so far needed (holding the lock):
        sized per slot, every slot would overflow on its own and its batch be collated twice (one epoch of the
        mixed benchmark did that for most batches)."""
        if self._free:
            segment = self._free.pop()
            if segment.size >= self._segment_size:
                return segment
            grown = Segment(segment.slot, segment.generation + 1, self._segment_size)
            self._slots[segment.slot] = grown
            segment.close()
            return grown
        limit = self._slot_limit()
        slot = next((i for i, s in enumerate(self._slots[:limit]) if s is None), None)
        if slot is None and len(self._slots) < limit:
            slot = len(self._slots)
            self._slots.append(None)
        if slot is not None:
            segment = Segment(slot, self._next_generation.pop(slot, 0), self._segment_size)
            self._slots[slot] = segment
            return segment
        self.one_offs += 1
        return Segment(-1, 0, self._segment_size)  # clients hold every slot: a one-off

    def _publish(self, taken: Any, before: dict[str, Any], after: dict[str, Any], segment: Segment) -> None:
        writer = SegmentWriter(segment)
        batch = collate(taken.samples, taken.keys, taken.info, writer.alloc)
        if writer.overflowed:
            del batch
            with self.cond:
                self._segment_size = max(self._segment_size, grown_size(writer.needed))
                grown = Segment(segment.slot, segment.generation + 1, self._segment_size)
                if segment.slot >= 0:
                    self._slots[segment.slot] = grown
            segment.close()
            segment, writer = grown, SegmentWriter(grown)
            batch = collate(taken.samples, taken.keys, taken.info, writer.alloc)
        seq = self.service.next_seq()
        message = {"op": "batch", "seq": seq, "segment": segment.name, "batch": encode_batch(batch, segment),
                   "state": after}
        frame = encode(message)
        del batch, message
        with self.cond:
            self.ready.append(Ready(seq, before, after, segment, frame, taken.record))
            self.head = after
            self.cond.notify_all()

    # -- clients ---------------------------------------------------------------------------
    def servable(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` is ahead of or at a batch this stream still has (holding the lock)."""
        if self.restart_to is not None:
            return _order(state) >= _order(self.restart_to)
        earliest = min((_order(b.before) for b in self.ready), default=_order(self.head))
        if _order(state) < earliest:
            return False
        if any(_same(b.before, state) for b in self.ready) or _same(self.head, state):
            return True
        return _order(state) > _order(self.head)

    def attach(self, client: int, token: str, rank: int, state: dict[str, Any], since: str | None,
               group: int = 1) -> None:
        """Serve ``client`` (of a peer group of ``group``) from ``state``; restart production there when this stream is
        past it (holding the lock)."""
        if not self.servable(state):
            later = [c for c in self.clients.values() if _order(c.position) < _order(state)]
            if later:
                raise RequestError("position", "another client of this data-parallel rank is at an earlier "
                                   "position that does not lead to yours; tensor-parallel peers must resume from "
                                   "the same checkpoint")
            self.restart_to = state
        self.clients[client] = _Attached(client, token, rank, state, since, group=group)
        self._regroup()
        self.idle_since = None
        self.cond.notify_all()

    def detach(self, client: int) -> None:
        """The client left.

        Segments of batches it still held are never reused: the service closes its side and
        the pages go when the client's last tensor of them does (or with the client, if it died).
        """
        with self.cond:
            attached = self.clients.pop(client, None)
            if attached is None:
                return
            self._regroup()  # a peer that declared a larger group than the others have left: batches need not wait for it
            for ready in self.ready:
                if attached.token in ready.holders:
                    ready.holders.discard(attached.token)
                    ready.abandoned = True
            self._collect()
            if not self.clients:
                self.idle_since = time.monotonic()
            self.cond.notify_all()

    def release(self, token: str, seqs: set[int]) -> None:
        """The client dropped these batches' tensors: their segments may be reused."""
        with self.cond:
            for ready in self.ready:
                if ready.seq in seqs:
                    ready.holders.discard(token)
            self._collect()
            self.cond.notify_all()

    def take(self, client: int, stopping: threading.Event) -> Ready:
        """The batch that starts at the client's cursor (blocks until produced)."""
        with self.cond:
            attached = self.clients[client]
            self._collect()
            started = time.perf_counter()
            while True:
                if self.error is not None:
                    raise RequestError("feed", f"the feed stopped: {type(self.error).__name__}: {self.error}")
                if self.closed or stopping.is_set():
                    raise RequestError("closing", "the service is shutting down")
                found = next((b for b in self.ready if _same(b.before, attached.position)), None)
                if found is not None:
                    break
                self.cond.wait(0.5)
            waited = time.perf_counter() - started
            if self.resize_started is not None:
                self.service.record_resize(self.resize_started)
                self.resize_started = None
            attached.waited_s += waited
            attached.last_wait_s = waited
            attached.batches += 1
            found.takers.add(client)
            found.holders.add(attached.token)
            attached.position = found.after
            self._audit(found, attached.since)  # logged before it is sent: a batch a trainer holds is always logged
            self._collect()
            self.cond.notify_all()
            return found

    def _audit(self, ready: Ready, since: str | None) -> None:
        if not ready.audited:
            ready.audited = True
            self.service.write_audit({**ready.record, "since": since})

    def _done_with(self, ready: Ready) -> bool:
        """No client of the group needs this batch any more (holders aside)."""
        past = all(_order(c.position) > _order(ready.before) for c in self.clients.values())
        return past and (len(self.clients) >= self.group or len(ready.takers) >= self.group)

    def _collect(self) -> None:
        for ready in list(self.ready):
            if not ready.holders and self._done_with(ready):
                self._drop(ready)

    def _drop(self, ready: Ready) -> None:
        """Forget a batch; its segment is free again once no client holds it."""
        self.ready.remove(ready)
        if ready.holders:
            self.service.lent(ready, self)
            return
        self.recycle(ready)

    def recycle(self, ready: Ready) -> None:
        """A batch no client holds any more: its segment is free again, or closed if a departed client may read it."""
        segment = ready.segment
        mine = 0 <= segment.slot < len(self._slots) and self._slots[segment.slot] is segment
        if mine and not ready.abandoned:
            self._free.append(segment)
            self._trim()
            return
        if mine:  # a departed client may read it: the slot gets a fresh segment (a new generation) when next needed
            self._slots[segment.slot] = None
            self._next_generation[segment.slot] = segment.generation + 1
            self._trim()
        segment.close()

    def harvest(self) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """Batches no client took yet, as (delivery record, decoded samples): views of their segments, which are never
        reused (holding the lock). The views keep the pages alive after the stream closes."""
        harvested = []
        for ready in self.ready:
            base = ready.segment.base
            if ready.takers or ready.record.get("replaced") or base is None:
                continue
            batch = decode(ready.frame[4:], array_decoder(lambda slot, generation: base))["batch"]
            harvested.append((ready.record, uncollate(batch, copy=False)))
            ready.abandoned = True
        return harvested

    def segments(self) -> tuple[int, int]:
        """Segments this stream keeps and their bytes."""
        with self.cond:
            kept = [s for s in self._slots if s is not None]
            return len(kept), sum(s.size for s in kept)

    def live(self) -> set[tuple[int, int]]:
        """(slot, generation) of the segments this stream keeps (holding the lock or not)."""
        with self.cond:
            return {(s.slot, s.generation) for s in self._slots if s is not None}

    def close(self) -> None:
        """Stop the producer, the feed and free every segment (idempotent)."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        self.feed.close()
        self._thread.join(timeout=30)
        with self.cond:
            for segment in self._slots:
                if segment is not None:
                    segment.close()
            self._slots.clear()
            self._free.clear()
            self.ready.clear()
