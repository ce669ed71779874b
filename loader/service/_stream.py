"""A stream of the feed service: one data-parallel rank's batches, produced ahead into shared memory.

A `Stream` is a producer of one (data-parallel size, rank, accumulation)'s batches — its `Feed` in
the service's process or in a process of its own (`_producer`) — plus a producer thread that has
each batch collated straight into one of the stream's segments. Clients attached to it
(tensor/context-parallel peers) each have a cursor; a client is served the batch that starts at
its cursor. A batch is dropped when every client of the group is past it; its segment is reused
once no client holds its tensors. What a stream needs from the service around it comes in a
`StreamContext` (never the service itself); `_streams` keeps the service's streams.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..feed import FeedPosition, uncollate
from ._arena import Segment, decode_arrays
from ._producer import Producer
from ._producer_process import Key
from ._protocol import RequestError
from ._slots import SegmentSlots

log = logging.getLogger("omnifeed.service")


@dataclass(frozen=True)
class StreamContext:
    """What a stream needs from the service: who makes its batches, and where it reports.

    ``producer(key, start)``: the stream's producer, at ``start``; ``next_seq``: a batch number unique in the
    service; ``record_resize(started)``: a stream of a new topology served its first batch (``started``: when the
    change began, ``time.perf_counter``); ``audit(record)``: log a delivery; ``lend(ready, stream)``: keep track
    of a dropped batch clients still hold (called holding the stream's lock: it must not call back into the stream).
    """

    producer: Callable[[Key, FeedPosition], Producer]
    prefetch_batches: int  # collated batches kept ready ahead of the clients
    next_seq: Callable[[], int]
    record_resize: Callable[[float], None]
    audit: Callable[[dict[str, Any]], None]
    lend: Callable[[Ready, Stream], None]


@dataclass(eq=False)
class Ready:
    """A collated batch in a segment: where it starts and ends in the stream, who took and still holds it."""

    seq: int
    before: FeedPosition
    after: FeedPosition
    segment: Segment
    frame: bytes
    record: dict[str, Any]
    takers: set[int] = field(default_factory=set)
    holders: set[str] = field(default_factory=set)  # tokens of the clients whose trainer still holds its tensors
    abandoned: bool = False  # a client left holding it: its segment is never reused (the client may still read it)
    logged: set[str | None] = field(default_factory=set)  # the attempts its delivery is logged under
    returned: set[int] = field(default_factory=set)  # clients that gave it back unused (received ahead, never yielded)


@dataclass(eq=False)
class _Attached:
    """A client of a stream: its cursor, its attempt, its waiting."""

    client: int
    token: str
    rank: int
    position: FeedPosition
    since: str | None = None  # the attempt its deliveries belong to (they are tagged with it)
    group: int = 1  # the peer group it says it belongs to (world size / data-parallel size)
    batches: int = 0
    waited_s: float = 0.0
    last_wait_s: float = 0.0


def returned_record(record: dict[str, Any], since: str | None) -> dict[str, Any]:
    """The audit record that takes back the delivery ``record`` logged under ``since``: no trainer had it."""
    fields = ("epoch", "step", "rank", "accum", "micro_batch", "topology_version")
    return {"returned": since, **{name: record[name] for name in fields if name in record}, "keys": []}


class Stream:
    """One data-parallel rank's batches: a producer, a producer thread, ready batches in shared memory.

    The stream locks itself: its public methods take its lock, callers never do. Holding it, the stream calls
    out only to its context's ``record_resize``, ``audit`` and ``lend``, which take their own locks and never
    call back into a stream (lock order: a stream's, then the ledger's, resizes' or attempt log's).
    """

    def __init__(self, context: StreamContext, key: Key, group: int, start: FeedPosition) -> None:
        self.context, self.key, self.group = context, key, group
        self.producer = context.producer(key, start)
        self.resize_started: float | None = None  # set when this stream serves a new topology
        self._cond = threading.Condition()
        self.ready: list[Ready] = []
        self.clients: dict[int, _Attached] = {}
        self.head = self.producer.position  # where the producer continues
        self.restart_to: FeedPosition | None = None
        self.error: BaseException | None = None
        self.closed = False
        self.idle_since: float | None = time.monotonic()
        self._segments = SegmentSlots()
        self._prefetch = context.prefetch_batches
        self._thread = threading.Thread(target=self._produce, name=f"omnifeed-stream-{key[1]}", daemon=True)
        self._thread.start()

    # -- producer --------------------------------------------------------------------------
    def _waiting(self) -> int:
        return sum(1 for b in self.ready if not self._done_with(b))

    def _peers(self) -> int:
        """The peers batches are kept ahead for: the group, but no more than the clients attached (a peer declaring a
        group of hundreds and never asking holds a few batches, not hundreds of segments; the others wait for it)."""
        return max(1, min(self.group, len(self.clients)))

    def _room(self) -> bool:
        untaken = sum(1 for b in self.ready if not b.takers)
        return untaken < self._prefetch and self._waiting() < self._prefetch + 2 * self._peers()

    def _slot_limit(self) -> int:
        return self._prefetch + 2 * self._peers() + 2

    @property
    def one_offs(self) -> int:
        """Batches sent in one-off segments because clients held every slot."""
        return self._segments.one_offs

    def _regroup(self) -> None:
        """The peer group is the largest any attached client declares: it shrinks when clients leave; then free
        segments beyond what the smaller group needs are closed (holding the lock)."""
        if self.clients:
            self.group = max(c.group for c in self.clients.values())
        self._segments.trim(self._slot_limit())

    def _produce(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self.closed and self.restart_to is None and not self._room():
                        self._cond.wait(0.5)
                    if self.closed:
                        return
                    if self.restart_to is not None:
                        self._restart(self.restart_to)
                        continue
                    before = self.head
                seq = self.context.next_seq()
                produced = self.producer.produce(seq, self._free_segment, self._grown)
                with self._cond:
                    if self.closed or self.restart_to is not None:  # or a client asked for an earlier position
                        self._segments.recycle(produced.segment, False, self._slot_limit())
                        if self.closed:
                            return
                        continue
                    self.ready.append(
                        Ready(seq, before, produced.after, produced.segment, produced.frame, produced.record)
                    )
                    self.head = produced.after
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001  handed to the clients, who get an error reply
            with self._cond:
                if not self.closed:
                    log.error("stream %s stopped: %s: %s", self.key, type(exc).__name__, exc)
                    self.error = exc
                self._cond.notify_all()

    def _restart(self, position: FeedPosition) -> None:
        """Continue production at ``position`` (called by the producer, holding the lock)."""
        self.restart_to = None
        for ready in list(self.ready):
            self._drop(ready)
        self.producer.seek(position)
        self.head = self.producer.position

    def _free_segment(self) -> Segment:
        with self._cond:
            return self._segments.take(self._slot_limit())

    def _grown(self, segment: Segment, needed: int) -> Segment:
        """The segment that replaces ``segment``, which a batch of ``needed`` bytes overflowed (closed here)."""
        with self._cond:
            grown = self._segments.grow(segment, needed)
        segment.close()
        return grown

    # -- clients ---------------------------------------------------------------------------
    def _servable(self, position: FeedPosition) -> bool:
        """Whether ``position`` is ahead of or at a batch this stream still has (holding the lock)."""
        if self.restart_to is not None:
            return position.key >= self.restart_to.key
        earliest = min((b.before.key for b in self.ready), default=self.head.key)
        if position.key < earliest:
            return False
        if any(b.before == position for b in self.ready) or self.head == position:
            return True
        return position.key > self.head.key

    def attach(
        self, client: int, token: str, rank: int, position: FeedPosition, since: str | None, group: int = 1
    ) -> None:
        """Serve ``client`` (of a peer group of ``group``) from ``position``; restart production there when this stream
        is past it."""
        with self._cond:
            if not self._servable(position):
                later = [c for c in self.clients.values() if c.position.key < position.key]
                if later:
                    raise RequestError(
                        "position",
                        "another client of this data-parallel rank is at an earlier "
                        "position that does not lead to yours; tensor-parallel peers must resume from "
                        "the same checkpoint",
                    )
                self.restart_to = position
            self.clients[client] = _Attached(client, token, rank, position, since, group=group)
            self._regroup()
            self.idle_since = None
            self._cond.notify_all()

    def detach(self, client: int) -> None:
        """The client left.

        Segments of batches it still held are never reused: the service closes its side and
        the pages go when the client's last tensor of them does (or with the client, if it died).
        """
        with self._cond:
            attached = self.clients.pop(client, None)
            if attached is None:
                return
            # a peer that declared a larger group than the others have left: batches need not wait for it
            self._regroup()
            for ready in self.ready:
                if attached.token in ready.holders:
                    ready.holders.discard(attached.token)
                    ready.abandoned = True
            self._collect()
            if not self.clients:
                self.idle_since = time.monotonic()
            self._cond.notify_all()

    def release(self, token: str, seqs: set[int]) -> None:
        """The client dropped these batches' tensors: their segments may be reused."""
        with self._cond:
            for ready in self.ready:
                if ready.seq in seqs:
                    ready.holders.discard(token)
            self._collect()
            self._cond.notify_all()

    def take(self, client: int, stopping: threading.Event) -> Ready:
        """The batch that starts at the client's cursor (blocks until produced)."""
        with self._cond:
            attached = self.clients[client]
            self._collect()
            started = time.perf_counter()
            while True:
                if self.error is not None:
                    raise RequestError("feed", f"the feed stopped: {type(self.error).__name__}: {self.error}")
                if self.closed or stopping.is_set():
                    raise RequestError("closing", "the service is shutting down")
                found = next((b for b in self.ready if b.before == attached.position), None)
                if found is not None:
                    break
                self._cond.wait(0.5)
            waited = time.perf_counter() - started
            if self.resize_started is not None:
                self.context.record_resize(self.resize_started)
                self.resize_started = None
            attached.waited_s += waited
            attached.last_wait_s = waited
            attached.batches += 1
            found.takers.add(client)
            found.holders.add(attached.token)
            attached.position = found.after
            self._audit(found, attached.since)  # logged before it is sent: a batch a trainer holds is always logged
            self._collect()
            self._cond.notify_all()
            return found

    def _audit(self, ready: Ready, since: str | None) -> None:
        """Log the delivery once per attempt: peers of one attempt share it; a client of a new attempt taking a batch
        that a crashed one took (still held by its dead client) needs its own record, which its marker keeps."""
        if since not in ready.logged:
            ready.logged.add(since)
            self.context.audit({**ready.record, "since": since})

    def give_back(self, client: int, seqs: set[int], lent: Sequence[Ready] = ()) -> None:
        """The client received these batches (of this stream's, or ``lent``) and its trainer never had them: once
        every client that took one gave it back, its delivery is logged as returned (and logged again if a peer
        takes it later)."""
        with self._cond:
            for ready in [*self.ready, *lent]:
                if ready.seq not in seqs or client not in ready.takers:
                    continue
                ready.returned.add(client)
                if ready.returned >= ready.takers:
                    for since in ready.logged:
                        self.context.audit(returned_record(ready.record, since))
                    ready.logged.clear()

    def _done_with(self, ready: Ready) -> bool:
        """No client of the group needs this batch any more (holders aside)."""
        past = all(c.position.key > ready.before.key for c in self.clients.values())
        return past and (len(self.clients) >= self.group or len(ready.takers) >= self.group)

    def _collect(self) -> None:
        for ready in list(self.ready):
            if not ready.holders and self._done_with(ready):
                self._drop(ready)

    def _drop(self, ready: Ready) -> None:
        """Forget a batch; its segment is free again once no client holds it."""
        self.ready.remove(ready)
        if ready.holders:
            self.context.lend(ready, self)
            return
        self._recycle(ready)

    def _recycle(self, ready: Ready) -> None:
        """A batch no client holds any more: its segment is free again, or closed if a departed client may read it
        (holding the lock)."""
        self._segments.recycle(ready.segment, ready.abandoned, self._slot_limit())

    def return_lent(self, ready: Ready, token: str, left: bool) -> bool:
        """The client ``token`` dropped ``ready``, a batch of this stream lent to it (``left``: it left holding it);
        True when no client holds it any more: its segment is recycled."""
        with self._cond:
            if token not in ready.holders:
                return False
            ready.holders.discard(token)
            ready.abandoned = ready.abandoned or left  # its client left holding it
            if ready.holders:
                return False
            self._recycle(ready)
            return True

    def harvest(self) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """Batches no client took yet, as (delivery record, decoded samples): views of their segments, which are never
        reused. The views keep the pages alive after the stream closes."""
        harvested: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        with self._cond:
            for ready in self.ready:
                base = ready.segment.base
                if ready.takers or ready.record.get("replaced") or base is None:
                    continue
                batch = decode_arrays(ready.frame, base)
                harvested.append((ready.record, uncollate(batch, copy=False)))
                ready.abandoned = True
        return harvested

    def client_rows(self) -> list[dict[str, Any]]:
        """One metrics row per attached client: its ranks, batches and waits."""
        with self._cond:
            return [
                {
                    "client": str(attached.client),
                    "rank": attached.rank,
                    "dp_rank": self.key[1],
                    "dp_world_size": self.key[0],
                    "batches": attached.batches,
                    "waited_s": attached.waited_s,
                    "last_wait_s": attached.last_wait_s,
                }
                for attached in self.clients.values()
            ]

    def segments(self) -> tuple[int, int]:
        """Segments this stream keeps and their bytes."""
        with self._cond:
            kept = self._segments.kept()
            return len(kept), sum(s.size for s in kept)

    def live(self) -> set[tuple[int, int]]:
        """(slot, generation) of the segments this stream keeps."""
        with self._cond:
            return {(s.slot, s.generation) for s in self._segments.kept()}

    def close(self) -> None:
        """Stop the producer, the feed and free every segment (idempotent)."""
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._cond.notify_all()
        self.producer.close()
        self._thread.join(timeout=30)
        with self._cond:
            self._segments.close()
            self.ready.clear()
