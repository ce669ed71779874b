"""The service's control protocol: length-prefixed msgpack messages over a Unix socket, file descriptors beside them.

A frame is a 4-byte big-endian length and a msgpack map with an ``"op"`` string. File
descriptors (shared-memory segments, service → client only) travel as ``SCM_RIGHTS``
ancillary data with the first bytes of the frame that names them. Nothing is ever
unpickled: msgpack builds only maps, arrays, strings, bytes, numbers, booleans and nil,
and the two extension types (a tensor reference, ``TENSOR_EXT``; a batch's keys as one blob,
``KEYS_EXT``) are accepted only by the client, from the service. Frame sizes are bounded on both sides
(``MAX_REQUEST_BYTES``, ``MAX_REPLY_BYTES``); a larger frame is refused before its body is read.

Requests (client → service): ``hello`` (protocol, who the client is, where it continues),
``next`` (the next batch; releases batches the client no longer holds), ``metrics``, ``bye``.
Replies: ``welcome``, ``batch``, ``metrics``, ``error`` (``code``, ``message``). docs/service.md
lists every field.

A client trusts the service it reaches (it maps the memory the service hands it), so `connect`
checks who that is, before and after connecting: the socket's directory must be a real
directory (``lstat``, not a link) of the user, closed to others, and the listening process must
run as the user (``SO_PEERCRED``), unless a uid is trusted explicitly. Otherwise
`UntrustedServiceError`: another local user could have planted the socket (docs/security.md §1).
"""

from __future__ import annotations

import array
import os
import socket
import stat
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from .._errors import OmnifeedError, describe_uid

PROTOCOL = 3  # 2: batch frames carry a layout and their keys as one blob; 3: a goodbye gives back batches unused
MAX_REQUEST_BYTES = 1 << 20  # client → service: control messages and re-sent audit records
MAX_REPLY_BYTES = 256 << 20  # service → client: batch headers carry strings and meta fields
MAX_FDS = 16
TENSOR_EXT = 1
KEYS_EXT = 2
_LENGTH = struct.Struct("!I")
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * 4)
_CTRUNC = socket.MSG_CTRUNC


class ProtocolError(OmnifeedError):
    """A malformed, oversized or unexpected message on the service socket."""


class UntrustedServiceError(OmnifeedError):
    """The socket's directory or the process listening on it belongs to another user: never retried."""


class ServiceUnavailableError(ConnectionError):
    """A client gave up on reaching its service (nothing listens at the path, or it stayed busy or away)."""


