"""Attempts and the audit log: clients loading one checkpoint share an attempt, a crash opens the next one with a
resume marker (what `omnifeed verify` rolls back by: tests/loader/plan), records go to a private log."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from omnifeed.loader.feed import FeedPosition
from omnifeed.loader.plan._audit import delivered_keys  # what `omnifeed verify` counts
from omnifeed.loader.service._attempts import AttemptLog


def state(step: int) -> FeedPosition:
    return FeedPosition({"epoch": 0, "step": step, "topology_version": 0})


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_clients_loading_the_same_checkpoint_join_one_attempt_with_one_marker(tmp_path: Path) -> None:
    log = AttemptLog(str(tmp_path / "audit.jsonl"))
    first = log.join(None, "digest", state(4))
    assert first is not None and first.startswith("digest-")
    assert log.join(None, "digest", state(4)) == first  # its peer, however late
    log.close()
    (marker,) = lines(tmp_path / "audit.jsonl")
    assert marker == {"resume": first, "epoch": 0, "step": 4, "accum_done": 0, "topology_version": 0, "keys": []}


def test_a_crashed_attempt_makes_the_next_load_open_another(tmp_path: Path) -> None:
    log = AttemptLog(str(tmp_path / "audit.jsonl"))
    first = log.join(None, "digest", state(4))
    assert first is not None
    log.crashed(first)
    second = log.join(None, "digest", state(4))
    assert second not in (None, first)
    assert log.join(None, "digest", state(4)) == second  # the restarted job's peers join it
    log.close()
    assert [r["resume"] for r in lines(tmp_path / "audit.jsonl")] == [first, second]


def test_a_known_attempt_is_kept_and_no_checkpoint_means_none(tmp_path: Path) -> None:
    log = AttemptLog(None)  # no audit log: attempts are still kept
    assert log.join("start-1234", "digest", state(0)) == "start-1234"  # a reconnecting client
    assert log.join(None, None, state(0)) is None
    log.write({"keys": ["a"]})  # nowhere to write: dropped
    log.close()


def test_records_are_appended_to_a_private_log_and_dropped_after_close(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AttemptLog(str(path))
    log.write({"keys": ["a"], "since": "x"})
    log.close()
    log.close()  # idempotent
    log.write({"keys": ["b"]})
    assert lines(path) == [{"keys": ["a"], "since": "x"}]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_crash_ends_only_its_own_attempt(tmp_path: Path) -> None:
    log = AttemptLog(str(tmp_path / "audit.jsonl"))
    at_four, at_eight = log.join(None, "four", state(4)), log.join(None, "eight", state(8))
    assert at_four is not None and at_eight is not None
    log.crashed(at_four)
    assert log.join(None, "eight", state(8)) == at_eight
    assert log.join(None, "four", state(4)) != at_four
    log.close()
    assert [r["step"] for r in lines(tmp_path / "audit.jsonl")] == [4, 8, 4]


def test_a_marker_names_the_attempts_still_running_and_verify_keeps_their_deliveries(tmp_path: Path) -> None:
    log = AttemptLog(str(tmp_path / "audit.jsonl"))
    staying = log.join(None, "start", state(0))  # a rank that stays while new ranks join from its checkpoint
    crashed = log.join(None, "other", state(0))
    assert staying is not None and crashed is not None
    log.crashed(crashed)

    def delivery(step: int, since: str) -> dict[str, Any]:
        keys = [f"k{step}-{since[:5]}"]
        return {"epoch": 0, "step": step, "rank": 0, "accum": 0, "micro_batch": step, "keys": keys, "since": since}

    log.write(delivery(7, staying))  # the staying rank's next batch, received before the joiners' marker
    log.write(delivery(7, crashed))  # never committed: the attempt crashed
    joined = log.join(None, "saved", state(7), running=lambda: {staying, crashed})
    log.close()
    marker = lines(tmp_path / "audit.jsonl")[-1]
    assert marker["resume"] == joined and marker["live"] == [staying]  # a crashed attempt is not running
    assert delivered_keys(0, lines(tmp_path / "audit.jsonl"))[0] == [f"k7-{staying[:5]}"]
