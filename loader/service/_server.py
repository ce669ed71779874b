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
restarted stream, continues every client exactly where it was. A batch is audited when it is
handed to a client, before it is sent, once per data-parallel rank.

Faults: a malformed, oversized or unknown message gets an error reply and that connection
closes; the service and other clients go on. A client that dies releases its batches (its
segments are reused); segments are ``memfd`` files, so nothing outlives the processes.

Bounds (docs/service.md): a hello's step (data-parallel size × accumulation) and peer group are
checked against the plan and the config before anything is planned; streams and connections
are at most ``max_clients``; a peer group is what its attached clients declare, so it shrinks
when they leave; idle and half-sent connections time out.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import select
import socket
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgpack

from .._modalities import MODALITIES
from ..plan._audit import open_audit_log
from ..decode._registry import make_decoder
from .._errors import OmnifeedError, StateMismatchError
from ..plan._cursor import steps_left_in_epoch
from ..feed._feed import feed_state
from ..feed._metrics import FeedMetrics
from ..feed._pipeline import FieldReader
from ..feed._healing import FeedError
from ..index._sample_index import SampleIndex
from ..plan._plan import MicroBatch, Plan
from ..feed._pools import DecodePools
from ._config import ServiceConfig
from ._stream import Ready, RequestError, Stream
from ._protocol import MAX_REQUEST_BYTES, PROTOCOL, ProtocolError, decode, encode, receive, send

log = logging.getLogger("omnifeed.service")

_MAX_GRAD_ACCUM = 4096
_HANDOVER_LIMIT = 512  # micro-batches of retired streams kept for the new ones
_MAX_WORLD = 1 << 20


@dataclass(eq=False)
class _Connection:
    """One client connection: its socket, who it is, the segments it has mapped."""

    id: int
    sock: socket.socket
    stream: Stream | None = None
    known: set[tuple[int, int]] = field(default_factory=set)
    token: str = ""  # the client's own id, the same across its reconnections
    attempt: str | None = None  # the attempt its deliveries belong to (see FeedService._attempt_of)
    said_bye: bool = False
    timed_out: bool = False  # closed by the service for idling: not a client that crashed


