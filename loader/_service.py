"""`FeedService`: the feed engine behind a Unix socket, one per node, shared by every trainer rank on it.

::

    client ──hello(rank, dp rank/size, accumulation, its own cursor)──▶ a stream per (dp size, dp rank, accumulation)
           ◀──welcome(fingerprints, where it continues)──
           ──next(released batches)──▶ the batch whose start is the client's cursor
           ◀──batch(header; a segment's descriptor the first time)── tensors are views of shared memory

One `FieldReader` (cache tiers, I/O threads) and one set of decode workers serve every
stream. A stream is a `Feed` for one data-parallel rank plus a producer thread that collates
its batches straight into the stream's shared-memory segments, ``prefetch_batches`` ahead.
Tensor/context-parallel peers (same data-parallel rank) attach to the same stream and get
the same batch, read and decoded once.

Each client holds its own cursor (the feed state after the last batch it yielded): a stream
serves a client the batch that starts where the client is, so a restarted service, or a
restarted stream, continues every client exactly where it was. A batch is audited when the
client moves past it (its next request or its goodbye), once per data-parallel rank.

Faults: a malformed, oversized or unknown message gets an error reply and that connection
closes; the service and other clients go on. A client that dies releases its batches (its
segments are reused); segments are ``memfd`` files, so nothing outlives the processes.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
import os
import socket
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ._collate import collate, uncollate
from ._cursor import PlanCursor
from ._decode import make_decoder
from ._errors import OmnifeedError, StateMismatchError
from ._audit import delivery_record
from ._feed import Feed, feed_state
from ._feed_metrics import FeedMetrics
from ._feed_pipeline import FieldReader
from ._healing import FeedError
from ._index import SampleIndex
from ._plan import Plan
from ._pools import DecodePools
from ._plan import MicroBatch
from ._service_arena import Segment, SegmentWriter, encode_batch, grown_size, tensor_decoder
from ._service_config import ServiceConfig
from ._wire import MAX_REQUEST_BYTES, PROTOCOL, ProtocolError, decode, encode, receive, send

log = logging.getLogger("omnifeed.service")

_MAX_GRAD_ACCUM = 4096
_HANDOVER_LIMIT = 512  # micro-batches of retired streams kept for the new ones
_MAX_WORLD = 1 << 20


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
class _Ready:
    """A collated batch in a segment: where it starts and ends in the stream, who took and still holds it."""

    seq: int
    before: dict[str, Any]
    after: dict[str, Any]
    segment: Segment
    frame: bytes
    record: dict[str, Any]
    takers: set[int] = field(default_factory=set)
    holders: set[int] = field(default_factory=set)
    audited: bool = False


@dataclass(eq=False)
class _Attached:
    """A client of a stream: its cursor, its batch in hand (audited when it moves past it), its waiting."""

    client: int
    rank: int
    position: dict[str, Any]
    since: str | None = None  # the checkpoint the client resumed from (its deliveries are tagged with it)
    last: _Ready | None = None
    batches: int = 0
    waited_s: float = 0.0
    last_wait_s: float = 0.0


class _Stream:
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
        self.ready: list[_Ready] = []
        self.clients: dict[int, _Attached] = {}
        self.head = self.feed.state_dict()  # where the producer continues
        self.restart_to: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.closed = False
        self.idle_since: float | None = time.monotonic()
        self._seq = 0
        self._slots: list[Segment] = []
        self._free: list[Segment] = []
        self._prefetch = service.config.prefetch_batches
        self._thread = threading.Thread(target=self._produce, name=f"omnifeed-stream-{dp_rank}", daemon=True)
        self._thread.start()

    # -- producer --------------------------------------------------------------------------
    def _waiting(self) -> int:
        return sum(1 for b in self.ready if not self._done_with(b))

    def _room(self) -> bool:
        untaken = sum(1 for b in self.ready if not b.takers)
        return untaken < self._prefetch and self._waiting() < self._prefetch + 2 * self.group

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
        if self._free:
            return self._free.pop()
        if len(self._slots) < self._prefetch + 2 * self.group + 2:
            segment = Segment(len(self._slots), 0, self._slots[-1].size if self._slots else 0)
            self._slots.append(segment)
            return segment
        return Segment(-1, 0, self._slots[-1].size)  # clients hold every slot: a one-off

    def _publish(self, taken: Any, before: dict[str, Any], after: dict[str, Any], segment: Segment) -> None:
        writer = SegmentWriter(segment)
        batch = collate(taken.samples, taken.keys, taken.info, writer.alloc)
        if writer.overflowed:
            grown = Segment(segment.slot, segment.generation + 1, grown_size(writer.needed))
            del batch
            with self.cond:
                if segment.slot >= 0:
                    self._slots[segment.slot] = grown
            segment.close()
            segment, writer = grown, SegmentWriter(grown)
            batch = collate(taken.samples, taken.keys, taken.info, writer.alloc)
        message = {"op": "batch", "seq": self._seq, "segment": segment.name, "batch": encode_batch(batch, segment),
                   "state": after}
        frame = encode(message)
        del batch, message
        with self.cond:
            self.ready.append(_Ready(self._seq, before, after, segment, frame, taken.record))
            self._seq += 1
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

    def attach(self, client: int, rank: int, state: dict[str, Any], since: str | None) -> None:
        """Serve ``client`` from ``state``; restart production there when this stream is past it (holding the lock)."""
        if not self.servable(state):
            later = [c for c in self.clients.values() if _order(c.position) < _order(state)]
            if later:
                raise RequestError("position", "another client of this data-parallel rank is at an earlier "
                                   "position that does not lead to yours; tensor-parallel peers must resume from "
                                   "the same checkpoint")
            self.restart_to = state
        self.clients[client] = _Attached(client, rank, state, since)
        self.idle_since = None
        self.cond.notify_all()

    def detach(self, client: int, moved_past: bool) -> None:
        """The client left (``moved_past``: it said goodbye, so its batch in hand is delivered)."""
        with self.cond:
            attached = self.clients.pop(client, None)
            if attached is None:
                return
            if moved_past and attached.last is not None:
                self._audit(attached.last, attached.since)
            for ready in self.ready:
                ready.holders.discard(client)
            self._collect()
            if not self.clients:
                self.idle_since = time.monotonic()
            self.cond.notify_all()

    def release(self, client: int, seqs: list[int]) -> None:
        """The client dropped these batches' tensors: their segments may be reused (holding the lock)."""
        wanted = set(seqs)
        for ready in self.ready:
            if ready.seq in wanted:
                ready.holders.discard(client)

    def take(self, client: int, stopping: threading.Event) -> _Ready:
        """The batch that starts at the client's cursor (blocks until produced)."""
        with self.cond:
            attached = self.clients[client]
            if attached.last is not None:  # asking for the next batch: it moved past the last one
                self._audit(attached.last, attached.since)
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
                self.service.record_resize(time.perf_counter() - self.resize_started)
                self.resize_started = None
            attached.waited_s += waited
            attached.last_wait_s = waited
            attached.batches += 1
            found.takers.add(client)
            found.holders.add(client)
            attached.position, attached.last = found.after, found
            self._collect()
            self.cond.notify_all()
            return found

    def reack(self, state: dict[str, Any], since: str | None) -> None:
        """Audit the batch a client yielded before the service restarted (from where it started)."""
        cursor = PlanCursor(self.feed.plan, world_size=self.key[0], grad_accum=self.key[2])
        cursor.load_state_dict(state["plan"])
        step = cursor.next_step()
        accum = int(state["accum_done"])
        micro_batch = step.for_rank(self.key[1])[accum]
        record = delivery_record(step, self.key[1], accum, micro_batch, self.service.index.keys(micro_batch.positions))
        self.service.write_audit({**record, "replaced": [], "reack": True, "since": since})

    def _audit(self, ready: _Ready, since: str | None) -> None:
        if not ready.audited:
            ready.audited = True
            self.service.write_audit({**ready.record, "since": since})

    def _done_with(self, ready: _Ready) -> bool:
        """No client of the group needs this batch any more (holders aside)."""
        past = all(_order(c.position) > _order(ready.before) for c in self.clients.values())
        return past and (len(self.clients) >= self.group or len(ready.takers) >= self.group)

    def _collect(self) -> None:
        for ready in list(self.ready):
            if not ready.holders and self._done_with(ready):
                self._drop(ready)

    def _drop(self, ready: _Ready) -> None:
        """Forget a batch; its segment is free again once no client holds it."""
        self.ready.remove(ready)
        if ready.holders:
            self.service.lent(ready, self)
            return
        self.recycle(ready.segment)

    def recycle(self, segment: Segment) -> None:
        """A segment no client holds any more (holding the lock)."""
        if segment.slot >= 0 and segment.slot < len(self._slots) and self._slots[segment.slot] is segment:
            self._free.append(segment)
        else:
            segment.close()

    def harvest(self) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """Batches no client took yet, as (delivery record, decoded samples) private copies (holding the lock)."""
        harvested = []
        for ready in self.ready:
            base = ready.segment.base
            if ready.takers or ready.record.get("replaced") or base is None:
                continue
            batch = decode(ready.frame[4:], tensor_decoder(lambda slot, generation: base))["batch"]
            harvested.append((ready.record, uncollate(batch)))
        return harvested

    def segments(self) -> tuple[int, int]:
        """Segments this stream keeps and their bytes."""
        with self.cond:
            return len(self._slots), sum(s.size for s in self._slots)

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
                segment.close()
            self._slots.clear()
            self._free.clear()
            self.ready.clear()


