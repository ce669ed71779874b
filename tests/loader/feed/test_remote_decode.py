"""Decoding on Ray actors of a local two-node cluster: the bytes local decoding makes, each sample once, faults
included."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from decoded_values import same_values

from omnifeed.loader import Feed, FeedConfig, PlanConfig, SampleIndex
from omnifeed.loader.feed._collate import collate
from omnifeed.loader.feed._config import PoolConfig
from omnifeed.loader.feed._pools import DecodePools
from omnifeed.loader.feed._remote import RemoteDecoders
from omnifeed.loader.feed._remote_actor import DecodeActor
from omnifeed.loader.feed._remote_config import RemoteConfig
from omnifeed.loader.feed._remote_state import RemoteSlot
from omnifeed.loader.plan._audit import verify_coverage

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

PLAN = PlanConfig(seed=5, batch_size=4)
REMOTE = RemoteConfig(workers=1, num_cpus=0.25, tasks_per_worker=1, resources={"decode": 1})


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """Two simulated nodes (one CPU each), started once for the module."""
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.worker = None
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def cluster(two_nodes: Any) -> Any:
    """``two_nodes``, this process connected to it, the actors' node (``cluster.worker``) up: a test may remove it."""
    if two_nodes.worker not in two_nodes.worker_nodes:
        two_nodes.worker = two_nodes.add_node(num_cpus=1, resources={"decode": 4})
    if not ray.is_initialized():
        ray.init(address=two_nodes.address, logging_level="WARNING")
    return two_nodes


def remote_config(buffer_samples: int = 256, remote: RemoteConfig = REMOTE, **others: RemoteConfig) -> FeedConfig:
    pools = {
        m: PoolConfig(workers=1, buffer_samples=buffer_samples, remote=others.get(m, remote))
        for m in ("image", "video", "text")
    }
    return FeedConfig(
        plan=PLAN,
        pools={**pools, "audio": PoolConfig(workers=1), "meta": PoolConfig(workers=0)},
        shared_workers=0,
        prefetch_steps=1,
    )


def remote_of(feed: Feed) -> RemoteDecoders:
    remote = feed._reader.remote  # noqa: SLF001  the test looks inside
    assert remote is not None
    return remote


def wait_for_actors(remote: RemoteDecoders) -> None:
    """Until every remote modality has its actor up (they start in the background)."""
    poll(lambda: all(m["workers"] >= 1 for m in remote.snapshot()["modalities"].values()))


def poll(condition: Callable[[], bool], limit_s: float = 120.0) -> None:
    """Until ``condition()`` holds; fails after ``limit_s`` (generous: the machine is shared)."""
    give_up = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < give_up, "the condition did not come true"
        time.sleep(0.1)


def slowed(delays: dict[str, float], first_calls: int | None = None) -> type[DecodeActor]:
    """A `DecodeActor` that sleeps ``delays[modality]`` before each of its first ``first_calls`` decodes (None: all).

    Defined in a function so that Ray ships the class by value to the cluster's workers.
    """

    class SlowDecodeActor(DecodeActor):
        calls = 0

        def decode(self, sample: Any, location: Any, data: bytes | None) -> Any:
            self.calls += 1
            if first_calls is None or self.calls <= first_calls:
                time.sleep(delays.get(location.modality, 0.0))
            return super().decode(sample, location, data)

    return SlowDecodeActor


def numpy_batches(feed: Feed) -> list[dict[str, Any]]:
    return numpy_batches_of(feed, len(feed))


def numpy_batches_of(feed: Feed, count: int) -> list[dict[str, Any]]:
    batches = []
    for _ in range(count):
        taken = feed.take()
        batches.append({k: v for k, v in collate(taken.samples, taken.keys, taken.info).items() if k != "__info__"})
    return batches


@pytest.fixture(scope="module")
def local_batches(index_dir: Path) -> list[dict[str, Any]]:
    with Feed(index_dir, FeedConfig(plan=PLAN)) as feed:
        return numpy_batches(feed)


