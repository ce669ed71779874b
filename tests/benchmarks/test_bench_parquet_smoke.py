"""The Parquet/Arrow random-access benchmark's harness runs end to end on a tiny size (checks the harness, not
speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_parquet.py"


@pytest.mark.soak
def test_bench_parquet_reports_every_layout_against_tar(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--images", "24"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(result.stdout)
    assert (report["images"], report["rounds"]) == (24, 1)
    assert set(report["layouts"]) == {"tar", "parquet_pyarrow", "parquet_datasets", "arrow_datasets"}
    assert report["layouts"]["tar"]["vs_tar"] == 1.0
    assert all(layout["samples_per_s"] > 0 for layout in report["layouts"].values())
    assert report["parquet_pyarrow_row_groups"] == [24]
