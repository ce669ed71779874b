"""The service production benchmark's harness runs end to end on a tiny mix (checks the harness, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_service_production.py"


@pytest.mark.soak
def test_bench_service_production_reports_every_layout_with_its_cpu(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    # Enough batches that some are taken inside the measured window (the epochs after the first): at 48 samples an
    # epoch was 3 steps a rank, and the service, reading ahead, had made all of epoch 2's before it began.
    subprocess.run(
        [sys.executable, str(SCRIPT), "--samples", "96", "--epochs", "3", "--rounds", "1", "--compute-ms", "1"]
        + ["--layouts", "feeds", "service", "services"]
        + ["--work", str(tmp_path / "work"), "--out", str(out)]
        + ["--instrument", "loader.service._stream:Stream.take"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    rows = json.loads(out.read_text())["rows"]
    for layout in ("feeds", "service", "services"):
        assert rows[layout]["samples"] > 0 and rows[layout]["samples_per_cpu_s"] > 0
        assert 0 <= rows[layout]["waited_fraction"] <= 1
        shares = rows[layout]["decode_threads"]  # running, waiting for a core, asleep: the decode threads' time
        assert rows[layout]["decode_threads"]["running"] > 0 and all(0 <= v <= 1 for v in shares.values())
        assert sum(shares.values()) == pytest.approx(1, abs=0.02)
    service = rows["service"]["service"]
    assert service["cpu_s"] > 0 and any(name.startswith("omnifeed-") for name in service["threads"])
    assert service["spent"]["loader.service._stream:Stream.take"][1] > 0
    assert rows["service"]["vs_feeds"]["samples_per_s"] > 0 and rows["services"]["vs_feeds"]["samples_per_s"] > 0
    assert rows["services"]["service"]["cpu_s"] > 0  # both ranks' services counted
