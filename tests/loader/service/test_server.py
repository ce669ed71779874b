"""The feed service's socket: malformed input is refused without harm, the socket is private, shutdown is clean."""

from __future__ import annotations

import array
import os
import pickle
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
from feed_service import ServiceProcess, short_socket_dir, write_config

from omnifeed.loader import FeedConfig, OmnifeedError, PlanConfig
from omnifeed.loader.feed import FeedPosition
from omnifeed.loader.service._config import ServiceConfig
from omnifeed.loader.service._protocol import MAX_REQUEST_BYTES, PROTOCOL, receive, request_metrics
from omnifeed.loader.service._server import FeedService
from omnifeed.trainer_adapter import FeedClient


@pytest.fixture(scope="module")
def service(index_dir: Path):  # type: ignore[no-untyped-def]
    config = ServiceConfig(
        index=str(index_dir),
        feed=FeedConfig(plan=PlanConfig(seed=3, batch_size=4)),
        socket=str(short_socket_dir() / "feed.sock"),
    )
    with FeedService(config) as running:
        yield running


def raw(service: FeedService) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(service.address)
    return sock


def reply_to(service: FeedService, frame: bytes, fds: list[int] | None = None) -> dict:
    with raw(service) as sock:
        if fds:
            sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            sock.sendall(frame)
        message, _ = receive(sock, 1 << 20)
        return message


def frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def still_serves(service: FeedService) -> None:
    with FeedClient(service.address) as client:
        assert client.next_batch()["__key__"]


def hello(**fields: object) -> bytes:
    message = {
        "op": "hello",
        "protocol": PROTOCOL,
        "rank": 0,
        "world_size": 1,
        "dp_rank": 0,
        "dp_world_size": 1,
        "grad_accum": 1,
        "state": None,
        **fields,
    }
    return frame(msgpack.packb(message))


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (frame(b"\xc1\xc1\xc1"), "protocol", "malformed"),
        (frame(msgpack.packb([1, 2, 3])), "protocol", "map with a string 'op'"),
        (frame(msgpack.packb({"op": "launch"})), "protocol", "unknown request"),
        (frame(pickle.dumps({"op": "hello"})), "protocol", "malformed"),
        (frame(msgpack.packb({"op": "hello", "x": msgpack.ExtType(1, b"\0" * 8)})), "protocol", "extension"),
        (struct.pack("!I", MAX_REQUEST_BYTES + 1) + b"\0" * 16, "protocol", "over the limit"),
        (hello(protocol=99), "protocol", "protocol version 99"),
        (hello(rank="0"), "protocol", "'rank' must be an integer"),
        (hello(dp_rank=3), "protocol", "'dp_rank'"),
        (hello(grad_accum=10**9), "protocol", "'grad_accum'"),
        (hello(index_fingerprint="f" * 32), "fingerprint", "index_fingerprint"),
        (
            hello(state={"format": "omnifeed.feed-state/1", "plan": {"step": 1}, "accum_done": 0}),
            "state",
            "not a plan state",
        ),
        (frame(msgpack.packb({"op": "next"})), "protocol", "hello"),
    ],
)
def test_a_bad_message_gets_an_error_reply_and_the_service_goes_on(
    service: FeedService, body: bytes, code: str, words: str
) -> None:
    reply = reply_to(service, body)
    assert reply["op"] == "error" and reply["code"] == code, reply
    assert words in reply["message"]
    still_serves(service)


def test_file_descriptors_sent_to_the_service_are_refused_and_closed(service: FeedService, tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("x")
    fd = os.open(path, os.O_RDONLY)
    try:
        reply = reply_to(service, hello(), [fd])
    finally:
        os.close(fd)
    assert reply["code"] == "protocol" and "descriptors" in reply["message"]
    own = set()
    for n in os.listdir(f"/proc/{os.getpid()}/fd"):
        try:
            own.add(os.readlink(f"/proc/{os.getpid()}/fd/{n}"))
        except FileNotFoundError:  # closed meanwhile (by one of the service's connection threads, say)
            pass
    assert str(path) not in own  # the service runs in this process: it kept no copy of the descriptor
    still_serves(service)


def test_a_client_that_disconnects_mid_message_does_not_disturb_others(service: FeedService) -> None:
    with raw(service) as sock:
        sock.sendall(struct.pack("!I", 1000) + b"\x81")  # promises 1000 bytes, sends one, hangs up
    still_serves(service)


def test_the_socket_directory_and_socket_are_private(service: FeedService) -> None:
    path = Path(service.address)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.lstat().st_mode) & 0o077 == 0


def test_the_service_runs_at_its_switch_interval_and_gives_the_process_its_own_back(index_dir: Path) -> None:
    before = sys.getswitchinterval()
    config = ServiceConfig(
        index=str(index_dir),
        feed=FeedConfig(plan=PlanConfig(seed=3, batch_size=4)),
        socket=str(short_socket_dir() / "feed.sock"),
        switch_interval_s=0.0007,
    )
    with FeedService(config):
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    assert sys.getswitchinterval() == before


def test_a_socket_directory_open_to_others_is_refused(index_dir: Path) -> None:
    folder = short_socket_dir()
    folder.chmod(0o755)
    config = ServiceConfig(index=str(index_dir), socket=str(folder / "feed.sock"))
    service = FeedService(config)
    try:
        with pytest.raises(OmnifeedError, match="open to other users"):
            service.start()
    finally:
        service.stop()


