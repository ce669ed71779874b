"""End to end under real torchrun (gloo, CPU): a worker killed, the job resumed smaller, then grown; exactly-once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from feed_service import ServiceProcess, short_socket_dir, write_config

from omnifeed.loader import SampleIndex, read_delivery_logs, verify_coverage

pytestmark = pytest.mark.slow


def torchrun(workers: int, address: Path, checkpoint: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={workers}",
        "--max-restarts=0",
        "-m",
        "omnifeed.trainer_adapter",
        "--torchrun",
        "--address",
        str(address),
        "--checkpoint",
        str(checkpoint),
        "--save-every",
        "2",
        *extra,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)


def summaries(run: subprocess.CompletedProcess[str]) -> list[dict]:
    """Each worker's JSON summary (torchrun merges the workers' output: two can share a line)."""
    decoder, text, found = json.JSONDecoder(), run.stdout, []
    start = text.find('{"rank"')
    while start >= 0:
        summary, end = decoder.raw_decode(text, start)
        found.append(summary)
        start = text.find('{"rank"', end)
    return sorted(found, key=lambda s: s["rank"])


def test_a_killed_worker_then_a_smaller_then_a_larger_job_deliver_the_epoch_exactly_once(
    index_dir: Path, tmp_path: Path
) -> None:
    socket = short_socket_dir() / "feed.sock"
    audit = tmp_path / "audit.jsonl"
    service = ServiceProcess(
        write_config(tmp_path, index_dir, socket=socket, audit_log=audit, feed={"plan": {"seed": 7, "batch_size": 2}}),
        socket,
    ).start()
    checkpoint = tmp_path / "checkpoint.pt"
    try:
        crashed = torchrun(2, socket, checkpoint, "--kill-at-step", "5", "--kill-rank", "1")
        assert crashed.returncode != 0, crashed.stdout + crashed.stderr  # rank 1 was SIGKILLed mid-run
        assert checkpoint.exists()  # step 4's checkpoint, committed before the kill

        smaller = torchrun(1, socket, checkpoint, "--max-steps", "3")
        assert smaller.returncode == 0, smaller.stderr[-3000:]
        (alone,) = summaries(smaller)
        assert alone["hints"]["previous_world_size"] == 2 and alone["hints"]["world_size"] == 1
        assert alone["hints"]["lr_scale"] == pytest.approx(0.5)
        assert alone["steps"] == 4 + 3

        larger = torchrun(3, socket, checkpoint)
        assert larger.returncode == 0, larger.stderr[-3000:]
        grown = summaries(larger)
        assert [s["rank"] for s in grown] == [0, 1, 2]
        assert all(s["hints"]["world_size"] == 3 and s["hints"]["previous_world_size"] == 1 for s in grown)
        assert len({s["steps"] for s in grown}) == 1 and all(s["run_steps"] > 0 for s in grown)
    finally:
        service.stop()
    records = list(read_delivery_logs([audit]))
    report = verify_coverage(SampleIndex(index_dir), 0, records)
    assert report.ok, report.to_json()
    without_rollback = verify_coverage(SampleIndex(index_dir), 0, [r for r in records if "resume" not in r])
    assert without_rollback.duplicates > 0  # the crash's uncommitted steps were logged, and rolled back above
    assert {r["world_size"] for r in records if "since" in r and r["epoch"] == 0} == {1, 2, 3}
