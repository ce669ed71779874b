"""Resume markers in the service's audit log under repeated crashes (found by `omnifeed chaos`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from feed_service import short_socket_dir, start_service

from omnifeed.loader import SampleIndex, read_delivery_logs, verify_coverage
from omnifeed.trainer_adapter import FeedClient

# A trainer rank that resumes from a checkpoint, trains two steps and is killed before its next checkpoint.
_CRASHING_RANK = """
import json, os, signal, sys
from omnifeed.trainer_adapter import FeedClient
client = FeedClient(sys.argv[1])
client.load_state_dict(json.loads(sys.argv[2]))
batches = iter(client)
next(batches); next(batches)  # the first is audited when the second is asked for
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_two_restarts_from_the_same_checkpoint_verify_exactly_once(index_dir: Path, tmp_path: Path) -> None:
    socket = short_socket_dir() / "feed.sock"
    audit = tmp_path / "audit.jsonl"
    service = start_service(index_dir, socket, audit)
    try:
        with FeedClient(str(socket)) as first:  # the job's first run: a checkpoint after 2 steps, then a crash
            batches = iter(first)
            next(batches), next(batches)
            checkpoint = first.state_dict()
        crashed = subprocess.run(
            [sys.executable, "-c", _CRASHING_RANK, str(socket), json.dumps(checkpoint)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert crashed.returncode == -9, crashed.stderr  # restart 1 from the checkpoint, killed before the next one
        with FeedClient(str(socket)) as final:  # restart 2 from the same checkpoint, to the end of the epoch
            final.load_state_dict(checkpoint)
            for _ in final:
                pass
    finally:
        service.stop()
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([audit]))
    assert report.ok, report.to_json()


# Rank 1 of 2: takes its micro-batches of steps 0 and 1, then waits (the test kills it).
_RANK_ONE = """
import sys
from omnifeed.trainer_adapter import FeedClient
client = FeedClient(sys.argv[1], rank=1, world_size=2)
batches = iter(client)
next(batches); next(batches)
print("trained step 1", flush=True)
sys.stdin.read()
"""


def test_a_rank_killed_right_after_the_checkpoint_that_commits_its_step_leaves_nothing_missing(
    index_dir: Path, tmp_path: Path
) -> None:
    socket = short_socket_dir() / "feed.sock"
    audit = tmp_path / "audit.jsonl"
    service = start_service(index_dir, socket, audit)
    try:
        rank_one = subprocess.Popen(
            [sys.executable, "-c", _RANK_ONE, str(socket)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        with FeedClient(str(socket), rank=0, world_size=2) as rank_zero:
            batches = iter(rank_zero)
            next(batches), next(batches)
            assert rank_one.stdout is not None and rank_one.stdout.readline()  # both ranks trained step 1 (DDP)
            checkpoint = rank_zero.state_dict()  # rank 0 commits steps 0-1
            rank_one.kill()  # then rank 1 dies before it asks for step 2 (an OOM kill, a node loss)
            rank_one.wait()
        for rank in (0, 1):  # the job restarts from the checkpoint and finishes the epoch
            with FeedClient(str(socket), rank=rank, world_size=2) as client:
                client.load_state_dict(checkpoint)
                for _ in client:
                    pass
    finally:
        service.stop()
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([audit]))
    assert report.ok, report.to_json()
