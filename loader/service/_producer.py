"""How a stream's batches are made: in the service's own process, or in a producer process of the stream's own.

A `Stream` asks its producer for its next batch, collated into one of the stream's segments,
and gets the batch's frame back (`Produced`). Two producers, as ``ServiceConfig.producers`` says:

- `FeedProducer` (``threads``): the stream's `Feed` in the service's process, on the engine every
  stream shares (decode workers shared by need, each step dealt once, a resize's hand-over). The
  node's decoding then runs under one interpreter lock: for two data-parallel ranks the service
  made 0.74–0.79× what two in-process feeds make (benchmarks/RESULTS.md, issue 29).
- `ChildProducer` (``processes``): the stream's `Feed` in a child process with an engine of its
  own (its own decode workers: one a CPU of its window on ``producer_cpus: split`` unless the feed
  config sets them, else what that rank's in-process `Feed` would have; the RAM and NVMe tiers
  are the node's, shared; `_producer_process`), collating each batch straight into the stream's
  segment, whose descriptor it is sent once::

      stream ──("produce", seq, handle, name, new?, live)──▶ child: feed.take(), collate into the segment
             ──(the segment's fd, when new to the child)──▶
             ◀──("grow", bytes)── does not fit: ──("segment", handle, name, new?)──▶ collated again
             ◀──("batch", frame, state after, delivery record) | ("error", exception)
      stream ──("seek", state)──▶ a client asked for an earlier position
      metrics pipe: None ──▶ ◀── the feed's metrics (answered by a thread of the child's, even mid-batch)
      hand-over pipe: ──(the descriptor of the ledger's `HeldCount`, once; no hand-over: nothing, never asked)──▶
                      ◀──(epoch, micro-batch, positions)── ──decoded samples or None──▶ (a thread of the service's
                      answers from the `BatchLedger`: what retired streams had decoded before a resize; asked only
                      while the count says it holds some)

  The stream keeps all a client sees (cursors, segments, the audit): the child only reads,
  decodes and collates. A child that dies costs the batch it was making, which a new child
  makes again from the stream's head (a batch counts when the stream serves it, so exactly-once
  holds); ``RESTARTS`` deaths in a row stop the stream. A dead service is an end of file for its
  children, which then exit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util  # noqa: F401  before our exit hook: hooks run in reverse, ours first
import os
import select
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any, Protocol

from ..decode import child_process_type
from ..feed import Feed, FeedConfig, FeedPosition, SharedResources
from ..index import SampleIndex
from ._arena import HeldCount, Segment
from ._placement import CpuWindows
from ._producer_metrics import ProducerMetrics, counters_of, merged_metrics
from ._producer_process import Grow, Key, ProducerGone, ProducerSpec, batch_frame, serve

log = logging.getLogger("omnifeed.service")

SegmentFor = Callable[[], Segment]
"""The stream's next free segment."""

RESTARTS = 3  # a producer process that dies this many times in a row on one batch stops its stream
_METRICS_WAIT_S = 5.0  # a producer process that does not answer a metrics request within this is skipped
_JOIN_S = 5.0


@dataclass(frozen=True)
class Produced:
    """A batch collated into ``segment``: its frame (the reply a client gets), the position after it, its record."""

    frame: bytes
    after: FeedPosition
    record: dict[str, Any]
    segment: Segment


class Producer(Protocol):
    """What a stream asks of whoever makes its batches."""

    restarts: int  # producer processes lost and replaced

    @property
    def pid(self) -> int | None:
        """The producer process's id (None: it runs in the service's process, or has not started)."""

    @property
    def position(self) -> FeedPosition:
        """Where the next batch starts."""

    def produce(self, seq: int, segment_for: SegmentFor, grow: Grow) -> Produced:
        """The next batch, numbered ``seq``, in a segment from ``segment_for`` (or ``grow``)."""

    def seek(self, position: FeedPosition) -> None:
        """Continue at ``position``."""

    def metrics(self) -> dict[str, Any] | None:
        """The feed metrics of its own engine (None: it runs on the service's)."""

    def close(self) -> None:
        """Stop (idempotent)."""


