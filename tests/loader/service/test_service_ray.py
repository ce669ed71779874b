"""A service configured to decode on Ray starts and serves every sample once on its own workers when no cluster answers."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest
from feed_service import short_socket_dir

from omnifeed.loader import FeedConfig, PlanConfig, SampleIndex
from omnifeed.loader.feed._config import PoolConfig
from omnifeed.loader.feed._remote_config import RemoteConfig
from omnifeed.loader.plan._audit import verify_coverage
from omnifeed.loader.service._config import ServiceConfig
from omnifeed.loader.service._metrics_collector import ServiceCollector
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
