"""The index benchmark's harness runs end to end on a tiny size (checks the harness, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_index.py"


@pytest.mark.soak
def test_bench_index_reports_build_open_and_scan_figures(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--rows",
            "20000",
            "--open-rows",
            "30000",
            "--scan-samples",
            "16",
            "--work",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(result.stdout)
    assert report["build"]["rows"] == 20000 and report["build_large"]["rows"] == 30000
    for rows in ("20000", "30000"):
        assert report["open"][rows]["mmap"]["rows"] == int(rows)
        assert report["open"][rows]["parquet_read"]["rows"] == int(rows)
    assert report["scan"]["workers_2"]["samples_per_s"] > 0
    assert not (tmp_path / "work").exists(), "the benchmark cleans up after itself"
