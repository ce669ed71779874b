"""SIGTERM (what Slurm and Kubernetes send) stops `omnifeed index` as Ctrl-C does: exit 143, the partial index
removed, its scan workers gone and no POSIX semaphore of theirs left in /dev/shm (issue 28)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from range_http import RangeServer
from shm_semaphores import semaphore_inodes, shm_inodes

pytest.importorskip("aiohttp")  # fsspec's HTTP filesystem

OMNIFEED = str(Path(sys.executable).with_name("omnifeed"))


@pytest.fixture(scope="module")
def http(demo_shards: list[Path]) -> Iterator[RangeServer]:
    server = RangeServer(demo_shards[0].parent).start()
    yield server
    server.stop()


def wait_for(condition: object, process: subprocess.Popen[str]) -> None:
    """Until ``condition()`` holds, while ``process`` runs (a hang guard, not a speed check)."""
    deadline = time.monotonic() + 240
    while not condition() and process.poll() is None and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.05)


def test_sigterm_mid_scan_exits_143_removing_the_partial_index_its_workers_and_semaphores(
    http: RangeServer, demo_shards: list[Path], tmp_path: Path
) -> None:
    http.reset(allow=0)  # every ranged read waits: both scan workers are held mid-shard
    out = tmp_path / "index"
    command = [
        OMNIFEED,
        "index",
        *(f"{http.url}/{s.name}" for s in demo_shards),
        "--out",
        str(out),
        "--workers",
        "2",
        "--no-progress",
    ]
    index = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: http.waiting >= 2, index)
        assert index.poll() is None, index.communicate()
        assert [p.name for p in tmp_path.iterdir()][0].startswith(".index.building-")
        descendants = psutil.Process(index.pid).children(recursive=True)  # forkserver, workers, resource tracker
        semaphores = semaphore_inodes(index.pid)
        assert semaphores and len(descendants) >= 3
        index.send_signal(signal.SIGTERM)  # to the command alone, as Kubernetes stops a container's main process
        _, stderr = index.communicate(timeout=120)
    finally:
        http.reset()  # the held reads are dropped
        if index.poll() is None:
            index.kill()
    assert index.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1].startswith("omnifeed: terminated (SIGTERM): stopped; the partial index")
    assert list(tmp_path.iterdir()) == [], "no .index.building-* folder, no --out"
    _, alive = psutil.wait_procs(descendants, timeout=60)
    assert alive == [], [p.pid for p in alive]
    assert not semaphores & shm_inodes(), "the pool's semaphores were unlinked"
