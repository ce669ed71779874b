"""`FeedService`: the feed engine behind a Unix socket, one per node, shared by every trainer rank on it.

::

    client ──hello(rank, dp rank/size, accumulation, its own cursor)──▶ a stream per (dp size, dp rank, accumulation)
           ◀──welcome(fingerprints, where it continues)──
           ──next(released batches)──▶ the batch whose start is the client's cursor
           ◀──batch(header; a segment's descriptor the first time)── tensors are views of shared memory

Each stream's batches are made by its `Feed` in a producer process of its own (``producers:
processes``, what ``auto`` means without Ray), or in this process on one `DecodeEngine` (field
reader: cache tiers, I/O threads, decoders; decode workers) every stream shares (``threads``).
Each client holds its own cursor (the feed state after the last batch it yielded), so a
restarted service, or a restarted stream, continues every client exactly where it was.

`FeedService` composes small owners, each with one job::

    FeedService ── Listener          (_listener)   the socket's directory, stale sockets, its own socket file
                ├─ Connection*       (_connection) one client: requests within the timeouts, batch replies
                ├─ Handshake         (_handshake)  a hello checked against the plan and bounds → Hello
                ├─ StreamTable       (_streams)    streams by key, topology changes (Resizes), idle streams
                │    └─ Stream*      (_stream)     one dp rank's batches; gets a StreamContext, never the service
                │         └─ Producer (_producer)  its Feed in a producer process, or here on the shared engine
                ├─ BatchLedger       (_ledger)     batches handed over from retired streams, batches lent out
                └─ AttemptLog        (_attempts)   attempts by checkpoint, resume markers, the audit log

Faults: a malformed, oversized or unknown message gets an error reply and that connection
closes; the service and other clients go on. A client that dies releases its batches (its
segments are reused); segments are ``memfd`` files, so nothing outlives the processes.
"""

from __future__ import annotations

import array
import fcntl
import itertools
import logging
import multiprocessing
import select
import socket
import sys
import termios
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..feed import DealtSteps, DecodeEngine, FeedPosition, SharedResources, open_feed_index
from ..plan import Plan
from ._attempts import AttemptLog
from ._config import ServiceConfig
from ._connection import Connection, refuse
from ._handshake import Handshake
from ._ledger import BatchLedger
from ._listener import Listener
from ._placement import CpuWindows, decode_on_windows
from ._producer import ChildProducer, FeedProducer, Producer, ProducerSpec
from ._producer_metrics import ProducerMetrics
from ._protocol import PROTOCOL, RequestError, send
from ._stream import Stream, StreamContext
from ._streams import Key, Resizes, StreamTable

log = logging.getLogger("omnifeed.service")


