"""One client connection of the service: reading its requests within the timeouts, sending its batches.

A new connection must send its first request within ``frame_timeout_s``; later it may pause
up to ``idle_timeout_s`` between requests; a request once begun must arrive whole, and a reply
be taken, within ``frame_timeout_s``. A connection that breaks a rule, or sends something
malformed, gets an error reply and is closed (`refuse`). A batch reply carries a segment's
descriptor (``SCM_RIGHTS``) the first time the connection sees that segment, and names the
segments its stream gave up (``forget``) so the client unmaps them.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ._protocol import MAX_REQUEST_BYTES, ProtocolError, RequestError, decode, encode, receive, send, send_frame
from ._stream import Ready, Stream


@dataclass(eq=False)
class Connection:
    """One client connection: its socket, who it is, the segments it has mapped."""

    id: int
    sock: socket.socket
    stream: Stream | None = None
    known: set[tuple[int, int]] = field(default_factory=set)
    token: str = ""  # the client's own id, the same across its reconnections
    attempt: str | None = None  # the attempt its deliveries belong to (`AttemptLog.join`)
    said_bye: bool = False
    timed_out: bool = False  # closed by the service for idling: not a client that crashed

    def serve(
        self,
        handle: Callable[[dict[str, Any]], bool],
        stopping: threading.Event,
        idle_timeout: float,
        frame_timeout: float,
    ) -> None:
        """Read requests and ``handle`` each until it returns False, the client goes, a rule is broken (an error
        reply, then the socket is closed) or ``stopping`` is set. `RequestError` from ``handle`` is answered too."""
        sock = self.sock
        waiting, first = frame_timeout, True  # a new connection says what it wants at once; then it may pause
        try:
            sock.settimeout(frame_timeout)  # a request begun must arrive whole, a reply be taken, within it
            while not stopping.is_set():
                if not _readable(sock, waiting):
                    self.timed_out = True
                    what = "sent no request" if first else "was idle"
                    refuse(
                        sock,
                        "idle",
                        f"the connection {what} for {waiting:g} s (idle_timeout_s / frame_timeout_s "
                        "in the service config); connect again to go on",
                    )
                    return
                try:  # a deadline for the whole request, not each read: a byte every few seconds is no request
                    try:
                        message, _ = receive(sock, MAX_REQUEST_BYTES, deadline=time.monotonic() + frame_timeout)
                    finally:
                        sock.settimeout(
                            frame_timeout
                        )  # for the reply (the deadline left the socket's at what remained)
                except TimeoutError:
                    self.timed_out = True
                    refuse(sock, "idle", f"a request was not sent whole within {frame_timeout:g} s (frame_timeout_s)")
                    return
                except (EOFError, ConnectionError):
                    return
                except ProtocolError as exc:  # the byte stream may be out of step: answer and hang up
                    refuse(sock, "protocol", str(exc))
                    return
                waiting, first = idle_timeout, False
                try:
                    if not handle(message):
                        return
                except RequestError as exc:
                    refuse(sock, exc.code, str(exc))
                    return
        except OSError:
            return

    def send_batch(self, ready: Ready, live: Callable[[], set[tuple[int, int]]]) -> None:
        """Send ``ready``'s frame; its segment's descriptor the first time; ``forget`` for the known segments that are
        not ``live()`` (its stream's) any more."""
        segment = ready.segment
        name = (segment.slot, segment.generation)
        fds: list[int] = []
        if segment.slot < 0 or name not in self.known:
            fds = [segment.fd]
            self.known.add(name)
        frame = ready.frame
        gone = {known for known in self.known if known[0] >= 0} - live()
        if gone:  # segments the stream gave up (its peer group shrank): the client lets go of its mappings
            self.known -= gone
            frame = _forgetting(frame, gone)
        send_frame(self.sock, frame, fds)

    def close(self) -> None:
        """Close the socket (idempotent)."""
        try:
            self.sock.close()
        except OSError:
            pass


def refuse(sock: socket.socket, code: str, message: str) -> None:
    """Send an error reply of kind ``code`` (if the socket still takes it) and close ``sock``."""
    try:
        send(sock, {"op": "error", "code": code, "message": message})
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has bytes (or an end, or an error) to read within ``timeout`` seconds."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, int(timeout * 1000))))


def _forgetting(frame: bytes, gone: set[tuple[int, int]]) -> bytes:
    """A batch frame that also names segments the client may unmap (``forget``: ``[slot, generation]`` pairs)."""
    message = decode(frame[4:], msgpack.ExtType)  # tensor references stay as they are
    message["forget"] = [list(name) for name in sorted(gone)]
    return encode(message)