def test_a_second_service_on_a_live_socket_is_refused(service: FeedService, index_dir: Path) -> None:
    second = FeedService(ServiceConfig(index=str(index_dir), socket=service.address))
    try:
        with pytest.raises(OmnifeedError, match="already listening"):
            second.start()
    finally:
        second._stopping.set()  # never started: nothing to stop; keep the first one's socket
        second.pools.close()
        second.reader.close()
    still_serves(service)


def test_sigterm_stops_the_service_cleanly_and_a_crashed_ones_socket_is_reaped(index_dir: Path, tmp_path: Path) -> None:
    socket_path = short_socket_dir() / "feed.sock"
    config = write_config(tmp_path, index_dir, socket=socket_path)
    crashed = ServiceProcess(config, socket_path).start()
    crashed.kill()
    assert socket_path.exists()  # left behind by the crash
    service = ServiceProcess(config, socket_path).start()  # reaps it
    with FeedClient(str(socket_path)) as client:
        client.next_batch()
    assert service.stop() == 0
    assert "service stopped" in service.output()
    assert not socket_path.exists()
    with pytest.raises(OSError):
        request_metrics(str(socket_path), timeout=2)


def test_prometheus_and_omnifeed_stats_show_the_running_service(
    index_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from omnifeed.tools._cli import main

    config = ServiceConfig(
        index=str(index_dir),
        feed=FeedConfig(plan=PlanConfig(seed=3, batch_size=4)),
        socket=str(short_socket_dir() / "feed.sock"),
        metrics_port=0,
    )
    # receive_ahead=0: the client asks for exactly the batches its trainer takes, so the service has handed out 3
    with FeedService(config) as service, FeedClient(service.address, rank=0, world_size=1, receive_ahead=0) as client:
        for _ in range(3):
            client.next_batch()
        assert service.metrics_port
        page = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=30).read().decode()
        samples = {s.name: s for family in text_string_to_metric_families(page) for s in family.samples}
        assert samples["omnifeed_samples_total"].value >= 12
        assert samples["omnifeed_service_clients"].value == 1
        assert samples["omnifeed_client_batches_total"].value == 3
        assert main(["stats", "--socket", service.address, "--once"]) == 0
    table = capsys.readouterr().out
    assert "image" in table and "clients 1" in table
    assert table.strip().splitlines()[-1].startswith("clients")  # the verdict line: who waits, and what limits


def test_a_client_whose_process_died_is_seen_gone_before_its_thread_reads_the_end_of_file() -> None:
    import socket as sockets

    from omnifeed.loader.service._server import peer_gone

    ours, theirs = sockets.socketpair()
    ours.settimeout(300)  # as a served connection: a peek must still not wait
    try:
        assert not peer_gone(ours)
        theirs.sendall(b"x")  # a request waiting to be read: alive
        assert not peer_gone(ours)
        theirs.close()  # the process died: the kernel closed its end
        assert not peer_gone(ours)  # the unread request comes first
        ours.recv(1)
        assert peer_gone(ours)
    finally:
        ours.close()


def test_a_live_client_whose_requests_its_thread_reads_meanwhile_is_never_seen_gone() -> None:
    """The look for gone clients races the connection's own thread reading requests: a live client stays alive."""
    import socket as sockets

    from omnifeed.loader.service._server import peer_gone

    ours, theirs = sockets.socketpair()
    ours.settimeout(0.005)  # short: a look that waited for a request its thread had read would time out
    requests = 300

    def client() -> None:  # a request, its reply, a pause (a trainer step), the next request
        for _ in range(requests):
            theirs.sendall(b"x")
            theirs.recv(1)
            time.sleep(0.01)

    def connection_thread() -> None:
        for _ in range(requests):
            while True:
                try:
                    ours.recv(1)
                    break
                except TimeoutError:
                    pass
            ours.sendall(b"y")

    threads = [threading.Thread(target=client), threading.Thread(target=connection_thread)]
    for thread in threads:
        thread.start()
    seen_gone = 0
    try:
        while threads[0].is_alive():
            seen_gone += peer_gone(ours)
    finally:
        for thread in threads:
            thread.join()
        ours.close()
        theirs.close()
    assert seen_gone == 0


def test_a_client_that_says_bye_while_a_peer_says_hello_is_not_taken_for_a_crash(
    index_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resizing rank's bye can complete while a peer's hello looks for gone clients: not a crash."""
    from omnifeed.loader.service import _server
    from omnifeed.loader.service._connection import Connection

    service = FeedService(
        ServiceConfig(
            index=str(index_dir),
            feed=FeedConfig(plan=PlanConfig(seed=3, batch_size=4)),
            socket=str(short_socket_dir() / "feed.sock"),
        )
    )
    ours, theirs = socket.socketpair()
    try:
        at_start = FeedPosition({"epoch": 0, "step": 0, "topology_version": 0})
        attempt = service.attempts.join(None, "checkpoint-digest", at_start)
        leaving = Connection(1, ours, attempt=attempt)
        service._connections[1] = leaving

        def bye_lands_now(sock: socket.socket) -> bool:  # the bye is answered, then the client closes its end
            leaving.said_bye = True
            return True

        monkeypatch.setattr(_server, "peer_gone", bye_lands_now)
        service._record_gone_clients()
        assert service.attempts.join(None, "checkpoint-digest", at_start) == attempt  # still the same attempt
    finally:
        ours.close()
        theirs.close()
        service.stop()
