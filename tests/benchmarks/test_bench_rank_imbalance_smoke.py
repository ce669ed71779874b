"""The rank-imbalance benchmark runs end to end on a small mix (checks the harness and the model, not speed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rank_imbalance.py"


@pytest.mark.soak
def test_bench_rank_imbalance_models_every_depth_from_each_ranks_steps(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    args = ["--samples", "64", "--depths", "1,4,1000", "--work", str(tmp_path / "work"), "--out", str(out)]
    subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.read_text())
    assert report["samples"] == 64
    assert sum(report["rank_samples"]) >= 64  # the final step takes what it lacks from the next epoch
    walls = [row["wall_s"] for row in report["depths"]]
    assert walls == sorted(walls, reverse=True)  # reading further ahead never makes lockstep slower
    assert all(0 < row["cores_busy"] <= report["ranks"] + 1e-6 for row in report["depths"])


def test_the_lockstep_model_lets_a_rank_run_only_depth_steps_ahead_of_the_last_step_taken() -> None:
    spec = importlib.util.spec_from_file_location("bench_rank_imbalance", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    costs = [[1.0, 0.0], [0.0, 1.0]]  # each rank's slow step is the other's fast one
    # depth 1: rank 1 starts its step 1 only once step 0 is taken (t = 1); depth 2: both run at once
    assert [bench.lockstep(costs, depth)["wall_s"] for depth in (1, 2)] == [2.0, 1.0]
    assert bench.lockstep(costs, 2)["cores_busy"] == 2.0
