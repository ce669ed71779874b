"""The in-process client's audit log has the service's attempts: a torchrun-style restart verifies exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnifeed.loader import FeedConfig, PlanConfig, SampleIndex, read_delivery_logs, verify_coverage
from omnifeed.loader.service import ServiceConfig
from omnifeed.trainer_adapter import FeedClient


def _config(index_dir: Path, audit: Path) -> ServiceConfig:
    return ServiceConfig(
        index=str(index_dir),
        feed=FeedConfig(plan=PlanConfig(seed=3, batch_size=4)),
        socket=str(audit.parent / "unused.sock"),
        audit_log=str(audit),
    )


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, port: int) -> None:
    for name, value in {
        "RANK": rank,
        "WORLD_SIZE": world,
        "LOCAL_RANK": rank,
        "TORCHELASTIC_RUN_ID": "job",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }.items():
        monkeypatch.setenv(name, str(value))


def _round(config: ServiceConfig, monkeypatch: pytest.MonkeyPatch, world: int, port: int) -> list[FeedClient]:
    clients = []
    for rank in range(world):
        _torchrun_env(monkeypatch, rank, world, port)
        clients.append(FeedClient.from_torchrun_env(config=config))
    return clients


def test_a_crash_after_uncommitted_steps_and_a_restart_at_another_size_verifies(
    index_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    audit = tmp_path / "audit.jsonl"
    config = _config(index_dir, audit)
    first = _round(config, monkeypatch, world=2, port=29500)  # scale to 2 ranks, train 3 steps
    for step in range(3):
        for client in first:
            client.next_batch()
        if step == 1:
            checkpoint = first[1].state_dict()  # any rank may checkpoint: all hold the same data state
            assert checkpoint == first[0].state_dict()
    for client in first:  # a crash: step 2 was handed out, never committed
        client.close()
    restarted = _round(config, monkeypatch, world=1, port=29511)  # torchrun restarts at 1 rank
    hints = restarted[0].load_state_dict(checkpoint)
    assert hints is not None and hints.world_size == 1
    for _ in restarted[0]:
        pass
    restarted[0].close()
    records = list(read_delivery_logs([audit]))
    markers = [r for r in records if "resume" in r]
    assert [m["step"] for m in markers] == [0, 0, 2]  # each rank marks its attempt at its first delivery
    assert markers[0]["resume"] == markers[1]["resume"] != markers[2]["resume"]
    assert {r["since"] for r in records if "resume" not in r} == {m["resume"] for m in markers}
    report = verify_coverage(SampleIndex(index_dir), 0, records)
    assert report.ok, report.to_json()
    untagged = [{k: v for k, v in r.items() if k != "since"} for r in records if "resume" not in r]
    assert verify_coverage(SampleIndex(index_dir), 0, untagged).duplicates > 0  # what the log said before attempts


def test_the_ranks_of_one_round_share_the_attempt_and_a_later_round_opens_another(
    index_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    audit = tmp_path / "audit.jsonl"
    config = _config(index_dir, audit)
    first = _round(config, monkeypatch, world=2, port=29500)
    for client in first:
        client.next_batch()
    again = _round(config, monkeypatch, world=2, port=29501)
    for client in again:
        client.next_batch()
    for client in first + again:
        client.close()
    attempts = [json.loads(line).get("since") for line in audit.read_text().splitlines()]
    assert attempts[1] == attempts[3] and attempts[5] == attempts[7] and attempts[1] != attempts[5]


def test_two_restarts_from_the_same_checkpoint_verify(index_dir: Path, tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    config = _config(index_dir, audit)
    with FeedClient.in_process(config) as first:
        first.next_batch(), first.next_batch()
        checkpoint = first.state_dict()
        first.next_batch()
    for _ in range(2):  # each restart from the checkpoint delivers past it, then crashes or ends the epoch
        with FeedClient.in_process(config) as again:
            again.load_state_dict(checkpoint)
            again.next_batch()
    with FeedClient.in_process(config) as final:
        final.load_state_dict(checkpoint)
        for _ in final:
            pass
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([audit]))
    assert report.ok, report.to_json()
