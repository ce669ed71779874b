"""The resize benchmark's harness runs end to end on a small index (checks the harness, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_resize.py"


@pytest.mark.soak
def test_bench_resize_reports_every_change_through_the_service_and_in_process(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.read_text())
    assert report["index"]["num_samples"] == report["rows"] == 20_000
    assert report["deep_position"]["micro_batch"] > 0
    for position in ("early", "deep"):
        run = report["service"][position]
        for change, clients, resizes in (("shrink_4_to_3", 3, 1), ("grow_3_to_6", 6, 2)):
            figures = run[change]
            assert len(figures["clients"]) == clients
            assert 0 < figures["total_median_ms"] <= figures["total_max_ms"]
            assert all(c["resize_call_ms"] <= c["total_ms"] for c in figures["clients"])
            assert figures["service"]["resizes"] == resizes and figures["service"]["last_resize_ms"] > 0
        assert report["in_process"][position]["joining_rank_ms"] > 0
    assert report["service"]["deep"]["position"]["micro_batch"] == report["deep_position"]["micro_batch"]
    assert report["service_worst_ms"] == max(
        report["service"][p][c]["total_max_ms"] for p in ("early", "deep") for c in ("shrink_4_to_3", "grow_3_to_6")
    )
