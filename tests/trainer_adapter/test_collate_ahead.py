"""The in-process client collates its next batch ahead on a thread; what the trainer sees follows those yielded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from omnifeed.loader import FeedConfig, PlanConfig, SampleIndex, read_delivery_logs, verify_coverage
from omnifeed.loader.feed import FeedPosition
from omnifeed.loader.service import ServiceConfig
from omnifeed.trainer_adapter import FeedClient


def _config(index_dir: Path, audit: Path) -> ServiceConfig:
    return ServiceConfig(
        index=str(index_dir),
        feed=FeedConfig(plan=PlanConfig(seed=5, batch_size=4)),
        socket=str(audit.parent / "unused.sock"),
        audit_log=str(audit),
    )


def _keys(batch: dict[str, Any]) -> list[str]:
    return list(batch["__key__"])


def _made_ahead(client: FeedClient) -> None:
    """Wait until the client's thread has taken a batch from its feed beyond those yielded."""
    feed = client._source.feed  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while feed.position == FeedPosition.from_dict(client.state_dict()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert feed.position != FeedPosition.from_dict(client.state_dict()), "the thread ahead made no batch"


def test_the_state_and_the_audit_log_count_the_batches_yielded_not_those_collated_ahead(
    index_dir: Path, tmp_path: Path
) -> None:
    with FeedClient.in_process(_config(index_dir, tmp_path / "reference.jsonl"), collate_ahead=0) as reference:
        expected = [_keys(batch) for batch in reference]
    with FeedClient.in_process(_config(index_dir, tmp_path / "reference.jsonl"), collate_ahead=0) as reference:
        for _ in range(3):
            reference.next_batch()
        after_three = reference.state_dict()

    audit = tmp_path / "audit.jsonl"
    with FeedClient.in_process(_config(index_dir, audit)) as client:
        got = [_keys(client.next_batch()) for _ in range(3)]
        _made_ahead(client)
        assert client.state_dict() == after_three
        assert len(client) == len(expected) - 3
        delivered = [r for r in read_delivery_logs([audit]) if "resume" not in r]
        assert len(delivered) == 3  # the batch made ahead is not delivered yet
        client.load_state_dict(client.state_dict())  # a checkpoint reloaded: the batch made ahead is dropped
        got += [_keys(batch) for batch in client]
    assert got == expected
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([audit]))
    assert report.ok, report.to_json()


def test_batches_made_ahead_and_never_yielded_are_not_delivered(index_dir: Path, tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    with FeedClient.in_process(_config(index_dir, audit)) as client:
        for _ in client:
            pass  # the epoch; the thread has gone on into the next one
        _made_ahead(client)
        position = FeedPosition.from_dict(client.state_dict())
    assert position.epoch == 1
    records = list(read_delivery_logs([audit]))
    assert {r["epoch"] for r in records if "resume" not in r} == {0}
    report = verify_coverage(SampleIndex(index_dir), 0, records)
    assert report.ok, report.to_json()


def test_a_resize_at_a_step_boundary_drops_what_was_made_ahead_and_delivers_every_sample_once(
    index_dir: Path, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    config = _config(index_dir, audit)
    clients = [FeedClient.in_process(config, rank=r, world_size=2, round_token="round") for r in range(2)]
    for _ in range(2):
        for client in clients:
            client.next_batch()
    _made_ahead(clients[0])
    clients[1].close()
    clients[0].resize(1, 0)  # the other rank left: this one takes the rest of the epoch
    for _ in clients[0]:
        pass
    clients[0].close()
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([audit]))
    assert report.ok, report.to_json()


@pytest.mark.parametrize("ahead", [-1])
def test_a_negative_collate_ahead_is_refused(index_dir: Path, tmp_path: Path, ahead: int) -> None:
    with pytest.raises(ValueError, match="collate_ahead must be 0 or more"):
        FeedClient.in_process(_config(index_dir, tmp_path / "a.jsonl"), collate_ahead=ahead)
