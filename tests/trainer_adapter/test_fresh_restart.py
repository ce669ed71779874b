"""A job that crashes before its first checkpoint and starts again from scratch (found by `omnifeed chaos`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from feed_service import short_socket_dir, start_service

from omnifeed.loader import SampleIndex, read_delivery_logs, verify_coverage
from omnifeed.trainer_adapter import FeedClient

# A trainer rank with no checkpoint yet: trains two steps and is killed before it saves one.
_CRASHING_RANK = """
import os, signal, sys
from omnifeed.trainer_adapter import FeedClient
batches = iter(FeedClient(sys.argv[1]))
next(batches); next(batches)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_job_restarted_from_scratch_at_another_size_after_a_crash_before_its_first_checkpoint_verifies(
    index_dir: Path, tmp_path: Path
) -> None:
    socket = short_socket_dir() / "feed.sock"
    audit = tmp_path / "audit.jsonl"
    service = start_service(index_dir, socket, audit)
    try:
        crashed = subprocess.run(
            [sys.executable, "-c", _CRASHING_RANK, str(socket)], capture_output=True, text=True, timeout=120
        )
        assert crashed.returncode == -9, crashed.stderr
        for rank in (0, 1):  # no checkpoint to load: the job starts the epoch again, at 2 ranks (torchrun elastic)
            with FeedClient(str(socket), rank=rank, world_size=2) as restarted:
                for _ in restarted:
                    pass
    finally:
        service.stop()
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([audit]))
    assert report.ok, report.to_json()
