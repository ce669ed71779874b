"""The cache benchmarks' harnesses run end to end on tiny sizes (checks the harness, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.soak
def test_bench_cache_reports_every_epoch_kind_and_precache(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_cache.py"),
            "--images",
            "24",
            "--latency",
            "0.002",
            "--batch-size",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(out.read_text())
    for name in ("dataloader_cold", "feed_cold", "feed_nvme_warm", "feed_ram_warm", "plain_copy_bytes_per_s"):
        assert report[name] > 0
    assert report["precache"]["cached"] > 0 and report["precache"]["failed"] == 0
    assert report["tiers_after_ram_warm"]["ram"]["hits"] > 0
