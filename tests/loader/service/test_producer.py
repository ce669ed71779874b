"""`producers: processes`: each stream's batches made in a process of its own, behind a real `omnifeed serve`.

What a user would notice: the same batches as in-process feeds, each sample exactly once (the
audit log), the decode metrics of the processes in the service's, a killed producer process costing
a wait and no sample, and a killed service leaving no process behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from feed_service import ServiceProcess, short_socket_dir, write_config
from pydantic import ValidationError

from omnifeed.loader import (
    Feed,
    FeedConfig,
    IndexConfig,
    PlanConfig,
    SampleIndex,
    build_index,
    read_delivery_logs,
    verify_coverage,
)
from omnifeed.loader.feed import FeedPosition, collate
from omnifeed.loader.plan import Plan
from omnifeed.loader.service import ServiceConfig
from omnifeed.loader.service._arena import Segment, decode_arrays
from omnifeed.loader.service._producer import ChildProducer, ProducerSpec
from omnifeed.loader.service._producer_metrics import counters_of, merged_metrics
from omnifeed.loader.service._protocol import ServiceError, request_metrics
from omnifeed.loader.service._slots import SegmentSlots
from omnifeed.trainer_adapter import FeedClient


def planned_keys(index_dir: Path, world: int, rank: int) -> list[list[str]]:
    with Feed(index_dir, FeedConfig(plan=PlanConfig(seed=3, batch_size=4)), world_size=world, rank=rank) as feed:
        return [batch["__key__"] for batch in feed]


def start_service(index_dir: Path, folder: Path, **extra: object) -> ServiceProcess:
    socket = short_socket_dir() / "feed.sock"
    audit = folder / "audit.jsonl"
    config = write_config(folder, index_dir, socket=socket, audit_log=audit, producers="processes", **extra)
    return ServiceProcess(config, socket).start()


def test_producer_processes_deliver_the_in_process_feeds_batches_each_sample_once(
    index_dir: Path, tmp_path: Path
) -> None:
    service = start_service(index_dir, tmp_path)
    got: dict[int, list[list[str]]] = {}

    def read(rank: int) -> None:
        with FeedClient(str(service.socket), rank=rank, world_size=2) as client:
            got[rank] = [batch["__key__"] for batch in client]

    try:
        readers = [threading.Thread(target=read, args=(rank,)) for rank in (0, 1)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=120)
        snapshot = request_metrics(str(service.socket))
    finally:
        service.stop()
    assert got == {rank: planned_keys(index_dir, 2, rank) for rank in (0, 1)}
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([tmp_path / "audit.jsonl"]))
    assert report.ok, report.to_json()
    assert len(snapshot["service"]["producer_pids"]) == 2 and snapshot["service"]["producer_restarts"] == 0
    assert sum(m["decoded"] for m in snapshot["modalities"].values()) > 0  # the processes' decoding is counted


def test_a_killed_producer_process_costs_a_wait_not_a_sample(index_dir: Path, tmp_path: Path) -> None:
    service = start_service(index_dir, tmp_path)
    try:
        with FeedClient(str(service.socket), rank=0, world_size=1) as client:
            batches = iter(client)
            keys = [next(batches)["__key__"] for _ in range(3)]
            before = request_metrics(str(service.socket))
            (pid,) = before["service"]["producer_pids"]
            os.kill(pid, signal.SIGKILL)
            keys.append(next(batches)["__key__"])  # from the process that replaced it
            after_restart = request_metrics(str(service.socket))
            keys += [batch["__key__"] for batch in batches]
        snapshot = request_metrics(str(service.socket))
    finally:
        service.stop()
    assert keys == planned_keys(index_dir, 1, 0)
    assert after_restart["samples"] >= before["samples"]  # what the killed process counted stays counted
    report = verify_coverage(SampleIndex(index_dir), 0, read_delivery_logs([tmp_path / "audit.jsonl"]))
    assert report.ok, report.to_json()
    assert snapshot["service"]["producer_restarts"] == 1 and snapshot["service"]["producer_pids"] != [pid]
    assert "died" in service.output()  # the service's log says so


def test_what_a_closed_producer_counted_stays_in_the_metrics(index_dir: Path, tmp_path: Path) -> None:
    service = start_service(index_dir, tmp_path, stream_idle_s=0)  # a stream closes once its client leaves
    scraped: list[dict[str, Any]] = []
    closed = threading.Event()

    def scrape() -> None:  # as Prometheus would, also while the stream closes
        while not closed.is_set():
            snapshot = request_metrics(str(service.socket))
            scraped.append(snapshot)
            if snapshot["service"]["streams"] == 0 and snapshot["service"]["producer_pids"] == []:
                closed.set()

    try:
        with FeedClient(str(service.socket), rank=0, world_size=1) as client:
            batches = iter(client)
            taken = sum(len(next(batches)["__key__"]) for _ in range(3))
            scraper = threading.Thread(target=scrape)
            scraper.start()
        closed.wait(timeout=60)
        closed.set()
        scraper.join()
    finally:
        service.stop()
    assert scraped[-1]["service"]["streams"] == 0 and scraped[-1]["service"]["producer_pids"] == []
    samples = [snapshot["samples"] for snapshot in scraped]
    assert samples == sorted(samples) and samples[-1] >= taken  # counters never go back, also mid-close
    assert scraped[-1]["modalities"]["image"]["decoded"] > 0


def test_a_broken_dataset_stops_the_stream_with_the_feeds_error_not_a_producer_death(
    demo_shards: list[Path], tmp_path: Path
) -> None:
    shards = [Path(shutil.copy(p, tmp_path / p.name)) for p in demo_shards]
    index = build_index([str(p) for p in shards], tmp_path / "index", IndexConfig(workers=1), progress=False).path
    shards[0].unlink()  # its samples' reads fail (an OSError in the producer process)
    feed = {"plan": {"seed": 3, "batch_size": 4}, "error_budget": 0.01, "error_budget_min_samples": 8}
    service = start_service(index, tmp_path, feed=feed)
    try:
        with (
            FeedClient(str(service.socket), rank=0, world_size=1) as client,
            pytest.raises(ServiceError, match=r"FeedError: .*over the error budget.*shard-0000\.tar"),
        ):
            for _ in client:
                pass
        snapshot = request_metrics(str(service.socket))
    finally:
        service.stop()
    assert snapshot["service"]["producer_restarts"] == 0  # the process was fine: the data was not


def test_a_killed_service_leaves_no_producer_process_behind(index_dir: Path, tmp_path: Path) -> None:
    service = start_service(index_dir, tmp_path)
    try:
        with FeedClient(str(service.socket), rank=0, world_size=2, reconnect_timeout_s=0) as client:
            next(iter(client))
            producers = request_metrics(str(service.socket))["service"]["producer_pids"]
            descendants = psutil.Process(service.pid).children(recursive=True)
            assert producers and set(producers) <= {p.pid for p in descendants}
            service.kill()
    finally:
        service.stop()
    _, alive = psutil.wait_procs([*descendants, *map(psutil.Process, producers)], timeout=20)
    for process in alive:
        process.kill()
    assert alive == []


def test_metrics_of_several_engines_add_up_and_keep_the_largest_latency() -> None:
    one = {
        "samples": 4,
        "samples_per_s": 2.0,
        "elapsed_s": 2.0,
        "storage_degraded": False,
        "modalities": {"image": {"decoded": 3, "buffer_samples": 2}},
    }
    two = {
        "samples": 6,
        "samples_per_s": 6.0,
        "elapsed_s": 1.0,
        "storage_degraded": True,
        "modalities": {"image": {"decoded": 1, "decode_latency_s": {"p50": 0.2}}, "text": {"decoded": 5}},
    }
    merged = merged_metrics([one, two])
    assert merged == {
        "samples": 10,
        "samples_per_s": 5.0,  # over the longest elapsed time, not the sum of the rates
        "elapsed_s": 2.0,
        "storage_degraded": True,
        "modalities": {
            "image": {"decoded": 4, "buffer_samples": 2, "decode_latency_s": {"p50": 0.2}},
            "text": {"decoded": 5},
        },
    }
    assert one["modalities"] == {"image": {"decoded": 3, "buffer_samples": 2}}  # its inputs are left as they were
    # a closed engine's counts stay, its buffers go
    assert counters_of(one)["modalities"] == {"image": {"decoded": 3}} and counters_of(one)["samples"] == 4


def test_producers_are_processes_unless_a_modality_decodes_on_the_services_ray_actors() -> None:
    on_ray = FeedConfig.model_validate({"pools": {"image": {"workers": 1, "remote": {"workers": 1}}}})
    assert ServiceConfig(index="data/index").producer_processes
    assert not ServiceConfig(index="data/index", feed=on_ray).producer_processes  # auto: the actors are the service's
    assert not ServiceConfig(index="data/index", producers="threads").producer_processes
    with pytest.raises(ValidationError, match="producers: processes cannot decode image on Ray"):
        ServiceConfig(index="data/index", feed=on_ray, producers="processes")


_IN_A_DAEMON = """
import multiprocessing, sys
from omnifeed.loader.service import FeedService, ServiceConfig

