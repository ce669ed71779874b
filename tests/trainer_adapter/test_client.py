"""FeedClient against a real `omnifeed serve` process: exactly-once, resume, reconnect after kill -9, TP peers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from feed_service import ServiceProcess, short_socket_dir, write_config

from omnifeed.loader import Feed, FeedConfig, PlanConfig, SampleIndex, read_delivery_logs, verify_coverage
from omnifeed.loader.service._config import ServiceConfig
from omnifeed.loader.service._protocol import ServiceError, ServiceUnavailableError, request_metrics
from omnifeed.loader.service._server import FeedService
from omnifeed.trainer_adapter import FeedClient

_CLIENT = """
import json, sys
from omnifeed.trainer_adapter import FeedClient
address, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dp_world = int(sys.argv[4]) if len(sys.argv) > 4 else world
group = world // dp_world
with FeedClient(address, rank=rank, world_size=world, dp_rank=rank // group, dp_world_size=dp_world) as client:
    for batch in client:
        total = int(batch["image"]["pixels"].sum()) if "image" in batch else 0
        print(json.dumps({"keys": batch["__key__"], "sum": total}), flush=True)
"""


def feed_config() -> FeedConfig:
    return FeedConfig(plan=PlanConfig(seed=3, batch_size=4))


def planned_keys(index_dir: Path, world: int, rank: int, epochs: int = 1) -> list[list[str]]:
    with Feed(index_dir, feed_config(), world_size=world, rank=rank) as feed:
        return [batch["__key__"] for _ in range(epochs) for batch in feed]


def start_service(index_dir: Path, folder: Path) -> ServiceProcess:
    """`omnifeed serve` of ``index_dir`` (audit log ``folder/audit.jsonl``; idle streams close at once)."""
    socket = short_socket_dir() / "feed.sock"
    config = write_config(folder, index_dir, socket=socket, audit_log=folder / "audit.jsonl", stream_idle_s=0)
    return ServiceProcess(config, socket).start()


@pytest.fixture()
def own_service(index_dir: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A service for this test alone (its audit log must hold this test's deliveries only)."""
    process = start_service(index_dir, tmp_path)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def shared_service(index_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One service for the tests that neither kill it nor read its audit log (starting one costs seconds)."""
    process = start_service(index_dir, tmp_path_factory.mktemp("client-service"))
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture()
def service(shared_service: ServiceProcess):  # type: ignore[no-untyped-def]
    """The shared service, idle: no client and no stream of an earlier test left (fresh clients see a fresh service)."""
    wait_idle(shared_service)
    yield shared_service
    assert shared_service.process is not None and shared_service.process.poll() is None, shared_service.output()


def wait_idle(service: ServiceProcess, timeout: float = 30.0) -> None:
    """Wait until the service has no client, stream or segment left (its idle streams close at once)."""
    deadline = time.monotonic() + timeout
    while True:
        snapshot = request_metrics(str(service.socket))["service"]
        if snapshot["clients"] == snapshot["streams"] == snapshot["segments"] == 0:
            return
        assert time.monotonic() < deadline, f"the shared service did not go idle: {snapshot}"
        time.sleep(0.05)


def run_client(address: Path, rank: int, world: int, dp_world: int | None = None) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", _CLIENT, str(address), str(rank), str(world)]
    if dp_world is not None:
        args.append(str(dp_world))
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process: subprocess.Popen[str]) -> list[dict]:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_two_client_processes_deliver_an_epoch_exactly_once(
    own_service: ServiceProcess, index_dir: Path, tmp_path: Path
) -> None:
    clients = [run_client(own_service.socket, rank, 2) for rank in range(2)]
    results = [finished(c) for c in clients]
    for rank, lines in enumerate(results):
        assert [line["keys"] for line in lines] == planned_keys(index_dir, 2, rank)
    own_service.stop()
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([tmp_path / "audit.jsonl"]))
    assert report.ok, report.to_json()


def test_tensor_parallel_peers_get_identical_batches_read_and_decoded_once(index_dir: Path, tmp_path: Path) -> None:
    socket = short_socket_dir() / "feed.sock"
    shallow = {"plan": {"seed": 3, "batch_size": 4}, "prefetch_steps": 1}  # little read-ahead: counts stay exact
    config = write_config(tmp_path, index_dir, socket=socket, feed=shallow, prefetch_batches=1)
    service = ServiceProcess(config, socket).start()
    try:
        peers = [run_client(socket, rank, 2, dp_world=1) for rank in range(2)]
        first, second = (finished(p) for p in peers)
        snapshot = request_metrics(str(socket))
    finally:
        service.stop()
    assert first == second  # same keys, same pixel sums
    assert [line["keys"] for line in first] == planned_keys(index_dir, 1, 0)
    with Feed(index_dir, FeedConfig(**shallow)) as reference:
        for _ in reference:
            pass
        once = reference.metrics()["modalities"]
    # Read and decoded once: what one in-process feed decodes for the epoch, plus the stream's one batch ahead,
    # its pipeline's one step ahead and the batch each client receives ahead (a second decode per peer would double
    # the counts).
    ahead = 3 * 4
    for modality in ("image", "text", "audio", "video"):
        assert (
            once[modality]["decoded"]
            <= snapshot["modalities"][modality]["decoded"]
            <= once[modality]["decoded"] + ahead
        )


def test_the_service_killed_mid_epoch_costs_a_wait_not_a_sample(index_dir: Path, tmp_path: Path) -> None:
    socket = short_socket_dir() / "feed.sock"
    audit = tmp_path / "audit.jsonl"
    config = write_config(tmp_path, index_dir, socket=socket, audit_log=audit)
    first = ServiceProcess(config, socket).start()
    second = ServiceProcess(config, socket)
    keys = []
    with FeedClient(str(socket), rank=0, world_size=1, reconnect_timeout_s=120) as client:
        batches = iter(client)
        for _ in range(4):
            keys.append(next(batches)["__key__"])
        first.kill()  # its socket file stays behind, as after a crash
        restart = threading.Timer(1.0, second.start)
        restart.start()
        keys.extend(batch["__key__"] for batch in batches)
        restart.join()
        assert client.reconnects >= 1
    try:
        assert keys == planned_keys(index_dir, 1, 0)
        second.stop()
        report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([audit]))
        assert report.ok, report.to_json()
    finally:
        second.stop()


def test_a_saved_client_state_resumes_exactly_with_a_new_client(service: ServiceProcess, index_dir: Path) -> None:
    expected = planned_keys(index_dir, 2, 1, epochs=2)
    with FeedClient(str(service.socket), rank=1, world_size=2) as client:
        it = iter(client)
        seen = [next(it)["__key__"] for _ in range(3)]
        state = client.state_dict()
    json.dumps(state)  # a checkpoint can hold it as JSON
    with FeedClient(str(service.socket), rank=1, world_size=2) as resumed:
        resumed.load_state_dict(state)
        seen += [b["__key__"] for b in resumed]
        seen += [b["__key__"] for b in resumed]  # the next epoch
    assert seen == expected


def test_len_is_the_batches_iteration_yields_from_here_through_the_service_and_in_process(
    service: ServiceProcess, index_dir: Path
) -> None:
    expected = len(planned_keys(index_dir, 2, 1))
    config = ServiceConfig(index=str(index_dir), feed=feed_config(), socket=str(service.socket))
    with (
        FeedClient(str(service.socket), rank=1, world_size=2) as remote,
        FeedClient.in_process(config, rank=1, world_size=2) as local,
    ):
        assert len(remote) == len(local) == expected
        batches = iter(remote)
        next(batches), next(batches)
        assert len(remote) == expected - 2
        assert len(list(batches)) == expected - 2


def test_asking_the_length_starts_no_production(own_service: ServiceProcess, index_dir: Path) -> None:
    address = str(own_service.socket)

    def decoded() -> int:
        return sum(m["decoded"] for m in request_metrics(address)["modalities"].values())

    with FeedClient(address, rank=0, world_size=2) as client:
        assert len(client) == len(planned_keys(index_dir, 2, 0))
        snapshot = request_metrics(address)
        assert snapshot["service"]["streams"] == 0 and snapshot["service"]["clients"] == 0, snapshot["service"]
        assert decoded() == 0, "len() made the service decode"
        next(iter(client))  # the first batch is what opens the stream
        assert request_metrics(address)["service"]["streams"] == 1 and decoded() > 0


def test_a_killed_client_leaves_no_segment_and_no_descriptor_behind(service: ServiceProcess) -> None:
    import psutil

    service_process = psutil.Process(service.pid)
    shm_before = set(os.listdir("/dev/shm"))
    baseline = service_process.num_fds()
    client = run_client(service.socket, 0, 1)
    assert client.stdout is not None
    for _ in range(3):
        assert client.stdout.readline()  # it is mid-epoch, holding batches
    assert request_metrics(str(service.socket))["service"]["segments"] > 0
    os.kill(client.pid, signal.SIGKILL)
    client.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        snapshot = request_metrics(str(service.socket))
        idle = snapshot["service"]["segments"] == 0 and snapshot["service"]["clients"] == 0
        if idle and service_process.num_fds() <= baseline:  # (a metrics connection closes asynchronously)
            break
        time.sleep(0.2)
    assert snapshot["service"]["segments"] == 0, snapshot["service"]
    assert service_process.num_fds() <= baseline
    assert {n for n in set(os.listdir("/dev/shm")) - shm_before if "omnifeed" in n} == set()


def test_a_client_of_another_dataset_is_refused_and_the_service_stays_up(
    service: ServiceProcess, index_dir: Path
) -> None:
    with pytest.raises(ServiceError, match="index_fingerprint") as refused:
        FeedClient(str(service.socket), index_fingerprint="0" * 32).next_batch()
    assert refused.value.code == "fingerprint"
    with FeedClient(str(service.socket)) as client:
        assert next(iter(client))["__key__"] == planned_keys(index_dir, 1, 0)[0]


def test_in_process_client_gives_the_services_batches(service: ServiceProcess, index_dir: Path) -> None:
    config = ServiceConfig(index=str(index_dir), feed=feed_config(), socket=str(service.socket))
    with (
        FeedClient.in_process(config, rank=0, world_size=2) as local,
        FeedClient(str(service.socket), rank=0, world_size=2) as remote,
    ):
        for a, b in zip(local, remote):
            assert a["__key__"] == b["__key__"]
            for modality in ("image", "text", "audio", "video"):
                for name, value in a.get(modality, {}).items():
                    if isinstance(value, torch.Tensor):
                        assert torch.equal(value, b[modality][name]), (modality, name)
        assert local.state_dict() == remote.state_dict()


def test_batches_a_client_keeps_stay_intact_while_it_reads_on(service: ServiceProcess, index_dir: Path) -> None:
    with FeedClient(str(service.socket)) as client, Feed(index_dir, feed_config()) as reference:
        kept = list(client)  # holds every batch of the epoch: more than the stream's segments
        for batch, expected in zip(kept, reference):
            assert batch["__key__"] == expected["__key__"]
            if "image" in expected:
                assert torch.equal(batch["image"]["pixels"], expected["image"]["pixels"])


@pytest.mark.timeout(60)  # far below reconnect_timeout_s: a client that never reached a service does not wait for one
@pytest.mark.parametrize("where", ["no socket", "no directory", "a socket nobody serves"])
def test_a_client_without_a_service_fails_soon_with_one_line_naming_the_path_and_the_command(where: str) -> None:
    folder = short_socket_dir()
    address = folder / ("missing" if where == "no directory" else "") / "feed.sock"
    if where == "a socket nobody serves":  # a crashed service's socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
            stale.bind(str(address))
    with pytest.raises(ServiceUnavailableError) as refused:
        FeedClient(str(address), reconnect_timeout_s=300).next_batch()
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"no omnifeed service at {address} (")
    assert f"`omnifeed serve --config SERVICE_YAML --socket {address}`" in message


@pytest.mark.timeout(120)
def test_a_busy_service_is_reported_as_busy(index_dir: Path) -> None:
    config = ServiceConfig(
        index=str(index_dir), feed=feed_config(), socket=str(short_socket_dir() / "feed.sock"), max_clients=1
    )
    with FeedService(config) as running, FeedClient(running.address) as holder:
        assert holder.next_batch()["__key__"]  # holds the one connection served
        with pytest.raises(ServiceUnavailableError) as refused:
            FeedClient(running.address, reconnect_timeout_s=1).next_batch()
    message = str(refused.value)
    assert "busy" in message and "no omnifeed service" not in message and "BrokenPipe" not in message


@pytest.mark.parametrize("receive_ahead", [0, 1, 3])
def test_batches_received_ahead_and_never_yielded_are_not_counted_as_delivered(
    own_service: ServiceProcess, index_dir: Path, tmp_path: Path, receive_ahead: int
) -> None:
    with FeedClient(str(own_service.socket), receive_ahead=receive_ahead) as client:
        epoch = [batch["__key__"] for batch in client]  # then the next epoch's first batches wait, received ahead
        middle = client.state_dict()
        assert client.epoch == 1 and len(client) == len(epoch)
        second = [client.next_batch()["__key__"] for _ in range(2)]
        served(own_service, len(epoch) + 2 + receive_ahead)  # the client holds `receive_ahead` more
        client.load_state_dict(middle)  # a resume gives the batches ahead back: the same two come again
        assert [client.next_batch()["__key__"] for _ in range(2)] == second
    own_service.stop()
    assert epoch == planned_keys(index_dir, 1, 0)
    records = list(read_delivery_logs([tmp_path / "audit.jsonl"]))
    assert verify_coverage(SampleIndex(index_dir), 0, records).ok
    report = verify_coverage(SampleIndex(index_dir), 1, records)  # what the trainer was handed of epoch 1
    assert (report.delivered, report.duplicates) == (4 * 2, 0)
    assert any("returned" in r for r in records) == (receive_ahead > 0)


def served(service: ServiceProcess, batches: int) -> None:
    """Wait until the service has handed its client ``batches`` batches."""
    deadline = time.monotonic() + 60
    while sum(c["batches"] for c in request_metrics(str(service.socket))["clients"]) < batches:
        assert time.monotonic() < deadline, "the client did not receive its batches ahead"
        time.sleep(0.02)


def test_close_ends_a_reconnection_in_progress_on_the_thread_ahead(index_dir: Path, tmp_path: Path) -> None:
    service = start_service(index_dir, tmp_path)
    client = FeedClient(str(service.socket), reconnect_timeout_s=3600)
    client.next_batch()
    service.stop()  # the thread ahead now waits for the service to come back, for up to an hour
    closing = threading.Thread(target=client.close)
    closing.start()
    closing.join(120)
    assert not closing.is_alive()
