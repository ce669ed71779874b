"""`omnifeed bench --scenario scale`: the planning side of a large job at tiny sizes (the harness, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_CLI = "from omnifeed.tools._cli import main; raise SystemExit(main())"
CELL_KEYS = {
    "samples",
    "dp",
    "accum",
    "batching",
    "first_step_s",
    "step_s",
    "per_local_rank_ms",
    "steps",
    "state_bytes",
    "resume_s",
    "resize_s",
    "resize_to_dp",
    "rss_mb",
    "cut",
}


def test_scale_scenario_reports_every_cell_and_the_index(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [
        "--scale-samples",
        "10000",
        "--world-sizes",
        "2,4",
        "--accums",
        "1,16",
        "--index-rows",
        "64,256",
        "--index-cache",
        str(tmp_path / "indexes"),
        "--written-samples",
        "20000",
    ]
    run = subprocess.run(
        [sys.executable, "-c", _CLI, "bench", "--scenario", "scale", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    cells = report["cells"]
    assert {(c["batching"], c["dp"], c["accum"]) for c in cells} == {
        (b, dp, a) for b in ("fixed", "budget", "budget-written") for dp in (2, 4) for a in (1, 16)
    }
    written = [c for c in cells if c["batching"] == "budget-written"]
    assert {c["samples"] for c in written} == {20000} and written[0]["write_s"] > 0
    assert all(c["write_s"] == 0 for c in written[1:])  # the epoch is written once, by the first such cell
    for cell in cells:
        assert CELL_KEYS <= set(cell), sorted(CELL_KEYS - set(cell))
        assert cell["cut"] == [] and cell["steps"] >= 3 and cell["crossed_window"]
        assert 0 < cell["state_bytes"] < 4096 and cell["resize_to_dp"] == cell["dp"] // 2
        assert cell["step_s"] >= 0 and cell["resume_s"] >= 0 and cell["resize_s"] >= 0
    assert set(report["targets"]) == {"per_local_rank_ms", "resume_s", "state_bytes", "resize_s"}
    assert report["settings"]["local_ranks"] == 8 and "assumption" in report["settings"]
    index = report["index"]
    assert index["rows"] == 256 and [size["rows"] for size in index["sizes"]] == [64, 256]
    for size in index["sizes"]:
        assert size["open_s"] >= 0 and "rss_open_mb" in size
        for batching in ("fixed", "budget"):  # a plan built from the index, its first step, and a resume
            assert {"plan_s", "first_step_s", "resume_s", "state_bytes"} <= set(size[batching])
    assert index["projection"]["rows"] == 10**9 and "a line through 64 and 256 rows" in index["projection"]["how"]
    assert "| budget | 4 × 16 |" in run.stdout and "index of 64 rows" in run.stdout and "index of 256" in run.stdout
    assert (out / "scale.png").stat().st_size > 0
    assert (
        report["settings"]["index_cache"] == str(tmp_path / "indexes") and (tmp_path / "indexes" / "index-256").is_dir()
    )


def test_a_cell_over_its_time_limit_is_cut_not_waited_for(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--scale-samples", "100000", "--world-sizes", "512", "--accums", "16", "--index-rows", "0"]
    args += ["--written-samples", "0"]
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _CLI,
            "bench",
            "--scenario",
            "scale",
            *args,
            "--cell-seconds",
            "0.001",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["index"] is None
    assert all(cell["cut"] for cell in report["cells"])
    assert "≥" in run.stdout
