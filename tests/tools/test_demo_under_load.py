"""The demo's served phases verify exactly once whatever the timing: ranks skewed, CPUs busy (issue 27).

`omnifeed demo` runs whole. Its toy trainer ranks of one phase share no barrier. Each phase resumes from the checkpoint
the previous phase committed and commits its own file, so a rank 0 that finishes (and saves) before a peer
starts cannot change what that peer resumes from. Here one rank starts seconds late, another runs slowly,
and two busy processes hold both CPUs, as on a loaded node; the service's audit log must still cover
epoch 0 exactly once.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnifeed.tools._demo import run_demo

_HOG = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@pytest.fixture
def busy_cpus() -> Iterator[None]:
    """Two processes spinning on the CPUs for the test's duration (each ends by itself after 10 minutes)."""
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG.format(seconds=600)]) for _ in range(2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def skewed(phase: int, rank: int) -> list[str]:
    """Phase 1: rank 1 starts after rank 0 has finished and saved; phase 3: rank 0 is slow, rank 2 starts late."""
    return {(0, 1): ["--start-delay", "6"], (2, 0): ["--step-delay", "0.3"], (2, 2): ["--start-delay", "3"]}.get(
        (phase, rank), []
    )


def test_the_demo_verifies_exactly_once_with_skewed_ranks_on_busy_cpus(tmp_path: Path, busy_cpus: None) -> None:
    """`omnifeed demo` as `make demo` runs it (240 samples), its served ranks skewed, both CPUs busy."""
    report = io.StringIO()
    status = run_demo(tmp_path / "demo", stream=report, rank_args=skewed)
    text = report.getvalue()
    assert status == 0, text
    assert "OK: every sample of epoch 0 delivered exactly once across 4 -> 3 -> 6 ranks." in text
    assert "OK: the service delivered epoch 0 exactly once across 2 -> 1 -> 3 trainer ranks." in text
    assert (
        "OK: each source's samples of mixture epoch 0 delivered as its schedule planned, across 2 -> 3 ranks." in text
    )
    assert "from the source files: 0" in text, text  # the service ran from the pre-cached NVMe tier
    checkpoints = sorted(p.name for p in (tmp_path / "demo").glob("checkpoint-*.pt"))
    assert checkpoints == ["checkpoint-phase1.pt", "checkpoint-phase2.pt"], "a checkpoint per phase, committed"