def build(answers, producers):
    try:
        service = FeedService(ServiceConfig(index=sys.argv[1], socket=sys.argv[2], producers=producers))
        answers.put(service.producer_processes)
        service.stop()
    except ValueError as exc:
        answers.put(str(exc))

if __name__ == "__main__":
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    for producers in ("auto", "processes"):
        process = context.Process(target=build, args=(answers, producers), daemon=True)
        process.start()
        print(repr(answers.get(timeout=120)))
        process.join()
"""


def test_a_service_in_a_daemonic_process_decodes_in_threads_or_says_why_not(index_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "daemon.py"
    script.write_text(_IN_A_DAEMON)
    run = subprocess.run(
        [sys.executable, str(script), str(index_dir), str(short_socket_dir() / "feed.sock")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    auto, processes = run.stdout.splitlines()
    assert auto == "False"  # auto: a daemon cannot start producer processes, so its streams use threads
    assert "cannot start producer processes from a daemonic process" in processes and "producers: threads" in processes


def test_a_batch_larger_than_its_segment_is_collated_again_into_a_grown_one(index_dir: Path) -> None:
    large = FeedConfig(plan=PlanConfig(seed=3, batch_size=4), decode={"image": {"resize": "fixed", "size": 640}})
    plan = Plan.from_index(SampleIndex(index_dir), large.plan)
    producer = ChildProducer(ProducerSpec(str(index_dir), large.model_dump_json(), (1, 0, 1)))
    producer.start_at(FeedPosition.start(plan))
    slots = SegmentSlots()

    def grow(segment: Segment, needed: int) -> Segment:
        grown = slots.grow(segment, needed)
        segment.close()
        return grown

    try:
        produced = [producer.produce(seq, lambda: slots.take(limit=4), grow) for seq in range(4)]
        batches = [decode_arrays(p.frame, p.segment.base) for p in produced]
    finally:
        producer.close()
    assert slots.size > 1 << 20  # four 640 x 640 images do not fit the first segment (1 MiB)
    with Feed(index_dir, large) as feed:
        for batch in batches:
            taken = feed.take()
            expected = collate(taken.samples, taken.keys, taken.info)
            assert batch["__key__"] == expected["__key__"]
            if "image" in expected:
                assert np.array_equal(batch["image"]["pixels"], expected["image"]["pixels"])
    slots.close()