def test_batches_decoded_on_ray_actors_are_the_bytes_of_local_decoding(
    cluster: Any, index_dir: Path, local_batches: list[dict[str, Any]]
) -> None:
    with Feed(index_dir, remote_config()) as feed:
        wait_for_actors(remote_of(feed))
        got = numpy_batches(feed)
        stats = remote_of(feed).snapshot()["modalities"]
    assert [b["__key__"] for b in got] == [b["__key__"] for b in local_batches]
    assert all(same_values(g, e) for g, e in zip(got, local_batches))
    assert sum(m["decoded"] for m in stats.values()) > 0, stats  # the actors did decode some of it
    assert all(m["lost"] == 0 and m["failed"] == 0 for m in stats.values()), stats


def test_an_actor_killed_and_a_node_removed_mid_epoch_lose_and_duplicate_nothing(
    cluster: Any, index_dir: Path, local_batches: list[dict[str, Any]], tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    with Feed(index_dir, remote_config(buffer_samples=2), audit_log=audit) as feed:
        remote = remote_of(feed)
        wait_for_actors(remote)
        got = []
        for n in range(len(feed)):
            if n == 2:
                ray.kill(remote._mods["image"].actors[0].handle)  # noqa: SLF001
            if n == 5:
                cluster.remove_node(cluster.worker)
            taken = feed.take()
            got.append({k: v for k, v in collate(taken.samples, taken.keys, taken.info).items() if k != "__info__"})
        stats = remote.snapshot()["modalities"]
        bad = {m: s["bad"] for m, s in feed.metrics()["modalities"].items() if s["bad"]}
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    report = verify_coverage(SampleIndex(index_dir), 0, records)
    assert report.ok, report.to_json()
    assert not bad
    assert all(same_values(g, e) for g, e in zip(got, local_batches)) and len(got) == len(local_batches)
    assert sum(m["lost"] for m in stats.values()) >= 1, stats  # tasks that met a dead actor, decoded here
    assert all(m["workers"] == 0 for m in stats.values()), stats  # no node left for actors: all local now
    # Each actor that ran is listed where it ran (the removed node), with its decodes and whether it was lost.
    actors = [a for m in stats.values() for a in m["actors"]]
    assert {a["node"] for a in actors} == {cluster.worker.node_id} and all(a["pid"] > 0 for a in actors), actors
    assert all(sum(a[k] for a in m["actors"]) == m[k] for m in stats.values() for k in ("decoded", "lost")), stats
    assert any(a["state"] == "lost" for a in stats["image"]["actors"]), stats["image"]["actors"]  # the one killed


def test_a_task_past_its_deadline_is_decoded_here_and_the_late_answer_dropped(
    cluster: Any, index_dir: Path, local_batches: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each actor's first answer is late: the image one by less than 3 deadlines (it comes, and is
    # dropped), the video one by far more (the actor is replaced).
    monkeypatch.setattr(RemoteDecoders, "_actor_type", slowed({"image": 1.5, "video": 600.0}, first_calls=1))
    config = remote_config(
        remote=REMOTE.model_copy(update={"deadline_s": 1.0}), video=REMOTE.model_copy(update={"deadline_s": 0.2})
    )
    audit = tmp_path / "audit.jsonl"
    with Feed(index_dir, config, audit_log=audit) as feed:
        remote = remote_of(feed)
        wait_for_actors(remote)
        got = numpy_batches(feed)
        poll(lambda: remote.snapshot()["modalities"]["video"]["lost"] >= 1)
        poll(lambda: remote.snapshot()["modalities"]["image"]["overdue"] == 0)  # the late answer came, unused
        stats = remote.snapshot()["modalities"]
        bad = {m: s["bad"] for m, s in feed.metrics()["modalities"].items() if s["bad"]}
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert verify_coverage(SampleIndex(index_dir), 0, records).ok
    assert not bad
    assert len(got) == len(local_batches) and all(same_values(g, e) for g, e in zip(got, local_batches))
    assert stats["image"]["reissued"] >= 1 and stats["video"]["reissued"] >= 1, stats


@pytest.mark.soak
def test_the_pool_grows_while_its_modality_starves_and_shrinks_when_idle(
    cluster: Any, index_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RemoteDecoders, "_actor_type", slowed({"image": 0.2}))
    elastic = REMOTE.model_copy(update={"max_workers": 2, "grow_after_s": 0.5, "shrink_after_s": 1.0})
    config = FeedConfig(plan=PLAN, pools={"image": PoolConfig(workers=1, remote=elastic)}, shared_workers=0)
    sample = next(
        s for s in SampleIndex(index_dir).samples(list(range(48))) if any(f.modality == "image" for f in s.fields)
    )
    location = next(f for f in sample.fields if f.modality == "image")
    errors: list[BaseException] = []
    targets: list[int] = []
    with Feed(index_dir, config) as feed:  # not read from: its remote decoders serve the pools below
        remote = remote_of(feed)
        wait_for_actors(remote)
        pools = DecodePools(config, remote=remote)

        def task(slot: RemoteSlot | None) -> int:
            if remote.decode(sample, location, slot) is None:  # a local worker: as slow as the actor
                time.sleep(0.2)
            return 0

        def grown() -> bool:
            while owner.buffers().get("image", {}).get("queued", 0) < 8:  # clients wait on images
                owner.submit("image", task)
            targets.append(remote.snapshot()["modalities"]["image"]["target"])
            return remote.snapshot()["modalities"]["image"]["workers"] == 2

        try:
            with pools.owner(errors.append) as owner:
                poll(grown)
            poll(lambda: targets.append(remote.snapshot()["modalities"]["image"]["target"]) or targets[-1] == 1)
            poll(lambda: remote.snapshot()["modalities"]["image"]["workers"] == 1)
            stats = remote.snapshot()["modalities"]["image"]
        finally:
            pools.close()
    assert not errors
    assert max(targets) == 2 and stats["resized"] >= 2, (targets, stats)  # up to the cap, and down again
    assert stats["decoded"] > 0 and stats["lost"] == 0, stats


def free_port() -> int:
    """A local TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_remote_workers_come_back_with_the_cluster_and_go_when_it_goes(
    cluster: Any, index_dir: Path, local_batches: list[dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ray.shutdown()  # the feed makes (and drops) its own connection
    port = free_port()
    config = remote_config(
        buffer_samples=2, remote=REMOTE.model_copy(update={"address": f"127.0.0.1:{port}", "retry_s": 0.5})
    )
    audit = tmp_path / "audit.jsonl"
    later: Any = None
    try:
        with caplog.at_level(logging.WARNING), Feed(index_dir, config, audit_log=audit) as feed:
            remote = remote_of(feed)
            got = numpy_batches_of(feed, 2)  # nothing answers at the address yet: local workers
            assert remote.snapshot()["connected"] is False
            later = cluster_utils.Cluster(
                initialize_head=True,
                head_node_args={"gcs_server_port": port, "num_cpus": 1, "resources": {"decode": 4}},
            )
            wait_for_actors(remote)
            got += numpy_batches_of(feed, 4)
            remote_decoded = sum(m["decoded"] for m in remote.snapshot()["modalities"].values())
            # The head machine goes away: its GCS first. (Its raylet is also this process's: Ray ends a
            # driver whose raylet dies, so the feed must drop the connection before that.)
            later.head_node.kill_gcs_server()
            poll(lambda: not remote.snapshot()["connected"])
            got += numpy_batches_of(feed, len(local_batches) - len(got))
            snapshot = remote.snapshot()
    finally:
        if later is not None:
            ray.shutdown()  # if the feed did not: removing the node of a connected driver is refused
            later.shutdown()
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert verify_coverage(SampleIndex(index_dir), 0, records).ok
    assert len(got) == len(local_batches) and all(same_values(g, e) for g, e in zip(got, local_batches))
    assert remote_decoded > 0  # the actors decoded while the cluster was up
    assert snapshot["outages"] == 2 and all(m["workers"] == 0 for m in snapshot["modalities"].values()), snapshot
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 2  # one warning per outage


def test_a_pool_with_no_local_workers_and_executor_ray_decodes_every_field_on_the_actors(
    cluster: Any, index_dir: Path, local_batches: list[dict[str, Any]]
) -> None:
    config = remote_config()
    pools = {**config.pools, "image": PoolConfig(executor="ray", workers=0, remote=REMOTE)}
    with Feed(index_dir, config.model_copy(update={"pools": pools})) as feed:
        wait_for_actors(remote_of(feed))
        got = numpy_batches(feed)
        stats = remote_of(feed).snapshot()["modalities"]
    assert [b["__key__"] for b in got] == [b["__key__"] for b in local_batches]
    assert all(same_values(g, e) for g, e in zip(got, local_batches))
    images = sum(len(b["image"]["sizes"]) for b in got if "image" in b)
    assert images > 0 and stats["image"]["decoded"] == images, stats  # none decoded here: no local worker
