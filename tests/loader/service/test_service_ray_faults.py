"""`omnifeed serve --ray` against a real local Ray cluster, read by a real `FeedClient`: an actor killed, its node
removed or the cluster's head gone mid-epoch, the epoch is still delivered exactly once."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from feed_service import ServiceProcess, short_socket_dir, write_config

from omnifeed.loader import SampleIndex
from omnifeed.loader.plan._audit import read_delivery_logs, verify_coverage
from omnifeed.loader.service._protocol import request_metrics
from omnifeed.trainer_adapter import FeedClient

pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

BATCHES = 12  # the demo epoch: 48 samples, 4 a batch
# Little read-ahead (2 images decoded ahead, one step planned ahead), so that most of the epoch is decoded after the
# fault; one image actor, on whichever node has the "decode" resource.
REMOTE = {"workers": 1, "num_cpus": 0.25, "tasks_per_worker": 1, "resources": {"decode": 1}, "retry_s": 1.0}
FEED = {
    "plan": {"seed": 3, "batch_size": 4},
    "prefetch_steps": 1,
    "shared_workers": 0,
    "pools": {"image": {"workers": 1, "buffer_samples": 2, "remote": REMOTE}},
}


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """A head without the "decode" resource and a worker node with it (``cluster.worker``), started once."""
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.worker = None
    yield cluster
    cluster.shutdown()


@pytest.fixture
def cluster(two_nodes: Any) -> Any:
    """``two_nodes`` with its worker node up (a test may remove it)."""
    if two_nodes.worker not in two_nodes.worker_nodes:
        two_nodes.worker = two_nodes.add_node(num_cpus=1, resources={"decode": 4})
    return two_nodes


def poll(condition: Callable[[], bool], detail: Callable[[], str], limit_s: float = 120.0) -> None:
    """Until ``condition()`` holds; fails with ``detail()`` after ``limit_s`` (generous: the machine is shared)."""
    give_up = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < give_up, detail()
        time.sleep(0.2)


def image_stats(socket: Path) -> dict[str, Any]:
    """The service's remote counters of the image modality."""
    return dict(request_metrics(str(socket))["remote"]["modalities"]["image"])


def serve_an_epoch_with_a_fault(
    index_dir: Path, folder: Path, address: str, fault: Callable[[ServiceProcess, Path], None]
) -> tuple[list[dict[str, Any]], dict[str, Any], int, str]:
    """Start `omnifeed serve --ray ADDRESS`, wait for its actor, read 2 batches, ``fault(service, socket)``, read
    the rest of the epoch: the batches, the metrics after them, the stop's exit status and what it printed."""
    socket = short_socket_dir() / "feed.sock"
    audit = folder / "audit.jsonl"
    config = write_config(folder, index_dir, socket=socket, audit_log=audit, feed=FEED)
    service = ServiceProcess(config, socket, ("--ray", address))
    try:
        service.start()
        poll(lambda: image_stats(socket)["workers"] >= 1, service.output)  # actors start slowly on a shared machine
        with FeedClient(str(socket)) as client:
            batches = [client.next_batch() for _ in range(2)]
            fault(service, socket)
            batches += [client.next_batch() for _ in range(BATCHES - 2)]
        snapshot = request_metrics(str(socket))
        status = service.stop()
    finally:
        service.stop()
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([audit]))
    assert report.ok, report.to_json()
    keys = [key for b in batches for key in b["__key__"]]
    assert [b["__info__"]["epoch"] for b in batches] == [0] * BATCHES
    assert len(keys) == len(set(keys)) == len(SampleIndex(index_dir)), keys  # every sample once, to the client
    return batches, snapshot, status, service.output()


def test_an_actor_killed_mid_epoch_loses_and_duplicates_nothing(cluster: Any, index_dir: Path, tmp_path: Path) -> None:
    killed: list[int] = []

    def kill_the_actor(_service: ServiceProcess, socket: Path) -> None:
        pid = image_stats(socket)["actors"][0]["pid"]
        os.kill(pid, signal.SIGKILL)  # the actor runs on this machine (a simulated node)
        killed.append(pid)

    _, snapshot, status, output = serve_an_epoch_with_a_fault(index_dir, tmp_path, cluster.address, kill_the_actor)
    image = snapshot["remote"]["modalities"]["image"]
    assert status == 0, output
    assert image["lost"] >= 1, image  # a task met the dead actor: decoded by the service instead
    lost = [a for a in image["actors"] if a["state"] == "lost"]
    assert [a["pid"] for a in lost] == killed, image["actors"]
    assert "was lost" in output, output


def test_a_node_removed_mid_epoch_loses_and_duplicates_nothing(cluster: Any, index_dir: Path, tmp_path: Path) -> None:
    node = cluster.worker

    def remove_the_node(_service: ServiceProcess, _socket: Path) -> None:
        cluster.remove_node(node)

    _, snapshot, status, output = serve_an_epoch_with_a_fault(index_dir, tmp_path, cluster.address, remove_the_node)
    image = snapshot["remote"]["modalities"]["image"]
    assert status == 0, output
    assert image["lost"] >= 1 and image["workers"] == 0, image  # no node left for an actor: all decoded here
    assert image["actors"] and {a["node"] for a in image["actors"]} == {node.node_id}, image["actors"]


def test_the_ray_head_killed_mid_epoch_loses_and_duplicates_nothing(index_dir: Path, tmp_path: Path) -> None:
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"decode": 4}})
    decoded: list[int] = []

    def kill_the_head(service: ServiceProcess, socket: Path) -> None:
        decoded.append(image_stats(socket)["decoded"])
        # The head machine goes away: its GCS first. (Its raylet is also the service's: Ray ends a driver whose
        # raylet dies, so the service must drop the connection before that, as the feed's own test shows.)
        cluster.head_node.kill_gcs_server()
        poll(lambda: not request_metrics(str(socket))["remote"]["connected"], service.output)

    try:
        _, snapshot, status, output = serve_an_epoch_with_a_fault(index_dir, tmp_path, cluster.address, kill_the_head)
    finally:
        cluster.shutdown()
    remote = snapshot["remote"]
    assert status == 0, output
    assert decoded[0] > 0, decoded  # the actor decoded while the head was up
    assert remote["connected"] is False and remote["outages"] == 1, remote
    assert remote["modalities"]["image"]["workers"] == 0 and remote["modalities"]["image"]["local_decoded"] > 0, remote
    assert output.count("unreachable") == 1, output  # one warning for the outage