class FeedProducer:
    """The stream's `Feed` in the service's process, on the engine (and decode workers) every stream shares."""

    restarts = 0
    pid = None

    def __init__(
        self, index: SampleIndex, config: FeedConfig, shared: SharedResources, key: Key, start: FeedPosition
    ) -> None:
        dp_world, dp_rank, accum = key
        self.feed = Feed(index, config, world_size=dp_world, rank=dp_rank, grad_accum=accum, shared=shared)
        self.feed.seek(start)  # checked by the handshake: no plan cursor is rebuilt

    @property
    def position(self) -> FeedPosition:
        """Where the next batch starts."""
        return self.feed.position

    def produce(self, seq: int, segment_for: SegmentFor, grow: Grow) -> Produced:
        """Decode the next batch here, then collate it into the stream's next free segment."""
        taken = self.feed.take()
        after = self.feed.position
        frame, segment = batch_frame(taken, after, seq, segment_for(), grow)
        return Produced(frame, after, taken.record, segment)

    def seek(self, position: FeedPosition) -> None:
        """Continue at ``position``."""
        self.feed.seek(position)

    def metrics(self) -> None:
        """None: its metrics are the service engine's."""
        return None

    def close(self) -> None:
        """Stop the feed (idempotent)."""
        self.feed.close()


class ProducerDied(RuntimeError):
    """A stream's producer process died (killed, out of memory, or crashed on the input) too many times in a row."""


class HandoverSource(Protocol):
    """Where a producer process's hand-over questions are answered (the service's `BatchLedger`)."""

    held: HeldCount  # how many micro-batches it holds: a producer asks only while there are some

    def take_at(self, epoch: int, number: int, positions: list[int]) -> list[dict[str, Any]] | None:
        """The decoded samples of micro-batch (epoch, number, positions) a retired stream had made, or None."""


