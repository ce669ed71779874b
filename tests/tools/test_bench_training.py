"""`omnifeed bench --scenario training`: the simulated data-parallel job, its token model and its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from omnifeed.tools._bench_training import calibrate, job_figures, median_run
from omnifeed.tools._bench_training_rank import batch_tokens

_CLI = "from omnifeed.tools._cli import main; raise SystemExit(main())"


def test_tokens_count_each_modality_padded_to_its_longest_sequence() -> None:
    batch = {
        "__key__": ["a", "b", "c"],
        "text": {"tokens": np.zeros((3, 10), np.int64), "lengths": np.array([10, 4, 1])},
        "image": {"pixels": np.zeros((2, 3, 224, 448), np.uint8), "sizes": np.array([[224, 448], [224, 224]])},
        "video": {
            "frames": np.zeros((1, 4, 3, 224, 224), np.uint8),
            "lengths": np.array([4]),
            "sizes": np.array([[224, 224]]),
        },
        "audio": {"samples": np.zeros((2, 1, 32000), np.float32), "lengths": np.array([32000, 16000])},
    }
    padded, useful = batch_tokens(batch, sample_rate=16000)
    # text 3×10 | images 2×(16·32) patches of 14 px | video 4 frames × 256 | audio 2×50 (25 a second)
    assert padded == 30 + 2 * 512 + 4 * 256 + 2 * 50
    assert useful == 15 + (512 + 256) + 4 * 256 + (50 + 25)


def _rank(rank: int, steps: list[list[float]]) -> dict[str, object]:
    wall = sum(s + c + w for s, c, w, *_ in steps[1:])
    return {"rank": rank, "steps": steps, "wall_s": wall, "cpu_s": 1.0}


def test_barrier_wait_splits_into_imbalance_and_stall_induced() -> None:
    # step 0 (start-up) is left out; then rank 1 computes 0.2 s longer, then rank 1 stalls 0.3 s
    first = [1.0, 0.0, 0.0, 10, 10, 2]
    ranks = [
        _rank(0, [first, [0.0, 0.4, 0.2, 100, 50, 2], [0.0, 0.4, 0.3, 100, 100, 2]]),
        _rank(1, [first, [0.0, 0.6, 0.0, 100, 100, 2], [0.3, 0.4, 0.0, 100, 100, 2]]),
    ]
    figures = job_figures(ranks)
    wall = 2 * 0.6 + 2 * 0.7
    assert figures["barrier_imbalance"] == pytest.approx(round(0.2 / wall, 4))
    assert figures["barrier_stall"] == pytest.approx(round(0.3 / wall, 4))
    assert figures["stall"] == pytest.approx(round(0.3 / wall, 4))
    assert figures["util"] == pytest.approx(round(1.8 / wall, 4))
    assert figures["useful_util"] == pytest.approx(round((0.2 + 0.4 + 0.6 + 0.4) / wall, 4))
    assert figures["padding"] == pytest.approx(50 / 400)
    assert figures["samples"] == 8 and figures["steps"] == 2


def test_compute_heavy_is_six_times_the_data_heavy_cost_per_token() -> None:
    c = calibrate({"step_s": 0.1, "padded_tokens_per_step": 1000.0})
    assert c["no-compute"] == 0.0
    assert c["data-heavy"] == pytest.approx(0.5 * 0.1 / 1000)
    assert c["compute-heavy"] == pytest.approx(6 * c["data-heavy"])


def test_c_comes_from_the_dataloader_run_of_median_step_time() -> None:
    runs = [{"step_s": 0.034, "run": "slow"}, {"step_s": 0.024, "run": "fast"}, {"step_s": 0.027, "run": "middle"}]
    assert median_run(runs)["run"] == "middle"
    assert median_run(runs[:2])["run"] == "fast"  # an even count: the lower middle
    assert median_run(runs[:1])["run"] == "slow"


@pytest.mark.soak
def test_quick_training_scenario_reports_every_loader_at_every_point(tmp_path: Path) -> None:
    out = tmp_path / "training"
    run = subprocess.run(
        [sys.executable, "-c", _CLI, "bench", "--scenario", "training", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    rows = {(r["loader"], r["point"]): r for r in report["rows"]}
    points = ("no-compute", "data-heavy", "compute-heavy")
    for loader in ("dataloader", "omnifeed", "omnifeed-service"):
        for point in points:
            row = rows[(loader, point)]
            assert row["status"] == "ok", row
            assert row["samples"] > 0 and row["steps"] > 0 and row["samples_per_s"] > 0
            for name in ("useful_util", "util", "stall", "barrier_imbalance", "barrier_stall", "padding"):
                assert 0 <= row[name] <= 1, (name, row)
            assert row["useful_util"] <= row["util"]
        assert rows[(loader, "data-heavy")]["util"] > 0
    for peer in ("litdata", "energon"):  # reported whether or not installed
        assert {rows[(peer, p)]["status"].split(":")[0] for p in points} <= {"missing", "n/a"}
    c = report["settings"]["seconds_per_token"]
    assert 0 < c["data-heavy"] < c["compute-heavy"]
    # c from the DataLoader's own rounds without compute, measured among the other loaders' (no warm-up run: --quick)
    assert report["calibration_step_s"] == [r["step_s"] for r in report["rounds"]["dataloader/no-compute"]]
    assert report["warmup_step_s"] == []
    assert "| compute-heavy | omnifeed-service |" in run.stdout
    assert (out / "training.png").is_file() or "no plot" in run.stdout
