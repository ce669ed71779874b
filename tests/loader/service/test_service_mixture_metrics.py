"""A service serving a mixture: Prometheus and `omnifeed stats` count what each source delivered."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from feed_service import short_socket_dir
from prometheus_client.parser import text_string_to_metric_families

from omnifeed.loader import FeedConfig, IndexConfig, PlanConfig, build_index
from omnifeed.loader.service._config import ServiceConfig
from omnifeed.loader.service._server import FeedService
from omnifeed.tools._cli import main
from omnifeed.trainer_adapter import FeedClient


def test_a_mixture_service_exports_each_sources_samples_tokens_and_replaced(
    index_dir: Path, demo_parquet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = build_index([str(demo_parquet)], tmp_path / "parquet-index", IndexConfig(workers=1), progress=False).path
    mixture = {
        "sources": {"tars": {"index": str(index_dir), "weight": 0.5}, "table": {"index": str(table), "weight": 0.5}}
    }
    config = ServiceConfig(
        feed=FeedConfig(plan=PlanConfig(seed=3, batch_size=4, mixture=mixture)),
        socket=str(short_socket_dir() / "feed.sock"),
        metrics_port=0,
    )
    with FeedService(config) as service, FeedClient(service.address, rank=0, world_size=1) as client:
        keys = [key for _ in range(6) for key in client.next_batch()["__key__"]]
        page = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=30).read().decode()
        assert main(["stats", "--socket", service.address, "--once"]) == 0
        tokens = service.index.length_columns(service.index.positions_of(keys))["text_tokens"]
    got = {
        (s.name, s.labels.get("source")): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }
    samples = {name: got[("omnifeed_source_samples_total", name)] for name in ("tars", "table")}
    # the service may have taken micro-batches ahead of the client (shared-memory segments): at least what it got
    assert all(samples[name] >= sum(k.startswith(f"{name}/") for k in keys) > 0 for name in samples)
    assert sum(got[("omnifeed_source_tokens_total", name)] for name in samples) >= int(tokens.sum()) > 0
    assert got[("omnifeed_source_replaced_total", "tars")] == got[("omnifeed_source_replaced_total", "table")] == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line}
    assert rows["source"][:3] == ["source", "samples/s", "tokens/s"] and {"tars", "table"} <= set(rows)