@dataclass(eq=False)
class _Connection:
    """One client connection: its socket, who it is, the segments it has mapped."""

    id: int
    sock: socket.socket
    stream: _Stream | None = None
    known: set[tuple[int, int]] = field(default_factory=set)
    said_bye: bool = False


class FeedService:
    """The node's feed service: streams for its clients, shared decode workers and caches, a control socket."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.index = SampleIndex(config.index)
        self.plan = Plan.from_index(self.index, config.feed.plan)
        self.feed_metrics = FeedMetrics()
        decoders = {m: make_decoder(m, config.feed.decode) for m in ("text", "image", "video", "audio")}
        self.reader = FieldReader(config.feed, decoders, self.feed_metrics, self.index.fingerprint)
        self.pools = DecodePools(config.feed, self._pool_error)
        self._lock = threading.Lock()
        self._lent: list[tuple[_Ready, _Stream]] = []
        self._streams: dict[tuple[int, int, int], _Stream] = {}
        self._connections: dict[int, _Connection] = {}
        self._next_id = 1
        self._audit_lock = threading.Lock()
        self._resumes: set[str] = set()
        self._audit: IO[str] | None = open(config.audit_log, "a", encoding="utf-8") if config.audit_log else None  # noqa: SIM115
        self._stopping = threading.Event()
        self._started = time.monotonic()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._metrics_server: Any = None
        self.metrics_port: int | None = None
        self.resizes = 0
        self.resize_seconds = self.last_resize_s = 0.0
        self.handed_over = 0  # micro-batches a new stream took decoded from a retired one
        self._topology: tuple[int, int] | None = None  # (data-parallel size, accumulation) of the newest stream
        self._handover: OrderedDict[tuple[int, int], tuple[list[str], list[dict[str, Any]]]] = OrderedDict()

    def _pool_error(self, exc: BaseException) -> None:
        log.error("a decode worker failed: %s: %s", type(exc).__name__, exc)

    @property
    def address(self) -> str:
        """The socket path clients connect to."""
        return self.config.socket

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Listen (reaping a crashed predecessor's socket), start the metrics endpoint and the housekeeping thread."""
        path = Path(self.config.socket)
        _private_directory(path.parent)
        _reap_stale_socket(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old_umask)
        listener.listen(64)
        self._listener = listener
        if self.config.metrics_port is not None:
            from ._service_metrics import start_metrics_server

            self._metrics_server, self.metrics_port = start_metrics_server(
                self.metrics, self.config.metrics_port, self.config.metrics_host)
        for target, name in ((self._accept, "omnifeed-accept"), (self._housekeep, "omnifeed-housekeeping")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("serving %s at %s", self.config.index, path)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the service stops (or ``timeout``); True if it stopped."""
        return self._stopping.wait(timeout)

    def stop(self) -> None:
        """Stop accepting, end every connection and stream, release every resource (idempotent)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            connections = list(self._connections.values())
            streams = list(self._streams.values())
            self._streams.clear()
        for connection in connections:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for stream in streams:
            stream.close()
        for thread in self._threads:
            thread.join(timeout=10)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.pools.close()
        self.reader.close()
        with self._audit_lock:
            if self._audit is not None:
                self._audit.close()
                self._audit = None
        try:
            Path(self.config.socket).unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> FeedService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if len(self._connections) >= self.config.max_clients:
                    _refuse(sock, "busy", f"the service serves {self.config.max_clients} connections at most")
                    continue
                connection = _Connection(self._next_id, sock)
                self._next_id += 1
                self._connections[connection.id] = connection
            threading.Thread(target=self._serve, args=(connection,), name=f"omnifeed-client-{connection.id}",
                             daemon=True).start()

    def _housekeep(self) -> None:
        """Close streams that had no client for ``stream_idle_s``."""
        while not self._stopping.wait(min(1.0, max(self.config.stream_idle_s, 0.05))):
            now = time.monotonic()
            with self._lock:
                idle = [k for k, s in self._streams.items()
                        if s.idle_since is not None and now - s.idle_since >= self.config.stream_idle_s]
                closing = [self._streams.pop(k) for k in idle]
            for stream in closing:
                stream.close()

    # -- one connection --------------------------------------------------------------------
    def _serve(self, connection: _Connection) -> None:
        sock = connection.sock
        try:
            while not self._stopping.is_set():
                try:
                    message, _ = receive(sock, MAX_REQUEST_BYTES)
                except (EOFError, ConnectionError):
                    return
                except ProtocolError as exc:  # the byte stream may be out of step: answer and hang up
                    _refuse(sock, "protocol", str(exc))
                    return
                try:
                    if not self._handle(connection, message):
                        return
                except RequestError as exc:
                    _refuse(sock, exc.code, str(exc))
                    return
        except OSError:
            return
        finally:
            self._disconnect(connection)

    def _handle(self, connection: _Connection, message: dict[str, Any]) -> bool:
        op = message["op"]
        if op == "metrics":
            send(connection.sock, {"op": "metrics", "snapshot": self.metrics()})
            return True
        if op == "hello":
            if connection.stream is not None:
                raise RequestError("protocol", "hello was already sent on this connection")
            welcome = self._hello(connection, message)
            send(connection.sock, welcome)
            return True
        if op == "next":
            self._next(connection, message)
            return True
        if op == "bye":
            connection.said_bye = True
            send(connection.sock, {"op": "bye"})
            return False
        raise RequestError("protocol", f"unknown request {op!r}")

    def _hello(self, connection: _Connection, message: dict[str, Any]) -> dict[str, Any]:
        protocol = message.get("protocol")
        if protocol != PROTOCOL:
            raise RequestError("protocol", f"protocol version {protocol!r} is not served here (this service speaks "
                               f"{PROTOCOL}); use an omnifeed client of the same version as the service")
        for what in ("index_fingerprint", "config_fingerprint"):
            expected, mine = message.get(what), getattr(self.plan, what)
            if expected is not None and expected != mine:
                raise RequestError("fingerprint", f"the client expects {what} {expected} but this service feeds "
                                   f"{mine} ({self.config.index}); point the client at the service for its dataset")
        rank = _int(message, "rank", 0, _MAX_WORLD - 1)
        world = _int(message, "world_size", 1, _MAX_WORLD)
        dp_world = _int(message, "dp_world_size", 1, world)
        dp_rank = _int(message, "dp_rank", 0, dp_world - 1)
        accum = _int(message, "grad_accum", 1, _MAX_GRAD_ACCUM)
        if world % dp_world or rank >= world:
            raise RequestError("topology", f"world size {world} (rank {rank}) is not a multiple of the data-parallel "
                               f"size {dp_world}")
        try:
            state = feed_state(self.plan, message.get("state"), world_size=dp_world, grad_accum=accum)
        except StateMismatchError as exc:
            raise RequestError("fingerprint", str(exc)) from None
        except (ValueError, TypeError, KeyError, FeedError) as exc:
            raise RequestError("state", f"the client's state is not usable here: {exc}") from None
        key = (dp_world, dp_rank, accum)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None or stream.closed:
                resized = self._topology is not None and self._topology != (dp_world, accum)
                if self._topology != (dp_world, accum):
                    self._topology = (dp_world, accum)
                    self.resizes += resized
                retiring = self._stale_streams()
            else:
                resized, retiring = False, []
        self._retire(retiring)  # their prefetched batches are handed over before the new streams plan ahead
        with self._lock:
            stream = self._streams.get(key)
            if stream is None or stream.closed:
                stream = self._streams[key] = _Stream(self, key, world // dp_world, state)
                if resized:
                    stream.resize_started = time.perf_counter()
        since = message.get("resume")
        if since is not None and (not isinstance(since, str) or len(since) > 64):
            raise RequestError("protocol", "hello field 'resume' must be a string of at most 64 characters")
        if since is not None:
            self._mark_resume(since, state)
        with stream.cond:
            stream.group = max(stream.group, world // dp_world)
            stream.attach(connection.id, rank, state, since)
        connection.stream = stream
        reack = message.get("reack")
        if reack is not None:
            try:
                stream.reack(feed_state(self.plan, reack, world_size=dp_world, grad_accum=accum), since)
            except (ValueError, TypeError, KeyError, IndexError, FeedError, StateMismatchError) as exc:
                log.warning("client %d re-sent an unusable delivery (%s); not audited", connection.id, exc)
        return {"op": "welcome", "protocol": PROTOCOL, "client": connection.id, "state": state,
                "index_fingerprint": self.plan.index_fingerprint, "config_fingerprint": self.plan.config_fingerprint,
                "num_samples": self.index.num_samples, "batch_size": self.plan.config.batch_size,
                "budget": self.plan.budget}

    def _next(self, connection: _Connection, message: dict[str, Any]) -> None:
        stream = connection.stream
        if stream is None:
            raise RequestError("protocol", "send hello before asking for batches")
        released = message.get("release", [])
        if not isinstance(released, list) or len(released) > 1024 or not all(isinstance(s, int) for s in released):
            raise RequestError("protocol", "'release' must be a list of at most 1024 batch numbers")
        with stream.cond:
            stream.release(connection.id, released)
        self._release_lent(connection.id, released)
        ready = stream.take(connection.id, self._stopping)
        segment = ready.segment
        name = (segment.slot, segment.generation)
        fds: list[int] = []
        if segment.slot < 0 or name not in connection.known:
            fds = [segment.fd]
            connection.known.add(name)
        sock = connection.sock
        if fds:
            sent = sock.sendmsg([ready.frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_array(fds))])
            if sent < len(ready.frame):
                sock.sendall(memoryview(ready.frame)[sent:])
        else:
            sock.sendall(ready.frame)

    def _disconnect(self, connection: _Connection) -> None:
        with self._lock:
            self._connections.pop(connection.id, None)
        if connection.stream is not None:
            connection.stream.detach(connection.id, connection.said_bye)
            with self._lock:
                retiring = self._stale_streams()
            self._retire(retiring)
        self._release_lent(connection.id, None)
        try:
            connection.sock.close()
        except OSError:
            pass

    # -- resizes: streams of an old topology hand their prefetched batches over -----------------
    def _stale_streams(self) -> list[_Stream]:
        """Client-less streams of another topology than the newest (holding the service lock); removed."""
        stale = [k for k, s in self._streams.items()
                 if (k[0], k[2]) != self._topology and not s.clients and self._topology is not None]
        return [self._streams.pop(k) for k in stale]

    def _retire(self, streams: list[_Stream]) -> None:
        """Keep the decoded samples of their untaken batches for whichever new stream deals them; close them."""
        for stream in streams:
            with stream.cond:
                harvested = stream.harvest()
            with self._lock:
                for record, samples in harvested:
                    self._handover[(record["epoch"], record["micro_batch"])] = (record["keys"], samples)
                while len(self._handover) > _HANDOVER_LIMIT:
                    self._handover.popitem(last=False)
            threading.Thread(target=stream.close, name="omnifeed-retire", daemon=True).start()

    def take_handover(self, micro_batch: MicroBatch) -> list[dict[str, Any]] | None:
        """The decoded samples of ``micro_batch`` if a retired stream had prefetched it (taken once)."""
        with self._lock:
            if not self._handover:
                return None
            entry = self._handover.pop((micro_batch.epoch, micro_batch.index), None)
        if entry is None or entry[0] != self.index.keys(micro_batch.positions):
            return None
        self.handed_over += 1
        return entry[1]

    def record_resize(self, seconds: float) -> None:
        """A stream of a new topology served its first batch ``seconds`` after it was asked for."""
        with self._lock:
            self.resize_seconds += seconds
            self.last_resize_s = seconds

    # -- batches lent to clients after their stream moved on ---------------------------------
    def lent(self, ready: _Ready, stream: _Stream) -> None:
        """Keep track of a dropped batch that clients still hold (called holding the stream's lock)."""
        with self._lock:
            self._lent.append((ready, stream))

    def _release_lent(self, client: int, seqs: list[int] | None) -> None:
        with self._lock:
            if not self._lent:
                return
            lent = list(self._lent)
        done = []
        for ready, stream in lent:
            if seqs is None or ready.seq in seqs:
                with stream.cond:
                    ready.holders.discard(client)
                    if not ready.holders:
                        stream.recycle(ready.segment)
                        done.append(ready)
        if done:
            with self._lock:
                self._lent = [(r, s) for r, s in self._lent if r not in done]

    # -- audit and metrics -----------------------------------------------------------------
    def _mark_resume(self, since: str, state: dict[str, Any]) -> None:
        """Log that trainers resumed from checkpoint ``since``: later deliveries from before it are rolled back."""
        with self._audit_lock:
            if since in self._resumes:
                return
            self._resumes.add(since)
        self.write_audit({"resume": since, "epoch": state["plan"]["epoch"], "step": state["plan"]["step"],
                          "accum_done": state["accum_done"], "topology_version": state["plan"]["topology_version"],
                          "keys": []})

    def write_audit(self, record: dict[str, Any]) -> None:
        """Append one delivery record to the audit log (if configured)."""
        with self._audit_lock:
            if self._audit is not None:
                self._audit.write(json.dumps(record) + "\n")
                self._audit.flush()

    def metrics(self) -> dict[str, Any]:
        """The metrics snapshot (docs/service.md): engine, caches, storage, clients, streams, segments."""
        with self._lock:
            streams = list(self._streams.values())
        clients = []
        segments = segment_bytes = 0
        for stream in streams:
            count, nbytes = stream.segments()
            segments, segment_bytes = segments + count, segment_bytes + nbytes
            with stream.cond:
                for attached in stream.clients.values():
                    clients.append({"client": str(attached.client), "rank": attached.rank, "dp_rank": stream.key[1],
                                    "dp_world_size": stream.key[0], "batches": attached.batches,
                                    "waited_s": attached.waited_s, "last_wait_s": attached.last_wait_s})
        snapshot = self.feed_metrics.snapshot(self.pools.buffers())
        return {
            "service": {"uptime_s": time.monotonic() - self._started, "protocol": PROTOCOL,
                        "index_fingerprint": self.plan.index_fingerprint, "clients": len(clients),
                        "streams": len(streams), "segments": segments, "segment_bytes": segment_bytes},
            **snapshot,
            "cache": self.reader.source.stats(), "storage_degraded": self.reader.source.degraded,
            "read_ahead": self.reader.read_ahead(), "clients": clients,
            "resizes": self.resizes, "resize_seconds": self.resize_seconds, "last_resize_s": self.last_resize_s,
            "handed_over": self.handed_over,
        }


def _int(message: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = message.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError("protocol", f"hello field {name!r} must be an integer in {low}..{high}, got {value!r}")
    return value


def _fd_array(fds: list[int]) -> bytes:
    import array

    return array.array("i", fds).tobytes()


def _refuse(sock: socket.socket, code: str, message: str) -> None:
    try:
        send(sock, {"op": "error", "code": code, "message": message})
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _private_directory(path: Path) -> None:
    """Create ``path`` with mode 0700, or check that it is this user's and closed to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise OmnifeedError(f"socket directory {path} belongs to uid {info.st_uid}, not to this user "
                            f"({os.getuid()}); choose a directory of your own for the socket")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise OmnifeedError(f"socket directory {path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}); "
                            f"run `chmod 700 {path}` or choose another directory")


def _reap_stale_socket(path: Path) -> None:
    """Remove a socket left by a crashed service; refuse to start beside a live one."""
    if not path.exists() and not path.is_symlink():
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise OmnifeedError(f"{path} exists and is not a socket; remove it or choose another socket path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        log.warning("removing the socket of a service that is gone: %s", path)
        path.unlink()
        return
    finally:
        probe.close()
    raise OmnifeedError(f"an omnifeed service is already listening at {path}; stop it or choose another socket")