class ServiceError(OmnifeedError):
    """The service answered a request with an error (``code`` says which kind)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RequestError(OmnifeedError):
    """A request the service refuses (its side of `ServiceError`): sent back as an error reply of kind ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def encode(message: dict[str, Any]) -> bytes:
    """One frame: length prefix and msgpack body."""
    body = msgpack.packb(message, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


_NEXT_HEAD = msgpack.packb({"op": "next", "release": []}, use_bin_type=True)[:-1]  # all but the empty list


def next_request(release: list[int]) -> bytes:
    """The frame of a ``next`` request that gives back the batches numbered ``release`` (a client sends one a batch:
    built from a ready-made head, not a dict)."""
    body = _NEXT_HEAD + msgpack.packb(release)
    return _LENGTH.pack(len(body)) + body


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one message (and ``fds`` with its first bytes)."""
    send_frame(sock, encode(message), fds)


def send_frame(sock: socket.socket, frame: bytes, fds: Sequence[int] = ()) -> None:
    """Send one encoded frame (and ``fds`` with its first bytes)."""
    if not fds:
        sock.sendall(frame)
        return
    sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    if sent < len(frame):
        sock.sendall(memoryview(frame)[sent:])


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed here")


def receive(
    sock: socket.socket,
    limit: int,
    ext_hook: Callable[[int, bytes], Any] = _reject_ext,
    accept_fds: bool = False,
    deadline: float | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it; ``EOFError`` when the peer closed the connection.

    Raises ``ProtocolError`` for a frame over ``limit`` bytes, a body that is not a msgpack
    map with a string ``"op"``, or descriptors where none are accepted (they are closed).
    ``deadline`` (``time.monotonic()``): the whole frame must have arrived by then, else
    ``TimeoutError`` (the socket's timeout is left at what remained).
    """
    body, fds = receive_frame(sock, limit, accept_fds, deadline)
    try:
        return decode(body, ext_hook), fds
    except BaseException:
        _close_all(fds)
        raise


def receive_frame(
    sock: socket.socket, limit: int, accept_fds: bool = False, deadline: float | None = None
) -> tuple[bytearray, list[int]]:
    """One frame's body, undecoded, and the descriptors that came with it (see `receive`)."""
    fds: list[int] = []
    try:
        return _receive_frame(sock, limit, accept_fds, deadline, fds)
    except TimeoutError:
        _close_all(fds)
        raise


def _arm(sock: socket.socket, deadline: float | None) -> None:
    """Give the next read what is left until ``deadline``: a byte every few seconds does not make a frame."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the frame's deadline passed")
        sock.settimeout(left)


def _receive_frame(
    sock: socket.socket, limit: int, accept_fds: bool, deadline: float | None, fds: list[int]
) -> tuple[bytearray, list[int]]:
    head = bytearray()
    while len(head) < _LENGTH.size:
        _arm(sock, deadline)
        data, ancillary, flags, _ = sock.recvmsg(_LENGTH.size - len(head), socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                fds.extend(received)
        if not data:
            _close_all(fds)
            raise EOFError("the peer closed the connection")
        head += data
        if flags & socket.MSG_CTRUNC:
            _close_all(fds)
            raise ProtocolError(f"more than {MAX_FDS} file descriptors with one message")
    if fds and not accept_fds:
        _close_all(fds)
        raise ProtocolError("file descriptors are not accepted on this side of the socket")
    (length,) = _LENGTH.unpack(head)
    if length > limit:
        _close_all(fds)
        raise ProtocolError(f"message of {length} bytes is over the limit of {limit} bytes")
    body = bytearray(length)
    view = memoryview(body)
    got = 0
    while got < length:
        _arm(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            _close_all(fds)
            raise EOFError("the peer closed the connection in the middle of a message")
        got += n
    return body, fds


class FrameReader:
    """Reads reply frames into one reused buffer: one ``recvmsg_into`` for a frame that fits (the client's side)."""

    KEPT = 1 << 20  # a larger frame gets a buffer of its own, not kept

    def __init__(self, size: int = 1 << 16) -> None:
        self._buffer = bytearray(size)
        self._view = memoryview(self._buffer)  # made once: a batch's frame is read with one call and few objects

    def receive(self, sock: socket.socket, limit: int) -> tuple[memoryview, list[int]]:
        """One frame's body (a view, valid until the next call) and the descriptors that came with it.

        A reply to a request: bytes after it that nothing asked for are a `ProtocolError`.
        """
        buffer, view = self._buffer, self._view
        got, fds = 0, list[int]()
        while got < _LENGTH.size:
            n, ancillary, flags, _ = sock.recvmsg_into([view[got:] if got else view], _ANCILLARY)
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                    fds.extend(received)
            if flags & _CTRUNC:
                _close_all(fds)
                raise ProtocolError(f"more than {MAX_FDS} file descriptors with one message")
            if not n:
                _close_all(fds)
                raise EOFError("the peer closed the connection")
            got += n
        (length,) = _LENGTH.unpack_from(buffer)
        end = _LENGTH.size + length
        if length > limit or got > end:
            _close_all(fds)
            raise ProtocolError(
                f"message of {length} bytes is over the limit of {limit} bytes"
                if length > limit
                else "bytes after a reply that nothing asked for"
            )
        if end > len(buffer):
            buffer = bytearray(end)
            buffer[:got] = view[:got]
            view = memoryview(buffer)
            if end <= self.KEPT:
                self._buffer, self._view = buffer, view
        while got < end:
            n = sock.recv_into(view[got:end])
            if n == 0:
                _close_all(fds)
                raise EOFError("the peer closed the connection in the middle of a message")
            got += n
        return view[_LENGTH.size : end], fds


def decode(body: bytes | bytearray | memoryview, ext_hook: Callable[[int, bytes], Any] = _reject_ext) -> dict[str, Any]:
    """A frame body as a message: a msgpack map with a string ``"op"``, or ``ProtocolError``."""
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=ext_hook, use_list=True)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ProtocolError(f"malformed message ({type(exc).__name__}: {exc})") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("a message must be a map with a string 'op'")
    return message


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def connect(address: str, timeout: float | None, trusted_uid: int | None = None) -> socket.socket:
    """A connected stream socket to the service at ``address`` (a socket path), checked to be the user's.

    ``trusted_uid``: a service running as this uid is accepted too (its directory may then be
    owned by it and let others traverse it, never write to it). Raises `UntrustedServiceError`
    (see `check_socket_directory`, `check_peer`), or ``OSError`` when nothing listens there
    (``FileNotFoundError`` when the socket or its directory does not exist).
    """
    check_socket_directory(address, trusted_uid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
        check_peer(sock, address, trusted_uid)
    except BaseException:
        sock.close()
        raise
    return sock


_CHOOSE = (
    "choose a socket path in a directory only you can write (the same for `omnifeed serve --socket` and "
    "the client), e.g. $HOME/.omnifeed/feed.sock, which omnifeed serve creates 0700"
)


def check_socket_directory(address: str, trusted_uid: int | None = None) -> None:
    """Refuse a socket whose directory another user could have made or could write to.

    The directory (``lstat``: never through a link) must be a directory owned by this user
    with no group/other permission bits, or owned by ``trusted_uid`` and writable by it alone.
    Raises `UntrustedServiceError`; ``FileNotFoundError`` when the directory does not exist.
    """
    directory = os.path.dirname(os.path.abspath(address))
    info = os.lstat(directory)
    mode = stat.S_IMODE(info.st_mode)
    me = os.getuid()
    if stat.S_ISLNK(info.st_mode):
        problem = (
            f"is a symbolic link (to {os.readlink(directory)}, owned by {describe_uid(info.st_uid)}): it could "
            "be re-pointed after any check"
        )
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid not in (me, trusted_uid):
        problem = (
            f"belongs to {describe_uid(info.st_uid)}, not to this user ({describe_uid(me)}): that user "
            "could run a fake service there"
        )
    elif mode & (0o077 if info.st_uid == me else 0o022):
        problem = f"is open to other users (mode {mode:o}): any of them could replace the socket"
    else:
        return
    raise UntrustedServiceError(
        f"refusing the omnifeed service at {address}: its directory {directory} {problem}; {_CHOOSE}"
    )


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return int(uid)


def check_peer(sock: socket.socket, address: str, trusted_uid: int | None = None) -> None:
    """Refuse a connection whose listening process runs as another user than this one (or ``trusted_uid``)."""
    uid = peer_uid(sock)
    if uid == os.getuid() or (trusted_uid is not None and uid == trusted_uid):
        return
    raise UntrustedServiceError(
        f"refusing the omnifeed service at {address}: the process listening there runs as "
        f"{describe_uid(uid)}, not as this user ({describe_uid(os.getuid())}); {_CHOOSE}, "
        f"or pass trusted_uid={uid} to FeedClient if that user runs your service"
    )


def check_reply(message: dict[str, Any], op: str) -> dict[str, Any]:
    """``message`` if it is the expected reply; raise ``ServiceError`` for an error reply."""
    if message["op"] == "error":
        raise ServiceError(str(message.get("code", "error")), str(message.get("message", "")))
    if message["op"] != op:
        raise ProtocolError(f"expected a {op!r} reply, got {message['op']!r}")
    return message


def request_metrics(address: str, timeout: float = 5.0) -> dict[str, Any]:
    """The metrics snapshot of the service at ``address``."""
    with connect(address, timeout) as sock:
        send(sock, {"op": "metrics", "protocol": PROTOCOL})
        reply, _ = receive(sock, MAX_REPLY_BYTES)
    snapshot = check_reply(reply, "metrics").get("snapshot")
    if not isinstance(snapshot, dict):
        raise ProtocolError("the metrics reply holds no snapshot")
    return snapshot


def wait_until_serving(
    address: str, process: Any = None, timeout: float = 60.0, detail: Callable[[], str] = lambda: ""
) -> None:
    """Block until the service at ``address`` answers a metrics request.

    ``process`` (a ``subprocess.Popen`` running ``omnifeed serve``): RuntimeError as soon as it
    exits; TimeoutError after ``timeout`` seconds. ``detail()`` is appended to either message
    (where the service's output is).
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the service exited with {process.returncode} at start; {detail()}")
        try:
            request_metrics(address, timeout=2.0)
            return
        except (OSError, EOFError):  # not listening yet, or the socket of a service it replaces
            if time.monotonic() > deadline:
                raise TimeoutError(f"the service did not answer within {timeout:.0f} s; {detail()}") from None
            time.sleep(0.05)
