"""Resizes through the service and in-process: exactly-once across 2 → 1 → 3, hints, refusals, hand-over."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch
from feed_service import short_socket_dir

from omnifeed.loader import FeedConfig, FeedError, PlanConfig, SampleIndex, read_delivery_logs, verify_coverage
from omnifeed.loader.service._config import ServiceConfig
from omnifeed.loader.service._protocol import ServiceError
from omnifeed.loader.service._server import FeedService
from omnifeed.trainer_adapter import FeedClient, scale_learning_rate, topology_hints


def service_config(index_dir: Path, audit: Path, batch_size: int = 2) -> ServiceConfig:
    return ServiceConfig(
        index=str(index_dir),
        feed=FeedConfig(plan=PlanConfig(seed=5, batch_size=batch_size)),
        socket=str(short_socket_dir() / "feed.sock"),
        audit_log=str(audit),
        stream_idle_s=60,
    )


def step(clients: list[FeedClient]) -> None:
    """One training step: every rank takes its micro-batch."""
    for client in clients:
        client.next_batch()


def finish_epoch(clients: list[FeedClient]) -> None:
    threads = [threading.Thread(target=lambda c=c: [None for _ in c]) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)


@pytest.mark.parametrize("in_process", [False, True], ids=["service", "in-process"])
def test_two_to_one_to_three_ranks_deliver_the_epoch_exactly_once(
    index_dir: Path, tmp_path: Path, in_process: bool
) -> None:
    audit = tmp_path / "audit.jsonl"
    config = service_config(index_dir, audit)
    service = None if in_process else FeedService(config)

    def client(rank: int, world: int) -> FeedClient:
        if in_process:
            return FeedClient.in_process(
                config.model_copy(update={"audit_log": str(tmp_path / f"audit-{rank}-{world}.jsonl")}),
                rank=rank,
                world_size=world,
            )
        return FeedClient(config.socket, rank=rank, world_size=world)

    if service is not None:
        service.start()
    try:
        ranks = [client(0, 2), client(1, 2)]
        for _ in range(3):
            step(ranks)
        ranks[1].close()  # a node is lost at a step boundary
        hints = ranks[0].resize(1, 0)
        assert (hints.world_size, hints.previous_world_size, hints.topology_version) == (1, 2, 1)
        assert hints.global_batch_samples == 2 and hints.keep_global_batch_grad_accum == 2
        assert hints.lr_scale == pytest.approx(0.5)
        for _ in range(4):
            step(ranks[:1])
        saved = ranks[0].state_dict()  # the job grows: new ranks start from the last checkpoint
        ranks[0].resize(3, 0)
        joined = [client(1, 3), client(2, 3)]
        for new in joined:
            grown = new.load_state_dict(saved)
            assert grown is not None and (grown.world_size, grown.previous_world_size) == (3, 1)
            assert grown.lr_scale == pytest.approx(3.0)
        assert [c.state_dict() for c in joined] == [ranks[0].state_dict()] * 2
        everyone = [ranks[0], *joined]
        finish_epoch(everyone)
        for c in everyone:
            c.close()
        if service is not None:
            assert service.metrics()["resizes"] == 2
    finally:
        if service is not None:
            service.stop()
    logs = [audit] if not in_process else sorted(tmp_path.glob("audit-*.jsonl"))
    records = list(read_delivery_logs(logs))
    report = verify_coverage(SampleIndex(index_dir), 0, records)
    assert report.ok, report.to_json()
    assert {r["topology_version"] for r in records if r["epoch"] == 0} == {0, 1, 2}


@pytest.mark.parametrize("producers", ["threads", "processes"])
def test_prefetched_batches_are_handed_over_to_the_new_ranks_not_decoded_again(
    index_dir: Path, tmp_path: Path, producers: str
) -> None:
    config = service_config(index_dir, tmp_path / "audit.jsonl").model_copy(update={"producers": producers})
    with FeedService(config) as service:
        ranks = [FeedClient(config.socket, rank=r, world_size=2) for r in range(2)]
        step(ranks)
        # The streams read ahead in the background (how soon depends on the machine's load). Each client holds the
        # batch it took and the one it received ahead (2 ranks x 2 batches x 2 samples): wait for twice that, so
        # the streams have batches of their own ready, which the resize must hand over.
        for _ in range(600):
            if service.metrics()["samples"] >= 2 * 2 * 2 * 2:
                break
            time.sleep(0.1)
        ranks[1].close()
        prefetched = service.metrics()["samples"]
        ranks[0].resize(1, 0)  # both old streams are client-less now: their ready batches go to the new stream
        finish_epoch(ranks[:1])
        ranks[0].close()
        snapshot = service.metrics()
    assert snapshot["handed_over"] >= 1  # (how many the old streams had prefetched depends on load)
    assert snapshot["last_resize_s"] > 0
    assert prefetched >= 2 * 2 * 2 * 2  # (the streams had read ahead before the resize)
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([tmp_path / "audit.jsonl"]))
    assert report.ok, report.to_json()


def test_a_resize_in_the_middle_of_a_step_is_refused(index_dir: Path, tmp_path: Path) -> None:
    config = service_config(index_dir, tmp_path / "audit.jsonl")
    with FeedService(config), FeedClient(config.socket, rank=0, world_size=1, grad_accum=2) as client:
        client.next_batch()
        with pytest.raises(FeedError, match="finish the step first"):
            client.resize(2, 0)
        client.next_batch()
        assert client.resize(2, 0).keep_global_batch_grad_accum == 1


def test_a_state_of_another_batching_config_is_refused_naming_both_fingerprints(
    index_dir: Path, tmp_path: Path
) -> None:
    config = service_config(index_dir, tmp_path / "audit.jsonl")
    other = FeedClient.in_process(service_config(index_dir, tmp_path / "other.jsonl", batch_size=3))
    foreign = other.state_dict()
    other.close()
    with FeedService(config), FeedClient(config.socket) as client:
        with pytest.raises(ServiceError, match="config_fingerprint") as refused:
            client.load_state_dict(foreign)
        assert refused.value.code == "fingerprint"
        assert foreign["plan"]["config_fingerprint"] in str(refused.value)


@pytest.mark.parametrize(("rule", "scale"), [("linear", 1.5), ("sqrt", math.sqrt(1.5)), ("none", 1.0)])
def test_hints_scale_the_learning_rate_by_the_rule(rule: str, scale: float) -> None:
    hints = topology_hints(
        world_size=6,
        previous_world_size=4,
        grad_accum=1,
        previous_grad_accum=1,
        topology_version=3,
        micro_batch_samples=8,
        micro_batch_cost=None,
        lr_rule=rule,
    )  # type: ignore[arg-type]
    assert hints.lr_scale == pytest.approx(scale)
    assert hints.global_batch_samples == 48 and hints.global_batch_cost is None
    assert hints.keep_global_batch_grad_accum is None  # 4 ranks' batch is not a whole number of 6-rank steps
    budget = topology_hints(
        world_size=2,
        previous_world_size=8,
        grad_accum=1,
        previous_grad_accum=1,
        topology_version=1,
        micro_batch_samples=None,
        micro_batch_cost=4096.0,
    )
    assert budget.keep_global_batch_grad_accum == 4 and budget.global_batch_cost == 8192.0
    assert budget.global_batch_samples is None


def test_scale_learning_rate_touches_every_param_group_and_the_schedulers_base() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.01}])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    scale_learning_rate(optimizer, 0.5)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.005])
    assert [g["initial_lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.005])
    assert scheduler.base_lrs  # the scheduler still works with the scaled groups
    with pytest.raises(ValueError):
        scale_learning_rate(optimizer, 0.0)


def test_batches_held_across_a_resize_and_a_close_are_never_overwritten(index_dir: Path, tmp_path: Path) -> None:
    config = service_config(index_dir, tmp_path / "audit.jsonl")
    with FeedService(config):
        client = FeedClient(config.socket, rank=0, world_size=2)
        held = [client.next_batch() for _ in range(2)]
        copies = [{k: v.clone() for k, v in b.get("image", {}).items()} for b in held]
        client.resize(1, 0)
        more = [client.next_batch() for _ in range(8)]  # enough to cycle every segment of the new stream
        client.close()
        other = FeedClient(config.socket, rank=0, world_size=1)
        other.load_state_dict(client.state_dict())
        for _ in range(8):
            other.next_batch()
        other.close()
        for batch, copy in zip(held, copies):
            for name, value in copy.items():
                assert torch.equal(batch["image"][name], value), name
        assert all(b["__key__"] for b in more)


def test_a_plain_training_loop_gives_every_batch_back_and_reuses_its_segments(index_dir: Path, tmp_path: Path) -> None:
    config = service_config(index_dir, tmp_path / "audit.jsonl")
    with FeedService(config) as service, FeedClient(config.socket) as client:
        for _ in range(2):
            for batch in client:  # the previous batch is still bound while the next is asked for
                assert batch["__key__"]
        snapshot = service.metrics()["service"]
    assert snapshot["one_off_segments"] == 0  # every batch went back: slots were reused, none had to be added
    assert snapshot["segments"] <= config.prefetch_batches + 4