class FeedService:
    """The node's feed service: streams for its clients, shared decode workers and caches, a control socket."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self._audit: IO[str] | None = open_audit_log(config.audit_log) if config.audit_log else None
        self.index = SampleIndex(config.index)
        self.plan = Plan.from_index(self.index, config.feed.plan)
        per_epoch, epoch_words = _epoch_micro_batches(self.plan)
        cap = config.max_micro_batches_per_step
        self._max_step = min(cap, per_epoch)  # micro-batches a hello's step may deal: its cost, time and memory
        self._max_step_why = (f"max_micro_batches_per_step is {cap} in the service config" if cap <= per_epoch
                              else f"an epoch of {config.index} deals {epoch_words}")
        self.feed_metrics = FeedMetrics()
        decoders = {m: make_decoder(m, config.feed.decode) for m in MODALITIES}
        self.reader = FieldReader(config.feed, decoders, self.feed_metrics, self.index.fingerprint)
        self.pools = DecodePools(config.feed, self._pool_error)
        self._lock = threading.Lock()
        self._lent: list[tuple[Ready, Stream]] = []
        self._streams: dict[tuple[int, int, int], Stream] = {}
        self._connections: dict[int, _Connection] = {}
        self._next_id = 1
        self._seqs = itertools.count()
        self.instance = uuid.uuid4().hex  # clients tell services apart by it (batch numbers are per instance)
        self._audit_lock = threading.Lock()
        self._attempts: dict[str, tuple[str, bool]] = {}  # checkpoint digest -> (its latest attempt, crashed)
        self._stopping = threading.Event()
        self._started = time.monotonic()
        self._listener: socket.socket | None = None
        self._bound: tuple[int, int] | None = None  # (device, inode) of the socket file start() bound
        self._threads: list[threading.Thread] = []
        self._metrics_server: Any = None
        self.metrics_port: int | None = None
        self.resizes = 0
        self.resize_seconds = self.last_resize_s = 0.0
        self.handed_over = 0  # micro-batches a new stream took decoded from a retired one
        self._topology: tuple[int, int] | None = None  # (data-parallel size, accumulation) of the newest stream
        self._changing = threading.Lock()  # serializes topology changes: retire and hand over, then new streams
        self._change_started: float | None = None  # when the latest change's first hello arrived
        self._change_max = 0.0  # the slowest stream of that change to its first batch
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
        bound = os.lstat(path)
        self._bound = (bound.st_dev, bound.st_ino)  # stop() removes this socket file, never what replaced it
        self._listener = listener
        if self.config.metrics_port is not None:
            from ._metrics import start_metrics_server

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
            try:  # close() alone does not wake the thread blocked in accept()
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
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
        _remove_own_socket(Path(self.config.socket), self._bound)

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
        idle, frame = self.config.idle_timeout_s, self.config.frame_timeout_s
        waiting, first = frame, True  # a new connection says what it wants at once (hello, metrics); then it may pause
        try:
            sock.settimeout(frame)  # a request begun must arrive whole, a reply be taken, within frame_timeout_s
            while not self._stopping.is_set():
                if not _readable(sock, waiting):
                    connection.timed_out = True
                    what = "sent no request" if first else "was idle"
                    _refuse(sock, "idle", f"the connection {what} for {waiting:g} s (idle_timeout_s / frame_timeout_s "
                                          "in the service config); connect again to go on")
                    return
                try:
                    message, _ = receive(sock, MAX_REQUEST_BYTES)
                except TimeoutError:
                    connection.timed_out = True
                    _refuse(sock, "idle", f"a request was not sent whole within {frame:g} s (frame_timeout_s)")
                    return
                except (EOFError, ConnectionError):
                    return
                except ProtocolError as exc:  # the byte stream may be out of step: answer and hang up
                    _refuse(sock, "protocol", str(exc))
                    return
                waiting, first = idle, False
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
        if op == "length":
            send(connection.sock, {"op": "length", "micro_batches": self._length(message)})
            return True
        if op == "bye":
            connection.said_bye = True
            self._release(connection.token, message.get("release", []))
            self._leave_stream(connection)  # before the reply: a resizing client's next hello finds it gone
            send(connection.sock, {"op": "bye"})
            return False
        raise RequestError("protocol", f"unknown request {op!r}")

    def _length(self, message: dict[str, Any]) -> int:
        """Micro-batches a data-parallel rank at ``state`` receives until its epoch is delivered (``len(FeedClient)``)."""
        dp_world = _int(message, "dp_world_size", 1, _MAX_WORLD)
        accum = _int(message, "grad_accum", 1, _MAX_GRAD_ACCUM)
        if dp_world * accum > self._max_step:
            raise RequestError("topology", f"a step of {dp_world * accum} micro-batches is more than this service deals "
                               f"({self._max_step})")
        try:
            state = feed_state(self.plan, message.get("state"), world_size=dp_world, grad_accum=accum)
        except StateMismatchError as exc:
            raise RequestError("fingerprint", str(exc)) from None
        except (ValueError, TypeError, KeyError, FeedError) as exc:
            raise RequestError("state", f"the client's state is not usable here: {exc}") from None
        return steps_left_in_epoch(self.plan, state["plan"]) * accum - int(state["accum_done"])

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
        group = world // dp_world
        if group > self.config.max_clients:
            raise RequestError("topology", f"world size {world} at data-parallel size {dp_world} makes groups of {group} "
                               f"peers that share a stream, but this service serves {self.config.max_clients} "
                               "connections at most (max_clients in the service config)")
        if dp_world * accum > self._max_step:
            raise RequestError("topology", f"a step at data-parallel size {dp_world} with grad_accum {accum} deals "
                               f"{dp_world * accum} micro-batches, but this service deals at most {self._max_step} "
                               f"per step ({self._max_step_why}); lower the data-parallel size or the accumulation")
        try:
            state = feed_state(self.plan, message.get("state"), world_size=dp_world, grad_accum=accum)
        except StateMismatchError as exc:
            raise RequestError("fingerprint", str(exc)) from None
        except (ValueError, TypeError, KeyError, FeedError) as exc:
            raise RequestError("state", f"the client's state is not usable here: {exc}") from None
        token = message.get("token", f"connection-{connection.id}")
        if not isinstance(token, str) or not 0 < len(token) <= 64:
            raise RequestError("protocol", "hello field 'token' must be a string of 1 to 64 characters")
        for name in ("resume", "attempt"):
            value = message.get(name)
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 64):
                raise RequestError("protocol", f"hello field {name!r} must be a string of 1 to 64 characters")
        key = (dp_world, dp_rank, accum)
        with self._changing:  # a topology change: the old streams hand over before any new stream plans ahead
            with self._lock:
                stream = self._streams.get(key)
                if stream is None or stream.closed:
                    if self._topology != (dp_world, accum):
                        if self._topology is not None:
                            self.resizes += 1
                            self._change_started, self._change_max = time.perf_counter(), 0.0
                            self._handover.clear()  # entries of an earlier change are stale
                        self._topology = (dp_world, accum)
                    retiring = self._stale_streams()
                else:
                    retiring = []
            self._retire(retiring)
            with self._lock:
                stream = self._streams.get(key)
                evicted = None
                if stream is None or stream.closed:
                    if len(self._streams) >= self.config.max_clients:  # streams are bounded as connections are
                        evicted = self._evict_idle_stream()
                    stream = self._streams[key] = Stream(self, key, group, state)
                    stream.resize_started = self._change_started
            if evicted is not None:
                threading.Thread(target=evicted.close, name="omnifeed-evict", daemon=True).start()
        resume = message.get("resume")
        if resume is None and message.get("state") is None:
            resume = "start"  # a job starting from scratch: as if it loaded the plan's first position
        connection.token = token
        since = self._attempt_of(connection, message.get("attempt"), resume, state)
        with stream.cond:
            stream.attach(connection.id, token, rank, state, since, group)
        connection.stream = stream
        return {"op": "welcome", "protocol": PROTOCOL, "client": connection.id, "service": self.instance, "state": state,
                "index_fingerprint": self.plan.index_fingerprint, "config_fingerprint": self.plan.config_fingerprint,
                "num_samples": self.index.num_samples, "batch_size": self.plan.config.batch_size,
                "budget": self.plan.budget, "attempt": since}

    def _next(self, connection: _Connection, message: dict[str, Any]) -> None:
        stream = connection.stream
        if stream is None:
            raise RequestError("protocol", "send hello before asking for batches")
        self._release(connection.token, message.get("release", []))
        ready = stream.take(connection.id, self._stopping)
        segment = ready.segment
        name = (segment.slot, segment.generation)
        fds: list[int] = []
        if segment.slot < 0 or name not in connection.known:
            fds = [segment.fd]
            connection.known.add(name)
        frame = ready.frame
        gone = {known for known in connection.known if known[0] >= 0} - stream.live()
        if gone:  # segments the stream gave up (its peer group shrank): the client lets go of its mappings
            connection.known -= gone
            frame = _forgetting(frame, gone)
        sock = connection.sock
        if fds:
            sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_array(fds))])
            if sent < len(frame):
                sock.sendall(memoryview(frame)[sent:])
        else:
            sock.sendall(frame)

    def _leave_stream(self, connection: _Connection) -> None:
        stream, connection.stream = connection.stream, None
        if stream is None:
            return
        stream.detach(connection.id)
        with self._changing:
            with self._lock:
                retiring = self._stale_streams()
            self._retire(retiring)

    def _release(self, token: str, released: Any) -> None:
        """The client's trainer dropped these batches (numbers are unique in this service, across streams)."""
        if not isinstance(released, list) or len(released) > 4096 or not all(isinstance(s, int) for s in released):
            raise RequestError("protocol", "'release' must be a list of at most 4096 batch numbers")
        if not released:
            return
        wanted = set(released)
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.release(token, wanted)
        self._release_lent(token, wanted)

    def next_seq(self) -> int:
        """A batch number unique in this service process."""
        return next(self._seqs)

    def _disconnect(self, connection: _Connection) -> None:
        with self._lock:
            self._connections.pop(connection.id, None)
        self._left(connection)
        self._leave_stream(connection)
        self._release_lent(connection.token, None)
        try:
            connection.sock.close()
        except OSError:
            pass

    # -- resizes: streams of an old topology hand their prefetched batches over -----------------
    def _stale_streams(self) -> list[Stream]:
        """Client-less streams of another topology than the newest (holding the service lock); removed."""
        stale = [k for k, s in self._streams.items()
                 if (k[0], k[2]) != self._topology and not s.clients and self._topology is not None]
        return [self._streams.pop(k) for k in stale]

    def _evict_idle_stream(self) -> Stream:
        """Make room for a new stream (holding the service lock): the client-less stream idle longest, removed."""
        idle = [(s.idle_since, k) for k, s in self._streams.items() if s.idle_since is not None and not s.clients]
        if not idle:
            raise RequestError("busy", f"the service keeps {self.config.max_clients} streams at most (max_clients) "
                               "and every one has a client")
        return self._streams.pop(min(idle)[1])

    def _retire(self, streams: list[Stream]) -> None:
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

    def record_resize(self, started: float) -> None:
        """A stream of the latest topology served its first batch; the change took until the slowest one's."""
        with self._lock:
            if started != self._change_started:
                return
            seconds = time.perf_counter() - started
            if seconds > self._change_max:
                self.resize_seconds += seconds - self._change_max
                self._change_max = self.last_resize_s = seconds

    # -- batches lent to clients after their stream moved on ---------------------------------
    def lent(self, ready: Ready, stream: Stream) -> None:
        """Keep track of a dropped batch that clients still hold (called holding the stream's lock)."""
        with self._lock:
            self._lent.append((ready, stream))

    def _release_lent(self, token: str, seqs: set[int] | None) -> None:
        with self._lock:
            if not self._lent:
                return
            lent = list(self._lent)
        done = []
        for ready, stream in lent:
            if token in ready.holders and (seqs is None or ready.seq in seqs):
                with stream.cond:
                    ready.holders.discard(token)
                    ready.abandoned = ready.abandoned or seqs is None  # its client left holding it
                    if not ready.holders:
                        stream.recycle(ready)
                        done.append(ready)
        if done:
            with self._lock:
                self._lent = [(r, s) for r, s in self._lent if r not in done]

    # -- audit and metrics -----------------------------------------------------------------
    def _attempt_of(self, connection: _Connection, attempt: str | None, resume: str | None,
                    state: dict[str, Any]) -> str | None:
        """The attempt (a run of the job since it last loaded a checkpoint) whose deliveries this client's are.

        A client that knows its attempt (it reconnects, to this service or a restarted one)
        keeps it. A client that just loaded a checkpoint (``resume``: the digest of the state;
        ``"start"`` for a job starting from scratch) joins the attempt that loaded the same checkpoint, unless a client of that attempt left
        without a goodbye (it crashed or was killed: the job is restarting); else it opens a new
        attempt, and a resume marker is logged: deliveries of earlier attempts from the
        checkpoint's step on were never committed (`verify_coverage` rolls them back).
        """
        with self._audit_lock:
            if attempt is None and resume is not None:
                current = self._attempts.get(resume)
                if current is not None and not current[1]:
                    attempt = current[0]
                else:
                    attempt = f"{resume}-{uuid.uuid4().hex[:8]}"
                    self._attempts[resume] = (attempt, False)
                    self.write_audit({"resume": attempt, "epoch": state["plan"]["epoch"],
                                      "step": state["plan"]["step"], "accum_done": state["accum_done"],
                                      "topology_version": state["plan"]["topology_version"], "keys": []},
                                     locked=True)
            connection.attempt = attempt
        return attempt

    def _left(self, connection: _Connection) -> None:
        """A client of an attempt left without a goodbye: that attempt is over (the next load starts another)."""
        if connection.attempt is None or connection.said_bye or connection.timed_out:
            return
        with self._audit_lock:
            for checkpoint, (attempt, _) in list(self._attempts.items()):
                if attempt == connection.attempt:
                    self._attempts[checkpoint] = (attempt, True)

    def write_audit(self, record: dict[str, Any], locked: bool = False) -> None:
        """Append one delivery record to the audit log (if configured); ``locked``: the caller holds its lock."""
        if not locked:
            with self._audit_lock:
                self.write_audit(record, locked=True)
            return
        if self._audit is not None:
            self._audit.write(json.dumps(record) + "\n")
            self._audit.flush()

    def metrics(self) -> dict[str, Any]:
        """The metrics snapshot (docs/service.md): engine, caches, storage, clients, streams, segments."""
        with self._lock:
            streams = list(self._streams.values())
        clients = []
        segments = segment_bytes = one_offs = 0
        for stream in streams:
            count, nbytes = stream.segments()
            segments, segment_bytes, one_offs = segments + count, segment_bytes + nbytes, one_offs + stream.one_offs
            with stream.cond:
                for attached in stream.clients.values():
                    clients.append({"client": str(attached.client), "rank": attached.rank, "dp_rank": stream.key[1],
                                    "dp_world_size": stream.key[0], "batches": attached.batches,
                                    "waited_s": attached.waited_s, "last_wait_s": attached.last_wait_s})
        snapshot = self.feed_metrics.snapshot(self.pools.buffers())
        return {
            "service": {"uptime_s": time.monotonic() - self._started, "protocol": PROTOCOL,
                        "index_fingerprint": self.plan.index_fingerprint, "clients": len(clients),
                        "streams": len(streams), "segments": segments, "segment_bytes": segment_bytes,
                        "one_off_segments": one_offs},
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


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has bytes (or an end, or an error) to read within ``timeout`` seconds."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, int(timeout * 1000))))


def _epoch_micro_batches(plan: Plan) -> tuple[int, str]:
    """The most micro-batches an epoch of ``plan`` deals, and in words."""
    n = plan.num_samples
    if plan.bucketing is None:
        batch = plan.config.batch_size
        count = -(-(n - plan.dropped_per_epoch) // batch)
        return count, f"{count} micro-batches ({n} samples in batches of {batch})"
    return n, f"at most {n} micro-batches (one per sample)"


def _forgetting(frame: bytes, gone: set[tuple[int, int]]) -> bytes:
    """A batch frame that also names segments the client may unmap (``forget``: ``[slot, generation]`` pairs)."""
    message = decode(frame[4:], msgpack.ExtType)  # tensor references stay as they are
    message["forget"] = [list(name) for name in sorted(gone)]
    return encode(message)


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
    """Create ``path`` with mode 0700 (atomically), or check that it is this user's real directory, closed to others.

    ``lstat``, never ``stat``: a link at ``path`` is refused wherever it points (another user
    could re-point it after the check). A directory that already exists is never chmod-ed.
    """
    from ._protocol import describe_uid

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    mode = stat.S_IMODE(info.st_mode)
    choose = ("choose a socket path in a private directory of your own (omnifeed serve --socket, or `socket:` in the "
              "config; the default $TMPDIR/omnifeed-$UID is created 0700)")
    if stat.S_ISLNK(info.st_mode):
        raise OmnifeedError(f"socket directory {path} is a symbolic link (to {os.readlink(path)}, owned by "
                            f"{describe_uid(info.st_uid)}); {choose}")
    if not stat.S_ISDIR(info.st_mode):
        raise OmnifeedError(f"socket directory {path} is not a directory; {choose}")
    if info.st_uid != os.getuid():
        raise OmnifeedError(f"socket directory {path} belongs to {describe_uid(info.st_uid)}, not to this user "
                            f"({describe_uid(os.getuid())}): that user could replace the socket; {choose}")
    if mode & 0o077:
        raise OmnifeedError(f"socket directory {path} is open to other users (mode {mode:o}); {choose}")


def _reap_stale_socket(path: Path) -> None:
    """Remove a socket left by a crashed service; refuse to start beside a live one (never follows a link)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
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


def _remove_own_socket(path: Path, bound: tuple[int, int] | None) -> None:
    """Unlink the socket this service bound at ``path``; a refused start, or a file put there since, is left alone."""
    if bound is None:
        return
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    if (found.st_dev, found.st_ino) == bound:
        path.unlink()
