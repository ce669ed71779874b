"""Under real torchrun through `omnifeed serve`: a three-source, two-phase mixture resized 2 -> 3 ranks mid-epoch
delivers each source's samples exactly as its schedule planned (issue 31)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from feed_service import ServiceProcess, short_socket_dir
from test_torchrun import summaries, torchrun

from omnifeed.loader import FeedConfig, IndexConfig, Plan, build_index, read_delivery_logs
from omnifeed.loader.plan import open_mixture, verify_mixture

pytestmark = pytest.mark.slow


def test_a_phased_three_source_mixture_resized_under_torchrun_delivers_each_source_as_planned(
    index_dir: Path, demo_parquet: Path, demo_folder: Path, tmp_path: Path
) -> None:
    build_index([str(demo_parquet)], tmp_path / "table", IndexConfig(workers=1), progress=False)
    build_index([str(demo_folder)], tmp_path / "files", IndexConfig(workers=1), progress=False)
    (tmp_path / "tars").symlink_to(index_dir)
    mixture = {
        "sources": {
            "tars": {"index": "tars", "weight": 0.5},
            "table": {"index": "table", "weight": 0.3, "where": {"text_tokens": [1, 40]}},
            "files": {"index": "files", "weight": 0.2},
        },
        "phases": [
            {"until_samples": 60, "weights": {"tars": 0.6, "table": 0.3, "files": 0.1}},
            {"weights": {"tars": 0.2, "table": 0.3, "files": 0.5}},
        ],
    }
    socket, audit = short_socket_dir() / "feed.sock", tmp_path / "audit.jsonl"
    feed = {"plan": {"seed": 7, "batch_size": 2, "mixture": mixture}}
    config = tmp_path / "service.yaml"
    config.write_text(yaml.safe_dump({"socket": str(socket), "audit_log": str(audit), "feed": feed}, sort_keys=False))
    service = ServiceProcess(config, socket).start()
    checkpoint = tmp_path / "checkpoint.pt"
    try:
        first = torchrun(2, socket, checkpoint, "--max-steps", "6")
        assert first.returncode == 0, first.stderr[-3000:]
        grown = torchrun(3, socket, checkpoint)
        assert grown.returncode == 0, grown.stderr[-3000:]
        assert [s["hints"]["world_size"] for s in summaries(grown)] == [3, 3, 3]
    finally:
        assert service.stop() == 0, service.output()
    plan_config = FeedConfig.from_yaml(_feed_yaml(tmp_path, feed)).plan
    assert plan_config.mixture is not None
    index = open_mixture(plan_config.mixture)
    records = list(read_delivery_logs([audit]))
    report = verify_mixture(index, Plan.from_index(index, plan_config), 0, records)
    assert report.ok, report.to_json()
    assert {r["world_size"] for r in records if "since" in r and r["epoch"] == 0} == {2, 3}
    assert all(source.delivered > 0 for source in report.sources.values())


def _feed_yaml(folder: Path, feed: dict) -> Path:
    path = folder / "feed.yaml"
    path.write_text(yaml.safe_dump(feed, sort_keys=False))
    return path
