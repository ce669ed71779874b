"""`producer_cpus: split`: each producer process (its threads, later ones too, and its decode processes) on a window
of its own of the service's CPUs, re-divided as producers come and go; `any` leaves them to the OS.

Real processes and the kernel's own affinity (``sched_getaffinity`` of every thread in ``/proc``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from feed_service import short_socket_dir
from hypothesis import given
from hypothesis import strategies as st

from omnifeed.loader import FeedConfig, PlanConfig, PoolConfig
from omnifeed.loader.service import FeedService, ServiceConfig
from omnifeed.loader.service._placement import CpuWindows, decode_on_windows, windows
from omnifeed.trainer_adapter import FeedClient

CPUS = sorted(os.sched_getaffinity(0))

# A stand-in for a producer process: threads, a decode process of its own, and a thread started when asked.
_PRODUCER = """
import subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
for _ in range(2):
    threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
print(child.pid, flush=True)
for line in sys.stdin:
    started = threading.Thread(target=time.sleep, args=(120,), daemon=True)
    started.start()
    print(started.native_id, flush=True)
"""


def affinities(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of process ``pid``."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@given(cpus=st.sets(st.integers(0, 255), min_size=1, max_size=96), count=st.integers(1, 200))
def test_windows_cover_every_cpu_and_give_each_producer_at_least_its_share(cpus: set[int], count: int) -> None:
    split = windows(cpus, count)
    assert len(split) == count
    assert set().union(*split) == cpus
    for window in split:
        assert window and len(window) * count >= len(cpus)  # never less than its share
        assert len(window) * count <= len(cpus) + 2 * count  # at most one CPU more at each end
    if len(cpus) % count == 0:  # an exact division: equal windows, no CPU shared
        assert sum(len(w) for w in split) == len(cpus) and len({len(w) for w in split}) == 1


def test_each_producer_process_and_the_threads_it_starts_later_run_on_a_window_of_its_own() -> None:
    producers = [
        subprocess.Popen([sys.executable, "-c", _PRODUCER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        children = [int(p.stdout.readline()) for p in producers]  # type: ignore[union-attr]
        placement = CpuWindows()
        for producer in producers:
            placement.add(producer, producer.pid)
        first, second = windows(CPUS, 2)
        assert placement.placed() == {producers[0].pid: first, producers[1].pid: second}
        assert affinities(producers[0].pid) == affinities(children[0]) == {first}
        assert affinities(producers[1].pid) == affinities(children[1]) == {second}

        producers[0].stdin.write("start a thread\n")  # type: ignore[union-attr]
        producers[0].stdin.flush()  # type: ignore[union-attr]
        later = int(producers[0].stdout.readline())  # type: ignore[union-attr]
        assert os.sched_getaffinity(later) == first  # inherited from the thread that started it

        placement.remove(producers[0])  # gone: the other producer has every CPU again
        assert placement.placed() == {producers[1].pid: frozenset(CPUS)}
        assert affinities(producers[1].pid) == affinities(children[1]) == {frozenset(CPUS)}
    finally:
        for producer in producers:
            producer.kill()
            producer.wait()
        for child in children:
            try:
                os.kill(child, 9)
            except ProcessLookupError:
                pass


def test_a_process_gone_before_it_is_placed_is_skipped() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    placement = CpuWindows()
    placement.add("gone", gone.pid)  # no error: its producer is being replaced
    assert placement.placed() == {gone.pid: frozenset(CPUS)}


@pytest.mark.parametrize("producer_cpus", ["split", "any"])
def test_the_services_producer_processes_each_get_a_window_or_the_whole_node(
    index_dir: Path, producer_cpus: str
) -> None:
    config = ServiceConfig(
        index=str(index_dir),
        socket=str(short_socket_dir() / "feed.sock"),
        feed=FeedConfig(plan=PlanConfig(seed=3, batch_size=2)),
        producers="processes",
        producer_cpus=producer_cpus,
    )
    with FeedService(config) as service:
        clients = [FeedClient(config.socket, rank=rank, world_size=2) for rank in (0, 1)]
        try:
            taken = [threading.Thread(target=lambda c=client: next(iter(c))) for client in clients]
            for thread in taken:
                thread.start()
            for thread in taken:
                thread.join(timeout=120)
            by_rank = {s.key[1]: s.producer.pid for s in service.streams.streams()}
            placed = {rank: affinities(pid) for rank, pid in by_rank.items()}
        finally:
            for client in clients:
                client.close()
    if producer_cpus == "split":
        first, second = windows(CPUS, 2)
        assert placed == {0: {first}, 1: {second}} or placed == {0: {second}, 1: {first}}  # in the order they started
    else:
        assert placed == {0: {frozenset(CPUS)}, 1: {frozenset(CPUS)}}


def test_a_producer_on_a_window_decodes_every_threaded_modality_on_one_thread_a_cpu_keeping_its_buffers() -> None:
    config = FeedConfig(
        pools={"image": PoolConfig(workers=2, buffer_samples=7), "audio": PoolConfig(executor="processes", workers=1)}
    )
    placed = decode_on_windows(config)
    assert placed.shared_workers == "cpus"
    assert placed.pools["image"] == PoolConfig(workers=0, buffer_samples=7)  # its buffer kept
    assert placed.pools["audio"] == config.pools["audio"]  # decode processes stay


@pytest.mark.parametrize(
    ("producer_cpus", "feed", "on_windows"),
    [
        ("split", {}, True),
        ("split", {"shared_workers": 2}, False),  # the config chose its workers: kept
        ("split", {"pools": {"image": {"workers": 3}}}, False),
        ("any", {}, False),
    ],
)
def test_producers_decode_on_one_thread_a_cpu_of_their_window_unless_the_config_chose_its_workers(
    index_dir: Path, producer_cpus: str, feed: dict[str, object], on_windows: bool
) -> None:
    config = ServiceConfig(
        index=str(index_dir),
        socket=str(short_socket_dir() / "feed.sock"),
        feed={"plan": {"seed": 3, "batch_size": 2}, **feed},
        producers="processes",
        producer_cpus=producer_cpus,
    )
    with FeedService(config) as service, FeedClient(config.socket, rank=0, world_size=1) as client:
        next(iter(client))
        (stream,) = service.streams.streams()
        produced_with = FeedConfig.model_validate_json(stream.producer._spec.config_json)
    chosen = FeedConfig.model_validate({"plan": {"seed": 3, "batch_size": 2}, **feed})
    assert (produced_with.shared_workers, produced_with.pools) == (
        ("cpus", decode_on_windows(chosen).pools) if on_windows else (chosen.shared_workers, chosen.pools)
    )