class ChildProducer:
    """The stream's `Feed` in a producer process of its own, started on the first batch, restarted when it dies."""

    def __init__(
        self,
        spec: ProducerSpec,
        counted: ProducerMetrics | None = None,
        handover: HandoverSource | None = None,
        placement: CpuWindows | None = None,
    ) -> None:
        """``counted``: the service's producers' metrics, this one's among them until it closes (so the service's
        counters never go back); ``handover``: where the process asks for a micro-batch a retired stream decoded
        already (None: it never asks); ``placement``: the node's CPU windows its process gets one of (None: the OS
        places it)."""
        self._spec, self._counted, self._handover, self._placement = spec, counted, handover, placement
        self._position: FeedPosition | None = None
        self._process: Any = None
        self._conn: Connection | None = None  # the work pipe: the producer thread's alone
        self._replies = select.poll()  # the work pipe and the process's sentinel (one poll object a process)
        self._metrics_conn: Connection | None = None  # the metrics pipe, under its lock
        self._handover_conn: Connection | None = None  # the hand-over pipe: its thread's (which closes it)
        self._metrics_lock = threading.Lock()
        self._handles: weakref.WeakKeyDictionary[Segment, int] = weakref.WeakKeyDictionary()
        self._next_handle = 0
        self._closing = threading.Event()
        self._lifecycle = threading.Lock()  # a process is started, or the producer closed, never both at once
        self._metrics: dict[str, Any] | None = None  # the running process's, as it last answered
        self._earlier: dict[str, Any] = {}  # the counts of the processes lost before it
        self.restarts = 0  # producer processes lost and replaced
        _live.add(self)
        if counted is not None:
            counted.add(self)

    def start_at(self, position: FeedPosition) -> ChildProducer:
        """Begin at ``position`` (the process starts with the first batch asked for)."""
        self._position = position
        return self

    @property
    def position(self) -> FeedPosition:
        """Where the next batch starts."""
        assert self._position is not None
        return self._position

    @property
    def pid(self) -> int | None:
        """The producer process's id (None until the first batch is asked for)."""
        process = self._process
        return None if process is None else process.pid  # type: ignore[no-any-return]

    def produce(self, seq: int, segment_for: SegmentFor, grow: Grow) -> Produced:
        """The next batch from the producer process, collated into the stream's next free segment."""
        current = [segment_for()]  # the segment the batch goes to: a grown one after an overflow, also on a retry

        def grown(old: Segment, needed: int) -> Segment:
            current[0] = grow(old, needed)
            return current[0]

        deaths = 0
        while True:
            try:
                with self._lifecycle:
                    if self._closing.is_set():
                        raise RuntimeError("the stream is closing")
                    if self._conn is None:
                        self._start()
                return self._exchange(seq, current[0], grown)
            except ProducerGone:
                if self._closing.is_set():
                    raise RuntimeError("the stream is closing") from None
                deaths += 1
                exitcode = self._lost()
                if deaths > RESTARTS:
                    raise ProducerDied(
                        f"the producer process of data-parallel rank {self._spec.key[1]} died {deaths} times in a "
                        f"row on one batch (last exit code {exitcode}); see the service's log, or set "
                        "producers: threads"
                    ) from None
                log.warning(
                    "the producer process of data-parallel rank %d died (exit code %s); another makes its batch again",
                    self._spec.key[1],
                    exitcode,
                )

    def _start(self) -> None:
        context = get_context("forkserver")  # from a clean server, not from this threaded process
        # the server imports what a producer runs once (the service package: ~0.1 s a producer start otherwise)
        context.set_forkserver_preload(["omnifeed.loader", "omnifeed.loader.service._producer_process"])
        parent, child = context.Pipe(duplex=True)
        asks, answers = context.Pipe(duplex=True)
        gives, wants = context.Pipe(duplex=True)
        try:
            process = child_process_type(context)(
                target=serve,
                args=(child, answers, wants, self._spec, self.position.to_dict(), self._handover is not None),
                name=f"omnifeed-producer-{self._spec.key[1]}",
            )
            process.start()
            if self._handover is not None:  # the first thing on the hand-over pipe
                send_handle(gives, self._handover.held.fd, process.pid)
        except BaseException:
            for conn in (parent, asks, gives):
                conn.close()
            raise
        finally:
            for conn in (child, answers, wants):
                conn.close()
        with self._metrics_lock:
            self._metrics_conn = asks
        self._handover_conn = gives
        threading.Thread(
            target=self._answer_handover, args=(gives,), name=f"omnifeed-handover-{self._spec.key[1]}", daemon=True
        ).start()
        replies = select.poll()
        for readable in (parent.fileno(), process.sentinel):
            replies.register(readable, select.POLLIN)
        self._process, self._conn, self._replies = process, parent, replies
        self._handles = weakref.WeakKeyDictionary()  # a new process has mapped none of the segments
        if self._placement is not None and process.pid is not None:
            self._placement.add(self, process.pid)

    def _answer_handover(self, conn: Connection) -> None:
        """Answer the process's hand-over questions until its pipe ends (then close it)."""
        try:
            while True:
                epoch, number, positions = conn.recv()
                conn.send(self._handover.take_at(epoch, number, positions) if self._handover is not None else None)
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    def _handle(self, segment: Segment) -> tuple[int, bool]:
        """The number the process knows ``segment`` by, and whether it is new to it (its descriptor follows)."""
        handle = self._handles.get(segment)
        if handle is not None:
            return handle, False
        handle = self._handles[segment] = self._next_handle
        self._next_handle += 1
        return handle, True

    def _send_segment(self, message: tuple[Any, ...], segment: Segment, new: bool) -> None:
        assert self._conn is not None
        try:
            self._conn.send(message)
            if new:
                send_handle(self._conn, segment.fd, self._process.pid)
        except (EOFError, OSError) as exc:
            raise ProducerGone() from exc

    def _exchange(self, seq: int, segment: Segment, grow: Grow) -> Produced:
        handle, new = self._handle(segment)
        live = [h for s, h in list(self._handles.items()) if s.fd >= 0]
        self._send_segment(("produce", seq, handle, segment.name, new, live), segment, new)
        while True:
            reply = self._receive()
            if reply[0] != "grow":
                break
            segment = grow(segment, reply[1])
            handle, new = self._handle(segment)
            self._send_segment(("segment", handle, segment.name, new), segment, new)
        if reply[0] == "error":  # the feed's own (a storage error is an OSError too): the stream stops on it
            raise reply[1]
        _, frame, after_state, record = reply
        self._position = after = FeedPosition.from_dict(after_state)
        return Produced(frame, after, record, segment)

    def _receive(self) -> Any:
        """The process's next reply; `ProducerGone` when it died (its pipe ended, or it exited)."""
        assert self._conn is not None
        pipe = self._conn.fileno()
        # one poll object a process: multiprocessing's wait() builds and tears down a selector each call
        if not any(fd == pipe for fd, _ in self._replies.poll()):
            raise ProducerGone()
        try:
            return self._conn.recv()  # EOF mid-message when it died writing: nothing else writes here
        except (EOFError, OSError) as exc:
            raise ProducerGone() from exc

    def _lost(self) -> int | None:
        """Reap a dead producer process; its exit code."""
        with self._lifecycle:
            process, conn = self._process, self._conn
            self._process = self._conn = None
        if conn is not None:
            conn.close()
        if self._placement is not None:
            self._placement.remove(self)
        self._drop_metrics_pipe()
        with self._metrics_lock:  # what the lost process counted stays counted: a restart sets no counter back
            if self._metrics is not None:
                self._earlier = merged_metrics([self._earlier, counters_of(self._metrics)])
            self._metrics = None
        if process is None:
            return None
        process.join(_JOIN_S)
        if process.is_alive():
            process.kill()
            process.join(_JOIN_S)
        self.restarts += 1
        return process.exitcode  # type: ignore[no-any-return]

    def seek(self, position: FeedPosition) -> None:
        """Continue at ``position`` (a process that died meanwhile is started there on the next batch)."""
        self._position = position
        if self._conn is None:
            return
        try:
            self._conn.send(("seek", position.to_dict()))
        except (EOFError, OSError):
            self._lost()

    def metrics(self) -> dict[str, Any] | None:
        """Its feed's metrics now, asked on the metrics pipe (the last ones it gave when it does not answer within
        ``_METRICS_WAIT_S``, or is gone; None before the first), with the counts of the processes it lost summed in."""
        with self._metrics_lock:
            conn = self._metrics_conn
            if conn is not None:
                try:
                    conn.send(None)
                    if not conn.poll(_METRICS_WAIT_S):
                        raise TimeoutError()
                    snapshot = conn.recv()
                    if snapshot is not None:
                        self._metrics = snapshot
                except (EOFError, OSError):  # a late answer would be taken for the next one's: the pipe goes
                    if self._metrics_conn is conn:
                        self._metrics_conn = None
                        conn.close()
            if not self._earlier:
                return self._metrics
            return merged_metrics([self._earlier, *([self._metrics] if self._metrics is not None else [])])

    def _drop_metrics_pipe(self) -> None:
        """Close the metrics pipe (a metrics request waiting on it sees its end first); end the hand-over pipe."""
        handover, self._handover_conn = self._handover_conn, None
        if handover is not None:
            _shut(handover)  # its thread sees the end and closes it
        conn = self._metrics_conn
        if conn is not None:
            _shut(conn)
        with self._metrics_lock:
            conn, self._metrics_conn = self._metrics_conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Stop the process: its pipe ends, it finishes the batch in hand and exits (killed after a while)."""
        with self._lifecycle:
            if self._closing.is_set():
                return
            self._closing.set()
            conn, process = self._conn, self._process
        _live.discard(self)
        if self._placement is not None:
            self._placement.remove(self)
        if self._counted is not None:
            self._counted.retire(self, self.metrics())
        self._drop_metrics_pipe()
        if conn is None or process is None:
            return
        _shut(conn)  # the producer thread waiting on it sees its end, and so does the process, after its batch
        process.join(_JOIN_S)
        if process.is_alive():
            process.kill()
            process.join(_JOIN_S)
        conn.close()


def _shut(conn: Connection) -> None:
    """Shut a pipe's socket down both ways: whoever waits on either end sees its end (the descriptor stays open)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as end:
            end.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


_live: weakref.WeakSet[ChildProducer] = weakref.WeakSet()


@atexit.register
def _stop_producers() -> None:
    """Producer processes are not daemons (their feed may start decode processes): an interpreter leaving without
    `FeedService.stop` stops them here, before multiprocessing waits for them."""
    for producer in list(_live):
        producer.close()
