"""Fuzzing the control protocol: any bytes give a message, a ProtocolError or an EOFError; the service survives."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from feed_service import short_socket_dir
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from omnifeed.loader import FeedConfig, IndexConfig, PlanConfig, build_index
from omnifeed.loader.service._config import ServiceConfig
from omnifeed.loader.service._protocol import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL,
    ProtocolError,
    decode,
    receive,
)
from omnifeed.loader.service._server import FeedService
from omnifeed.trainer_adapter import FeedClient

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)

# msgpack values of every kind, nested: what a confused or hostile peer could send
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = (
    "protocol",
    "rank",
    "world_size",
    "dp_rank",
    "dp_world_size",
    "grad_accum",
    "state",
    "reack",
    "resume",
    "index_fingerprint",
    "config_fingerprint",
    "pid",
    "token",
    "release",
)
HELLO = {
    "op": "hello",
    "protocol": PROTOCOL,
    "rank": 0,
    "world_size": 1,
    "dp_rank": 0,
    "dp_world_size": 1,
    "grad_accum": 1,
    "state": None,
}
# requests that look almost right: a real op, real field names, random values (or a valid hello, one field off)
REQUESTS = st.one_of(
    st.builds(
        lambda op, extra: {"op": op, **extra},
        st.sampled_from(["hello", "next", "metrics", "bye", "launch"]),
        st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5),
    ),
    st.builds(lambda name, value: {**HELLO, name: value}, st.sampled_from(FIELDS), VALUES),
    st.builds(lambda value: {"op": "next", "release": value}, VALUES | st.lists(st.integers(-5, 50), max_size=5)),
    st.dictionaries(st.text(max_size=6), VALUES, max_size=4),
)


def _frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def _decoded_or_protocol_error(body: bytes) -> None:
    try:
        message = decode(body)
    except ProtocolError:
        return
    assert isinstance(message, dict) and isinstance(message["op"], str)


@pytest.mark.timeout(60)
@FUZZ
@given(body=st.binary(max_size=512))
def test_decode_of_any_bytes_gives_a_message_or_a_protocol_error(body: bytes) -> None:
    _decoded_or_protocol_error(body)


@pytest.mark.timeout(60)
@FUZZ
@given(value=VALUES | REQUESTS, cut=st.integers(0, 64), ext=st.booleans())
def test_decode_of_any_msgpack_value_cut_or_whole_gives_a_message_or_a_protocol_error(
    value: Any, cut: int, ext: bool
) -> None:
    body = msgpack.packb(value if not ext else {"op": "x", "t": msgpack.ExtType(1, b"\0" * 8)}, use_bin_type=True)
    _decoded_or_protocol_error(body)
    _decoded_or_protocol_error(body[: max(0, len(body) - cut)])


def test_decode_refuses_deep_nesting_and_huge_declared_lengths() -> None:
    for body in (b"\x91" * 100_000, b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"):
        with pytest.raises(ProtocolError):
            decode(body)


# one chunk of a byte stream: a frame whose length prefix may lie, or raw bytes
CHUNKS = st.one_of(
    st.binary(max_size=64).map(_frame),
    REQUESTS.map(lambda m: _frame(msgpack.packb(m, use_bin_type=True))),
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=64)).map(lambda t: struct.pack("!I", t[0]) + t[1]),
    st.binary(max_size=16),
)


@pytest.mark.timeout(120)
@FUZZ
@given(chunks=st.lists(CHUNKS, max_size=6), limit=st.sampled_from([64, MAX_REQUEST_BYTES]))
def test_receive_over_a_socket_gives_messages_then_a_protocol_error_or_eof(chunks: list[bytes], limit: int) -> None:
    reader, writer = socket.socketpair()
    reader.settimeout(10)  # a lying length prefix ends at EOF, never waits
    data = b"".join(chunks)
    thread = threading.Thread(target=lambda: (writer.sendall(data), writer.shutdown(socket.SHUT_WR)))
    thread.start()
    try:
        for _ in range(len(data) + 1):  # every message consumes at least 5 bytes: this always ends
            try:
                message, fds = receive(reader, limit)
            except (ProtocolError, EOFError):
                break
            assert isinstance(message["op"], str) and fds == []
        else:
            pytest.fail("receive never reached the end of the stream")
    finally:
        thread.join(10)
        reader.close()
        writer.close()


# -- a running service ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[FeedService]:
    out = tmp_path_factory.mktemp("fuzz-service") / "index"
    build_index([str(p) for p in demo_shards], out, IndexConfig(workers=1), progress=False)
    config = ServiceConfig(
        index=str(out),
        feed=FeedConfig(plan=PlanConfig(seed=3, batch_size=4)),
        socket=str(short_socket_dir() / "feed.sock"),
        stream_idle_s=1.0,
    )
    with FeedService(config) as running:
        yield running


@pytest.fixture()
def thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions that escaped any thread (a service thread that died of a request)."""
    errors: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment,misc,arg-type]
    yield errors
    threading.excepthook = previous


def _replies(service: FeedService, data: bytes) -> list[dict[str, Any]]:
    """Send ``data`` on a fresh connection, close the sending side, read every reply until the service hangs up."""
    replies = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(service.address)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the service already refused the stream and hung up
            pass
        while True:
            try:
                reply, fds = receive(sock, MAX_REPLY_BYTES, ext_hook=lambda code, raw: raw, accept_fds=True)
            except (EOFError, ConnectionError):
                return replies
            for fd in fds:
                socket.close(fd)
            replies.append(reply)


def _mutated(value: Any, data: st.DataObject) -> Any:
    """``value`` (a feed state) with one nested entry replaced by a random value."""
    if isinstance(value, dict) and value and data.draw(st.booleans()):
        name = data.draw(st.sampled_from(sorted(value)))
        return {**value, name: _mutated(value[name], data)}
    if isinstance(value, list) and value and data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(value) - 1))
        return [*value[:at], _mutated(value[at], data), *value[at + 1 :]]
    return data.draw(VALUES)


@pytest.mark.timeout(240)
def test_random_frames_get_replies_or_a_hang_up_and_the_service_still_serves(
    service: FeedService, thread_errors: list[BaseException]
) -> None:
    state = _replies(service, _frame(msgpack.packb(HELLO)))[0]["state"]  # a real feed state, to damage

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(chunks=st.lists(CHUNKS, max_size=3), start=st.sampled_from(["none", "hello", "state"]), data=st.data())
    def one_connection(chunks: list[bytes], start: str, data: st.DataObject) -> None:
        first = {"none": [], "hello": [HELLO], "state": [{**HELLO, "state": _mutated(state, data)}]}[start]
        frames = [_frame(msgpack.packb(m, use_bin_type=True)) for m in first] + chunks
        replies = _replies(service, b"".join(frames))
        event("replies: " + " ".join(r["op"] if r["op"] != "error" else r["code"] for r in replies))
        assert all(r["op"] in ("welcome", "batch", "metrics", "bye", "error") for r in replies), replies
        errors = [r for r in replies if r["op"] == "error"]
        assert len(errors) <= 1 and (not errors or errors[0] is replies[-1])  # an error ends the connection
        assert not thread_errors, thread_errors

    one_connection()
    with FeedClient(service.address) as client:
        assert client.next_batch()["__key__"]
