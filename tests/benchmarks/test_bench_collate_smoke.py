"""The collate benchmark's harness runs end to end on a tiny size (checks the harness, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_collate.py"


@pytest.mark.soak
def test_bench_collate_reports_both_ways_of_both_cases(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *("--samples", "48", "--rounds", "1", "--feed-rounds", "1", "--feed-epochs", "1"),
            *("--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.read_text())
    assert report["micro_batches"] > 0
    assert set(report["segment_median_ms"]) == {"segment/before", "segment/now"}
    assert all(report["feed_next_batch_ms"][way] for way in ("hugepages", "no-hugepages"))