class FeedService:
    """The node's feed service: streams for its clients, shared decode workers and caches, a control socket."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.producer_processes = _producer_processes(config)  # before anything is built: it may refuse
        self.attempts = AttemptLog(config.audit_log)
        # producers on CPU windows decode on one thread a CPU, unless the feed config chose its own workers
        self._decode_on_windows = config.producer_cpus == "split" and not (
            {"pools", "shared_workers"} & config.feed.model_fields_set
        )
        self.index = open_feed_index(config.index, config.feed)  # one index, or a mixture's sources
        # the decoder tokenizes as the index counted (refused at start when set otherwise)
        self.engine = engine = DecodeEngine.build(self.index, config.feed, on_error=_pool_error)
        self.config = config = config.model_copy(update={"feed": engine.config})
        try:
            self.plan = Plan.from_index(self.index, config.feed.plan)
            self.handshake = Handshake(self.plan, config)
        except BaseException:
            engine.close()
            raise
        self.feed_metrics, self.reader = engine.metrics, engine.reader
        assert engine.pools is not None
        self.pools = engine.pools
        self.ledger = BatchLedger(self.index)
        self._producer_metrics = ProducerMetrics()  # of the producer processes, live and closed (producers: processes)
        self._resizes = Resizes()
        self.dealt = DealtSteps(self.plan)  # each step dealt once for every stream
        shared = engine.shared(self.plan, self.ledger.take, self.dealt)
        context = StreamContext(
            self._producer_factory(shared),
            config.prefetch_batches,
            next_seq=itertools.count().__next__,
            record_resize=self._resizes.record,
            audit=self.attempts.write,
            lend=self.ledger.lend,
        )
        self.streams = StreamTable(
            context, self.ledger, self._resizes, config.max_clients, config.max_micro_batches_dealt
        )
        self._lock = threading.Lock()
        self._connections: dict[int, Connection] = {}
        self._next_id = 1
        self.instance = uuid.uuid4().hex  # clients tell services apart by it (batch numbers are per instance)
        self._stopping = threading.Event()
        self._started = time.monotonic()
        self._listener: Listener | None = None
        self._threads: list[threading.Thread] = []
        self._client_threads: list[threading.Thread] = []  # one a connection (those that ended are dropped)
        self._metrics_server: Any = None
        self.metrics_port: int | None = None
        self._switch_interval: float | None = None  # the process's before start() set the service's

    def _producer_factory(self, shared: SharedResources) -> Callable[[Key, FeedPosition], Producer]:
        """How each stream's batches are made (``config.producers``): here, on ``shared``, or in a process each."""
        index, config = self.index, self.config
        if not self.producer_processes:
            return lambda key, start: FeedProducer(index, config.feed, shared, key, start)
        where = None if config.index is None else str(Path(config.index).resolve())
        feed_json = (decode_on_windows(config.feed) if self._decode_on_windows else config.feed).model_dump_json()
        ledger = self.ledger
        counted = self._producer_metrics
        placement = CpuWindows() if config.producer_cpus == "split" else None
        return lambda key, start: ChildProducer(
            ProducerSpec(where, feed_json, key), counted, ledger, placement
        ).start_at(start)

    @property
    def address(self) -> str:
        """The socket path clients connect to."""
        return self.config.socket

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Listen (reaping a crashed predecessor's socket), start the metrics endpoint and the housekeeping thread."""
        self._listener = Listener(Path(self.config.socket))
        if self.config.switch_interval_s is not None:  # process-wide: restored by stop()
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.config.switch_interval_s)
        if self.config.metrics_port is not None:
            from ._metrics import start_metrics_server

            self._metrics_server, self.metrics_port = start_metrics_server(
                self.metrics, self.config.metrics_port, self.config.metrics_host
            )
        for target, name in ((self._accept, "omnifeed-accept"), (self._housekeep, "omnifeed-housekeeping")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("serving %s at %s", self.config.index, self.config.socket)

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
        for connection in connections:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.streams.close()
        for thread in self._threads:  # the accept thread first: no client thread starts after it
            thread.join(timeout=10)
        with self._lock:
            clients = [t for t in self._client_threads if t is not threading.current_thread()]
        # Joined, not left as daemons (see StreamTable.close); a client leaving meanwhile may retire its stream, and a
        # hello in flight may open one: the second close ends those.
        for thread in clients:
            thread.join(timeout=10)
        self.streams.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.engine.close()
        self.ledger.close()
        self.attempts.close()
        if self._listener is not None:
            self._listener.remove()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)

    def __enter__(self) -> FeedService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if len(self._connections) >= self.config.max_clients:
                    refuse(sock, "busy", f"the service serves {self.config.max_clients} connections at most")
                    continue
                connection = Connection(self._next_id, sock)
                self._next_id += 1
                self._connections[connection.id] = connection
                thread = threading.Thread(
                    target=self._serve, args=(connection,), name=f"omnifeed-client-{connection.id}", daemon=True
                )
                thread.start()
                self._client_threads = [t for t in self._client_threads if t.is_alive()] + [thread]

    def _housekeep(self) -> None:
        """Close streams that had no client for ``stream_idle_s``."""
        while not self._stopping.wait(min(1.0, max(self.config.stream_idle_s, 0.05))):
            self.streams.close_idle(self.config.stream_idle_s)

    # -- one connection --------------------------------------------------------------------
    def _serve(self, connection: Connection) -> None:
        try:
            connection.serve(
                lambda message: self._handle(connection, message),
                self._stopping,
                self.config.idle_timeout_s,
                self.config.frame_timeout_s,
            )
        finally:
            self._disconnect(connection)

    def _handle(self, connection: Connection, message: dict[str, Any]) -> bool:
        """Answer one request; False: the connection ends (``bye``)."""
        op = message["op"]
        if op == "metrics":
            send(connection.sock, {"op": "metrics", "snapshot": self.metrics()})
        elif op == "hello":
            if connection.stream is not None:
                raise RequestError("protocol", "hello was already sent on this connection")
            send(connection.sock, self._hello(connection, message))
        elif op == "next":
            stream = connection.stream
            if stream is None:
                raise RequestError("protocol", "send hello before asking for batches")
            self._release(connection.token, message.get("release", []))
            connection.send_batch(stream.take(connection.id, self._stopping), stream.live)
        elif op == "length":
            send(connection.sock, {"op": "length", "micro_batches": self.handshake.length(message)})
        elif op == "bye":
            connection.said_bye = True
            self._give_back(connection, message.get("returned", []))  # before the release: the batches are kept
            self._release(connection.token, message.get("release", []))
            self._leave_stream(connection)  # before the reply: a resizing client's next hello finds it gone
            send(connection.sock, {"op": "bye"})
            return False
        else:
            raise RequestError("protocol", f"unknown request {op!r}")
        return True

    def _hello(self, connection: Connection, message: dict[str, Any]) -> dict[str, Any]:
        hello = self.handshake.hello(message, f"connection-{connection.id}")
        connection.token = hello.token
        if hello.attempt is None and hello.resume is not None:
            self._record_gone_clients()
        since = self.attempts.join(
            hello.attempt, hello.resume, hello.position, lambda: self._running_attempts(connection)
        )

        def attach(stream: Stream) -> None:
            stream.attach(connection.id, hello.token, hello.rank, hello.position, since, hello.group)

        connection.stream = self.streams.open(hello.key, hello.group, hello.position, attach)
        connection.attempt = since  # only now: a hello refused (busy, position) is no crash of the attempt
        return {
            "op": "welcome",
            "protocol": PROTOCOL,
            "client": connection.id,
            "service": self.instance,
            "state": hello.position.to_dict(),
            "index_fingerprint": self.plan.index_fingerprint,
            "config_fingerprint": self.plan.config_fingerprint,
            "num_samples": self.index.num_samples,
            "batch_size": self.plan.config.batch_size,
            "budget": self.plan.budget,
            "attempt": since,
        }

    def _release(self, token: str, released: Any) -> None:
        """The client's trainer dropped these batches (numbers are unique in this service, across streams)."""
        wanted = _batch_numbers(released, "release")
        if not wanted:
            return
        for stream in self.streams.streams():
            stream.release(token, wanted)
        self.ledger.release(token, wanted)

    def _give_back(self, connection: Connection, returned: Any) -> None:
        """The client received these batches ahead and its trainer never had them: their deliveries are taken back."""
        seqs = _batch_numbers(returned, "returned")
        if seqs and connection.stream is not None:
            connection.stream.give_back(connection.id, seqs)
            self.ledger.give_back(connection.id, seqs)

    def _leave_stream(self, connection: Connection) -> None:
        stream, connection.stream = connection.stream, None
        if stream is not None:
            self.streams.leave(stream, connection.id)

    def _record_gone_clients(self) -> None:
        """Crashes the connection threads have not seen yet: a client whose process died (its socket at end of file).

        A restarted rank can say hello before the thread of its killed predecessor reads the end of
        file; without this it would join the attempt that is over, and a peer joining after the
        crash is recorded would open a new one that rolls the first rank's deliveries back.
        """
        with self._lock:
            connections = list(self._connections.values())
        for other in connections:
            # peer_gone first, the flags after: a client that says bye (a resize) closes only once the reply to its
            # bye is sent, which is after said_bye is set; read the other way round, a bye landing between the two
            # reads looks like a crash, and a peer joining later opens a new attempt that rolls this one back
            if other.attempt is not None and peer_gone(other.sock) and not (other.said_bye or other.timed_out):
                self.attempts.crashed(other.attempt)

    def _running_attempts(self, connection: Connection) -> set[str]:
        """The attempts of the other connected clients (whose process is alive)."""
        with self._lock:
            connections = [c for c in self._connections.values() if c is not connection]
        return {c.attempt for c in connections if c.attempt is not None and not peer_gone(c.sock)}

    def _disconnect(self, connection: Connection) -> None:
        with self._lock:
            self._connections.pop(connection.id, None)
        if connection.attempt is not None and not (connection.said_bye or connection.timed_out):
            self.attempts.crashed(connection.attempt)  # it crashed or was killed: the job is restarting
        self._leave_stream(connection)
        self.ledger.release(connection.token, None)
        connection.close()

    # -- metrics ---------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """The metrics snapshot (docs/service.md): engine, caches, storage, clients, streams, segments."""
        streams = self.streams.snapshot()
        clients = streams.pop("clients")
        return {
            "service": {
                "uptime_s": time.monotonic() - self._started,
                "protocol": PROTOCOL,
                "index_fingerprint": self.plan.index_fingerprint,
                "clients": len(clients),
                **streams,
            },
            **self._engine_metrics(),
            "clients": clients,
            "resizes": self._resizes.count,
            "resize_seconds": self._resizes.seconds,
            "last_resize_s": self._resizes.last_s,
            "handed_over": self.ledger.handed_over,
            **({"remote": self.reader.remote.snapshot()} if self.reader.remote is not None else {}),
        }

    def _engine_metrics(self) -> dict[str, Any]:
        """The decode engine's part of the metrics: the service's, with its streams' producer processes' summed in."""
        return self._producer_metrics.merged_with(self.engine.snapshot(self.pools.buffers()))


