"""A service configured to decode on Ray: it serves every sample once on its own workers when no cluster answers;
`omnifeed serve --ray` against a real local cluster lists its actors and stops quietly on SIGTERM."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest
from feed_service import ServiceProcess, short_socket_dir, write_config

from omnifeed.loader import FeedConfig, PlanConfig, SampleIndex
from omnifeed.loader.feed._config import PoolConfig
from omnifeed.loader.feed._remote_config import RemoteConfig
from omnifeed.loader.plan._audit import verify_coverage
from omnifeed.loader.service._config import ServiceConfig
from omnifeed.loader.service._metrics_collector import ServiceCollector
from omnifeed.loader.service._protocol import request_metrics
from omnifeed.loader.service._server import FeedService
from omnifeed.tools._stats import render_stats
from omnifeed.trainer_adapter import FeedClient

pytest.importorskip("ray")


def closed_port() -> int:
    """A local TCP port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_service_serves_on_local_workers_while_ray_is_unreachable(
    index_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    remote = RemoteConfig(workers=2, max_workers=4, address=f"127.0.0.1:{closed_port()}")
    feed = FeedConfig(
        plan=PlanConfig(seed=3, batch_size=4),
        pools={"image": PoolConfig(workers=1, remote=remote), "video": PoolConfig(workers=1, remote=remote)},
    )
    audit = tmp_path / "audit.jsonl"
    config = ServiceConfig(
        index=str(index_dir), feed=feed, socket=str(short_socket_dir() / "feed.sock"), audit_log=str(audit)
    )
    with caplog.at_level(logging.WARNING), FeedService(config) as service, FeedClient(service.address) as client:
        batches = [client.next_batch() for _ in range(12)]  # the epoch: 48 samples, 4 a batch
        snapshot = service.metrics()
    assert [b["__info__"]["epoch"] for b in batches] == [0] * 12
    assert verify_coverage(SampleIndex(index_dir), 0, [json.loads(line) for line in audit.read_text().splitlines()]).ok
    assert snapshot["remote"]["connected"] is False and snapshot["remote"]["outages"] == 1
    assert all(m["workers"] == 0 and m["local_decoded"] > 0 for m in snapshot["remote"]["modalities"].values())
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1  # one warning, not one per task
    names = {metric.name for metric in ServiceCollector(lambda: snapshot).collect()}
    assert {
        "omnifeed_remote_workers",
        "omnifeed_remote_outages",
        "omnifeed_remote_overdue",
        "omnifeed_local_decoded_per_second",
    } <= names
    assert "UNREACHABLE" in render_stats(snapshot, None)


def test_serve_ray_lists_where_its_actors_run_and_a_sigterm_stop_is_quiet(index_dir: Path, tmp_path: Path) -> None:
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"decode": 4}})
    socket_path = short_socket_dir() / "feed.sock"
    remote = {"workers": 1, "num_cpus": 0.25, "tasks_per_worker": 1, "resources": {"decode": 1}}
    feed = {"plan": {"seed": 3, "batch_size": 4}, "pools": {"image": {"workers": 1, "remote": remote}}}
    service = ServiceProcess(
        write_config(tmp_path, index_dir, socket=socket_path, feed=feed), socket_path, ("--ray", cluster.address)
    )
    try:
        service.start()
        give_up = time.monotonic() + 120  # generous: actors start slowly on a shared machine
        while request_metrics(str(socket_path))["remote"]["modalities"]["image"]["workers"] < 1:
            assert time.monotonic() < give_up, service.output()
            time.sleep(0.2)
        with FeedClient(str(socket_path)) as client:
            batches = [client.next_batch() for _ in range(12)]  # the epoch
        snapshot = request_metrics(str(socket_path))
        status = service.stop()
    finally:
        service.stop()
        cluster.shutdown()
    output = service.output()
    assert [b["__info__"]["epoch"] for b in batches] == [0] * 12
    assert status == 0, output
    assert "SIGTERM received" not in output and "*** " not in output, output  # no crash dump on a clean stop
    assert "omnifeed: service stopped" in output
    image = snapshot["remote"]["modalities"]["image"]
    actors = image["actors"]
    assert len(actors) >= 1 and all(a["node"] and a["pid"] > 0 for a in actors), actors
    assert sum(a["decoded"] for a in actors) == image["decoded"] > 0, image
    assert sum(a["lost"] for a in actors) == image["lost"] == 0, image
    table = render_stats(snapshot, None)
    assert all(str(a["pid"]) in table and a["node"][:12] in table for a in actors), table
