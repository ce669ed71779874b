"""`omnifeed chaos --quick`: every kind of fault injected and survived; exactly-once per committed step; no leaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omnifeed.tools._chaos_schedule import KINDS, Schedule

OMNIFEED = str(Path(sys.executable).with_name("omnifeed"))

pytestmark = pytest.mark.slow


@pytest.mark.soak
def test_a_short_soak_injects_every_fault_and_verifies_exactly_once_without_leaks(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    run = subprocess.run(
        [OMNIFEED, "chaos", "--quick", "--minutes", "0.25", "--seed", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert run.returncode == 0 and summary["ok"], run.stdout[-4000:] + run.stderr[-2000:]
    assert all(summary["tally"]["injected"].get(kind, 0) >= 1 for kind in KINDS), summary["tally"]["injected"]
    assert summary["tally"]["storage"]["errors_503"] > 0 and summary["tally"]["storage"]["slowed"] > 0
    assert summary["tally"]["unexpected"] == []
    epochs = summary["audit"]["epochs"]
    assert epochs and all(e["passed"] for e in epochs) and sum(e["complete"] for e in epochs) >= 1
    assert all(e["duplicates"] == e["missing"] == 0 for e in epochs if e["complete"])
    assert summary["audit"]["replaced"] == {}
    assert summary["shm_leaked"] == [] and summary["orphans"] == []
    assert "OK: every check passed" in run.stdout


def test_the_schedule_starts_with_one_fault_of_each_kind_and_a_deferred_kind_stays_due() -> None:
    schedule = Schedule(seed=5, interval_s=(1.0, 2.0), world_sizes=(1, 2, 3))
    first = schedule.kind()
    schedule.defer(first)  # it could not fire: another kind goes first, the deferred one stays due
    fired = [schedule.kind() for _ in range(len(KINDS) - 1)]
    assert first not in fired and len(set(fired)) == len(KINDS) - 1
    assert schedule.kind() == first
    assert all(schedule.world_size(other_than=2) != 2 for _ in range(20))