def _producer_processes(config: ServiceConfig) -> bool:
    """Whether the streams make their batches in producer processes: as ``config`` says, but a daemonic process (a
    multiprocessing ``daemon``) cannot start any — ``auto`` then decodes in threads, ``processes`` is refused."""
    if not config.producer_processes or not multiprocessing.current_process().daemon:
        return config.producer_processes
    if config.producers == "processes":
        raise ValueError(
            "producers: processes cannot start producer processes from a daemonic process (multiprocessing "
            "daemon=True); set producers: threads or auto, or run the service in a process that is not a daemon"
        )
    log.info("the service runs in a daemonic process, which cannot start producer processes: its streams use threads")
    return False


def _batch_numbers(numbers: Any, field: str) -> set[int]:
    """A request's list of batch numbers, checked (`RequestError` ``protocol``)."""
    if not isinstance(numbers, list) or len(numbers) > 4096 or not all(isinstance(s, int) for s in numbers):
        raise RequestError("protocol", f"{field!r} must be a list of at most 4096 batch numbers")
    return set(numbers)


def _pool_error(exc: BaseException) -> None:
    log.error("a decode worker failed: %s: %s", type(exc).__name__, exc)


def peer_gone(sock: socket.socket) -> bool:
    """Whether the other end of a connected socket has closed it (end of file, or reset) with nothing left unread.

    Never waits and never reads: ``poll`` for the hang-up and ``FIONREAD`` for unread bytes. (A
    peek with ``recv`` waited up to the socket's timeout when the connection's own thread read the
    request between the poll and the peek, and that wait's timeout read as a crash.)
    """
    try:
        fd = sock.fileno()
        if fd < 0:
            return True  # already closed by its own thread
        poller = select.poll()
        poller.register(fd, select.POLLRDHUP)
        hung_up = any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))
        if not hung_up:
            return False
        unread = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, unread)
        return unread[0] == 0  # a request still unread comes first (a bye among them is not a crash)
    except (OSError, ValueError):  # reset, or closed by its own thread meanwhile
        return True
