"""The per-core / Ray index benchmark's harness runs end to end on a tiny size (checks the harness, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_index_ray.py"

pytest.importorskip("ray")


@pytest.mark.soak
def test_bench_index_ray_builds_the_same_index_locally_and_on_a_two_node_cluster(tmp_path: Path) -> None:
    args = ["--samples", "48", "--shards", "2", "--mixed-samples", "16", "--nodes", "2", "--write-rows", "20000"]
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(result.stdout)
    assert json.loads(out.read_text()) == report
    for name, samples in (("image_caption", 48), ("mixed", 16)):
        runs = report[name]
        assert runs["ray_nodes"] == 2
        for run in ("local_workers_1", "local_workers_2", "ray"):
            assert runs[run]["samples"] == samples
            assert runs[run]["samples_per_s_per_core"] > 0 and runs[run]["cpu_ms_per_sample"] > 0
        assert runs["ray"]["command"].split("--ray ")[1].count(":") == 1, "the cluster's address went to the CLI"
        assert runs["ray"]["same_fingerprint"] and runs["ray"]["files_differing_from_local"] == []
        assert runs["ray"]["cpu_s"]["ray_worker"] > 0, "the scan ran in Ray's workers"
        assert runs["scan_in_process"]["samples_per_s_per_core"] > 0
    projection = report["projection_1e9"]
    assert [row["cores"] for row in projection["rows"]] == [64, 512, 4096]
    assert projection["rows"][0]["scan_hours"] > projection["rows"][2]["scan_hours"] > 0
    assert report["driver_write"]["rows"] == 20000 and projection["driver_write_hours"] > 0
    assert not (tmp_path / "work").exists(), "the benchmark cleans up after itself"
