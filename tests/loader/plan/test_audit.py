"""Delivery records and the exactly-once check behind `omnifeed verify`: an epoch dealt by a real plan over a
real index verifies; a duplicated, missing or unknown key is found and named; the audit log is private."""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from omnifeed.loader import OmnifeedError, SampleIndex
from omnifeed.loader.plan import (
    Plan,
    PlanConfig,
    PlanCursor,
    delivery_records,
    open_audit_log,
    read_delivery_logs,
    verify_coverage,
)


@pytest.fixture(scope="module")
def index(index_dir: Path) -> SampleIndex:
    return SampleIndex(index_dir)


def epoch_records(index: SampleIndex, epoch: int = 0, world_size: int = 2, grad_accum: int = 2) -> list[dict[str, Any]]:
    """Every record of steps dealt until ``epoch`` is delivered (the last step runs on into the next epoch)."""
    cursor = PlanCursor(
        Plan.from_index(index, PlanConfig(seed=4, batch_size=5)),
        world_size=world_size,
        grad_accum=grad_accum,
        epoch=epoch,
    )
    records: list[dict[str, Any]] = []
    while not cursor.epoch_delivered(epoch):
        records.extend(delivery_records(cursor.next_step(), index))
    return records


def test_a_dealt_epoch_is_delivered_exactly_once(index: SampleIndex) -> None:
    records = epoch_records(index)
    report = verify_coverage(index, 0, records)
    assert report.ok and report.delivered == report.unique == report.samples == index.num_samples
    assert report.to_json()["ok"] is True
    assert {(r["rank"], r["accum"]) for r in records} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert any(r["epoch"] == 1 for r in records), "records of the next epoch are left out of epoch 0's check"


def test_records_of_some_ranks_only(index: SampleIndex) -> None:
    step = PlanCursor(Plan.from_index(index, PlanConfig(batch_size=3)), world_size=4).next_step()
    records = list(delivery_records(step, index, ranks=[2]))
    assert [r["rank"] for r in records] == [2]
    assert records[0]["keys"] == index.keys(step.for_rank(2)[0].positions)


def test_a_duplicated_delivery_is_found_and_its_keys_named(index: SampleIndex) -> None:
    records = epoch_records(index)
    report = verify_coverage(index, 0, [*records, records[3]])
    assert not report.ok and report.duplicates == len(records[3]["keys"]) and report.missing == 0
    assert set(report.examples["duplicated"]) == set(records[3]["keys"][:5])


def test_a_lost_micro_batch_is_found_and_its_keys_named(index: SampleIndex) -> None:
    records = epoch_records(index)
    lost = records.pop(2)
    report = verify_coverage(index, 0, records)
    assert not report.ok and report.missing == len(lost["keys"]) and report.duplicates == 0
    assert set(report.examples["missing"]) == set(lost["keys"])


def test_a_key_the_index_does_not_hold_is_found_and_named(index: SampleIndex) -> None:
    records = epoch_records(index)
    records[0] = {**records[0], "keys": [*records[0]["keys"], "not-in-the-index"]}
    report = verify_coverage(index, 0, records)
    assert not report.ok and report.unknown == 1 and report.examples["unknown"] == ["not-in-the-index"]


def test_a_service_logging_the_same_delivery_twice_counts_it_once(index: SampleIndex) -> None:
    records = [{**r, "since": "attempt-1"} for r in epoch_records(index)]
    assert verify_coverage(index, 0, [*records, records[0]]).ok, "a re-sent batch logged again"
    assert not verify_coverage(index, 0, [*records, {**records[0], "since": "attempt-2"}]).ok


def test_logs_round_trip_through_files_and_stdin(index: SampleIndex, tmp_path: Path) -> None:
    records = epoch_records(index)
    half = len(records) // 2
    with open_audit_log(tmp_path / "rank0.jsonl") as log:
        log.writelines(json.dumps(r) + "\n" for r in records[:half])
    stdin = io.StringIO("\n".join(json.dumps(r) for r in records[half:]) + "\n\n")
    read = list(read_delivery_logs([tmp_path / "rank0.jsonl", "-"], stdin=stdin))
    assert read == records and verify_coverage(index, 0, read).ok


@pytest.mark.parametrize("line", ['{"epoch": 0}', "[1, 2]", '{"keys": ["a"], "epoch": "zero"}', "not json"])
def test_a_malformed_log_line_names_its_file_and_line(tmp_path: Path, line: str) -> None:
    log = tmp_path / "audit.jsonl"
    log.write_text(json.dumps({"epoch": 0, "keys": ["a"]}) + "\n" + line + "\n")
    with pytest.raises(OmnifeedError, match=rf"{log}:2: not a delivery record"):
        list(read_delivery_logs([log]))


def test_the_audit_log_is_created_private_and_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    old_umask = os.umask(0)  # even with a permissive umask
    try:
        with open_audit_log(path) as log:
            log.write("first\n")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with open_audit_log(path) as log:
        log.write("second\n")
    assert path.read_text() == "first\nsecond\n"


def test_a_link_planted_at_the_audit_log_path_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("untouched\n")
    (tmp_path / "audit.jsonl").symlink_to(target)
    with pytest.raises(OmnifeedError, match=r"audit\.jsonl \(it is a symbolic link\)"):
        open_audit_log(tmp_path / "audit.jsonl")
    assert target.read_text() == "untouched\n"


def test_a_fifo_or_a_file_others_can_write_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OmnifeedError, match=r"audit log .*fifo .*remove it"):
        open_audit_log(tmp_path / "fifo")  # refused, not waited on
    shared = tmp_path / "shared.jsonl"
    shared.touch()
    shared.chmod(0o662)
    with pytest.raises(OmnifeedError, match="another user could read or forge its records"):
        open_audit_log(shared)


def test_verify_refuses_a_log_another_user_could_have_written(index: SampleIndex, tmp_path: Path) -> None:
    # A planted or world-writable log could forge the records that decide what verify reports.
    log = tmp_path / "rank0.jsonl"
    with open_audit_log(log) as handle:
        handle.writelines(json.dumps(r) + "\n" for r in epoch_records(index))
    assert verify_coverage(index, 0, list(read_delivery_logs([log]))).ok
    log.chmod(0o666)
    with pytest.raises(OmnifeedError, match=rf"{log} belongs to uid {os.getuid()} with mode 666: another user could "):
        list(read_delivery_logs([log]))
    if os.geteuid() == 0:  # handing the file to another uid needs root
        log.chmod(0o644)
        os.chown(log, 54321, -1)
        with pytest.raises(OmnifeedError, match=rf"{log} belongs to uid 54321"):
            list(read_delivery_logs([log]))
