"""The service's streams, one per (data-parallel size, data-parallel rank, accumulation), and topology changes.

A hello that needs a stream of another topology (data-parallel size, accumulation) than the
newest starts a **change** (`Resizes`): client-less streams of the old topology retire — their
untaken batches are handed over (`BatchLedger`) before any new stream plans ahead — and the
change lasts until the slowest new stream served its first batch. Changes are serialized.
Streams are at most ``max_clients``, and the micro-batches their steps deal (each stream deals
its whole step, data-parallel size × accumulation) at most ``max_micro_batches_dealt`` together:
a new one past either closes streams idle longest (no client), or the hello is refused with
``busy``. A stream without clients for ``stream_idle_s`` closes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..feed import FeedPosition
from ._ledger import BatchLedger
from ._producer_process import Key
from ._protocol import RequestError
from ._stream import Stream, StreamContext


class Resizes:
    """Topology changes: how many, and the seconds they took (each until its slowest new stream's first batch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.seconds = self.last_s = 0.0
        self.started: float | None = None  # when the latest change's first hello arrived (time.perf_counter)
        self._slowest = 0.0  # the slowest stream of that change to its first batch

    def begin(self) -> None:
        """A change starts now."""
        with self._lock:
            self.count += 1
            self.started, self._slowest = time.perf_counter(), 0.0

    def record(self, started: float) -> None:
        """A stream of the change that began at ``started`` served its first batch (an earlier change's: ignored)."""
        with self._lock:
            if started != self.started:
                return
            seconds = time.perf_counter() - started
            if seconds > self._slowest:
                self.seconds += seconds - self._slowest
                self._slowest = self.last_s = seconds


class StreamTable:
    """The streams by key; opening one (a topology change first, when it is one), leaving, idling, closing."""

    def __init__(
        self, context: StreamContext, ledger: BatchLedger, resizes: Resizes, max_clients: int, max_dealt: int
    ) -> None:
        self._context, self._ledger, self._resizes, self._max = context, ledger, resizes, max_clients
        self._max_dealt = max_dealt
        self._lock = threading.Lock()
        self._changing = threading.Lock()  # serializes topology changes: retire and hand over, then new streams
        self._streams: dict[Key, Stream] = {}
        self._closing: list[threading.Thread] = []  # streams closing in threads of their own (`close` waits)
        self._topology: tuple[int, int] | None = None  # (data-parallel size, accumulation) of the newest stream

    def open(self, key: Key, group: int, start: FeedPosition, attach: Callable[[Stream], None]) -> Stream:
        """The stream of ``key``, created at ``start`` for a peer group of ``group`` if there is none (or it closed),
        with its client attached by ``attach`` before the table lets go: `close_idle` never closes a stream between its
        opening and its first client."""
        dp_world, _, accum = key
        with self._changing:  # a topology change: the old streams hand over before any new stream plans ahead
            with self._lock:
                stream = self._streams.get(key)
                retiring = []
                if stream is None or stream.closed:
                    if self._topology != (dp_world, accum):
                        if self._topology is not None:
                            self._resizes.begin()
                            self._ledger.clear_handover()  # entries of an earlier change are stale
                        self._topology = (dp_world, accum)
                    retiring = self._stale()
            self._retire(retiring)
            with self._lock:
                stream = self._streams.get(key)
                evicted: list[Stream] = []
                if stream is None or stream.closed:
                    self._streams.pop(key, None)
                    while len(self._streams) >= self._max:  # streams are bounded as connections are
                        evicted.append(self._evict_idle(f"the service keeps {self._max} streams at most (max_clients)"))
                    while self._dealt() + dp_world * accum > self._max_dealt:  # and so is what they deal
                        evicted.append(
                            self._evict_idle(
                                f"its streams deal {self._dealt()} micro-batches per step and this one would deal "
                                f"{dp_world * accum} more, past max_micro_batches_dealt ({self._max_dealt})"
                            )
                        )
                    stream = self._streams[key] = Stream(self._context, key, group, start)
                    stream.resize_started = self._resizes.started
                attach(stream)  # may refuse (`RequestError`): a new stream stays, idle, for `close_idle`
            for gone in evicted:
                self._close_in_background(gone, "omnifeed-evict")
        return stream

    def leave(self, stream: Stream, client: int) -> None:
        """``client`` left ``stream``; client-less streams of an old topology retire."""
        stream.detach(client)
        with self._changing:
            with self._lock:
                retiring = self._stale()
            self._retire(retiring)

    def streams(self) -> list[Stream]:
        """The open streams."""
        with self._lock:
            return list(self._streams.values())

    def close_idle(self, idle_s: float) -> None:
        """Close the streams that had no client for ``idle_s`` seconds."""
        now = time.monotonic()
        with self._lock:
            idle = [k for k, s in self._streams.items() if s.idle_since is not None and now - s.idle_since >= idle_s]
            closing = [self._streams.pop(k) for k in idle]
        for stream in closing:
            stream.close()

    def close(self) -> None:
        """Close every stream, all at once (each may wait for its producer process to finish a batch), and wait for
        the streams closing in the background."""
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            self._close_in_background(stream, "omnifeed-close")
        with self._lock:
            closing, self._closing = self._closing, []
        # A closing thread still running when the interpreter exits frees its stream's Arrow readers there, and
        # Arrow aborts the process (std::terminate) when such a thread cannot take the interpreter lock back.
        for thread in closing:
            thread.join()

    def snapshot(self) -> dict[str, Any]:
        """The streams' part of the metrics: ``clients`` (one row per attached client), ``streams``, ``segments``,
        ``segment_bytes``, ``one_off_segments``, ``producer_pids`` (of the streams' producer processes, when they
        have them) and ``producer_restarts`` (producer processes lost and replaced, in the open streams)."""
        streams = self.streams()
        clients = []
        segments = segment_bytes = one_offs = 0
        for stream in streams:
            count, nbytes = stream.segments()
            segments, segment_bytes, one_offs = segments + count, segment_bytes + nbytes, one_offs + stream.one_offs
            clients.extend(stream.client_rows())
        return {
            "clients": clients,
            "streams": len(streams),
            "segments": segments,
            "segment_bytes": segment_bytes,
            "one_off_segments": one_offs,
            "producer_pids": [pid for s in streams if (pid := s.producer.pid) is not None],
            "producer_restarts": sum(s.producer.restarts for s in streams),
        }

    def _stale(self) -> list[Stream]:
        """Client-less streams of another topology than the newest (holding the lock); removed."""
        stale = [
            k
            for k, s in self._streams.items()
            if (k[0], k[2]) != self._topology and not s.clients and self._topology is not None
        ]
        return [self._streams.pop(k) for k in stale]

    def _dealt(self) -> int:
        """Micro-batches the open streams deal per step, together (holding the lock)."""
        return sum(dp_world * accum for dp_world, _, accum in self._streams)

    def _evict_idle(self, limit: str) -> Stream:
        """Make room for a new stream (holding the lock): the client-less stream idle longest, removed."""
        idle = [(s.idle_since, k) for k, s in self._streams.items() if s.idle_since is not None and not s.clients]
        if not idle:
            raise RequestError(
                "busy",
                f"{limit}, and every stream has a client; connect again later, or raise "
                "the limit in the service config",
            )
        return self._streams.pop(min(idle)[1])

    def _retire(self, streams: list[Stream]) -> None:
        """Hand the decoded samples of their untaken batches over to whichever new stream deals them; close them."""
        for stream in streams:
            self._ledger.hand_over(stream.harvest())
            self._close_in_background(stream, "omnifeed-retire")

    def _close_in_background(self, stream: Stream, name: str) -> None:
        """Close ``stream`` in a thread of its own, which `close` waits for."""
        thread = threading.Thread(target=stream.close, name=name, daemon=True)
        with self._lock:  # started under the lock: `close` never joins a thread not yet started
            self._closing = [t for t in self._closing if t.is_alive()]
            thread.start()
            self._closing.append(thread)
