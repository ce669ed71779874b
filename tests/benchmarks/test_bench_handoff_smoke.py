"""The hand-off benchmark's harness runs end to end on a tiny size (checks the harness, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_handoff.py"


@pytest.mark.soak
def test_bench_handoff_reports_service_dataloader_and_memcpy_figures(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.read_text())
    (size,) = report["sizes"].values()
    assert size["batch_bytes"] >= 1_000_000 and size["batches"] >= 10
    for name in ("memcpy", "stack", "service", "dataloader"):
        assert size[name]["gb_per_s"] > 0
    for name in ("service", "dataloader"):
        assert size[name]["cpu_ms_per_batch"] > 0 and size[name]["next_thread_ms"] > 0
    assert size["dataloader"]["gb_per_s_vs_dataloader"] == 1.0
