"""One set of decode workers shared by several owners (one per pipeline): budgets, isolation, fairness, lifecycle."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omnifeed.loader import Feed, FeedConfig, IndexConfig, PlanConfig, PlanCursor, PoolConfig, SampleIndex, build_index
from omnifeed.loader._modalities import FIELD_MODALITIES
from omnifeed.loader.feed import DecodeEngine
from omnifeed.loader.feed._collate import collate
from omnifeed.loader.feed._pipeline import Pipeline
from omnifeed.loader.feed._pools import DecodePools, PoolOwner
from omnifeed.loader.feed._torch_batch import to_torch
from omnifeed.loader.plan._plan import Plan

WAIT = 10.0  # seconds: generous, only ever reached when something is broken


def text_only(workers: int = 1, shared: int = 0, buffer_samples: int = 2, buffer_bytes: int = 2**20) -> FeedConfig:
    text = PoolConfig(workers=workers, buffer_samples=buffer_samples, buffer_bytes=buffer_bytes)
    return FeedConfig(pools={"text": text}, shared_workers=shared)


@pytest.fixture()
def pools() -> Iterator[DecodePools]:
    with DecodePools(text_only()) as pools:
        yield pools


class Errors(list[BaseException]):
    """An owner's on_error: collects what it is told."""

    def __call__(self, exc: BaseException) -> None:
        self.append(exc)


def admits(owner: PoolOwner, n: int, within: float = WAIT) -> bool:
    """Whether ``owner`` admits ``n`` text samples within ``within`` seconds (the wait is abandoned after)."""
    stopping, result = threading.Event(), []
    waiter = threading.Thread(target=lambda: result.append(owner.admit({"text": n}, stopping)))
    waiter.start()
    waiter.join(within)
    stopping.set()
    waiter.join()
    return result == [True]


def task(
    done: threading.Event,
    nbytes: int = 1,
    gate: threading.Event | None = None,
    log: list[Any] | None = None,
    name: object = None,
    started: threading.Event | None = None,
) -> Callable[[object], int]:
    """A small task: waits for ``gate`` (if any), logs (name, thread), sets ``done``, returns ``nbytes``."""

    def run(remote: object) -> int:
        if started is not None:
            started.set()
        if gate is not None:
            assert gate.wait(WAIT)
        if log is not None:
            log.append((name, threading.current_thread()))
        done.set()
        return nbytes

    return run


def run_one(owner: PoolOwner, nbytes: int = 1) -> None:
    """Admit, decode and wait for one text sample of ``owner`` (not released)."""
    assert admits(owner, 1)
    done = threading.Event()
    owner.submit("text", task(done, nbytes))
    assert done.wait(WAIT)


def test_each_owner_has_its_own_sample_budget(pools: DecodePools) -> None:
    a, b = pools.owner(Errors()), pools.owner(Errors())
    run_one(a)
    run_one(a)
    assert not admits(a, 1, within=0.3), "owner a's buffer of 2 is full"
    run_one(b)
    run_one(b)  # b has its own 2
    a.release("text", 2, 2)
    assert admits(a, 1) and not admits(b, 1, within=0.3)
    assert a.buffers()["text"]["buffer_samples"] == 0 and b.buffers()["text"]["buffer_samples"] == 2


def test_each_owner_has_its_own_byte_budget() -> None:
    with DecodePools(text_only(buffer_samples=100, buffer_bytes=100)) as pools:
        a, b = pools.owner(Errors()), pools.owner(Errors())
        run_one(a, nbytes=150)
        assert not admits(a, 1, within=0.3), "owner a holds more decoded bytes than its budget"
        run_one(b, nbytes=50)
        run_one(b, nbytes=40)
        a.release("text", 1, 150)
        assert admits(a, 1)
        assert pools.buffers()["text"]["buffer_bytes"] == 90


def test_closing_one_owner_drops_its_tasks_and_leaves_the_other_running(pools: DecodePools) -> None:
    a, b = pools.owner(Errors()), pools.owner(Errors())
    gate, started, running = threading.Event(), threading.Event(), threading.Event()
    dropped, other = threading.Event(), threading.Event()
    assert admits(a, 2) and admits(b, 1)
    a.submit("text", task(running, gate=gate, started=started))  # the only worker: busy until the gate opens
    assert started.wait(WAIT)
    a.submit("text", task(dropped))
    b.submit("text", task(other))
    closing = threading.Thread(target=a.close)
    closing.start()
    gate.set()
    closing.join(WAIT)
    assert not closing.is_alive() and running.is_set(), "close waits for the owner's running task"
    assert other.wait(WAIT), "the other owner's queued task still runs"
    run_one(b)
    assert not dropped.is_set() and not admits(a, 1, within=0.3)
    a.submit("text", task(dropped))  # a closed owner's submissions are dropped
    b.release("text", 2, 2)
    run_one(b)
    assert not dropped.is_set()


def test_a_failing_task_reports_to_its_own_owner_only() -> None:
    errors_a, errors_b, logged = Errors(), Errors(), Errors()
    pools = DecodePools(text_only(), logged)
    a, b = pools.owner(errors_a), pools.owner(errors_b)

    def broken(remote: object) -> int:
        raise ValueError("bad field")

    assert admits(a, 1)
    a.submit("text", broken)
    run_one(b)  # one worker, FIFO: a's task ran before b's
    assert [str(e) for e in errors_a] == ["bad field"] and errors_b == [] and logged == errors_a
    a.close()
    pools.close()  # b is still open: told, a is not
    assert len(errors_a) == 1 and len(errors_b) == 1 and isinstance(errors_b[0], RuntimeError)


def test_owners_share_the_same_worker_threads() -> None:
    before = set(threading.enumerate())
    config = text_only(workers=2, shared=1)
    with DecodePools(config) as pools:
        workers = set(threading.enumerate()) - before
        assert len(workers) == sum(config.pool(m).workers for m in FIELD_MODALITIES) + 1
        log: list[Any] = []
        owners = [pools.owner(Errors()) for _ in range(4)]
        for i, owner in enumerate(owners):
            done = threading.Event()
            assert admits(owner, 1)
            owner.submit("text", task(done, log=log, name=i))
            assert done.wait(WAIT)
        assert set(threading.enumerate()) - before == workers
        assert {thread for _, thread in log} <= workers
    assert set(threading.enumerate()) - before == set()


def test_a_slow_consumer_does_not_block_another_owner(pools: DecodePools) -> None:
    slow, fast = pools.owner(Errors()), pools.owner(Errors())
    run_one(slow)
    run_one(slow)  # its consumer never releases: its budget is full from now on
    stuck = threading.Event()
    waiter = threading.Thread(target=lambda: slow.admit({"text": 1}, stuck))
    waiter.start()
    for _ in range(20):  # ten times the buffer: every round needs the workers and a release
        run_one(fast)
        fast.release("text", 1, 1)
    assert waiter.is_alive(), "the slow owner is still waiting for room"
    stuck.set()
    waiter.join()


def test_workers_take_each_modalitys_tasks_from_the_owners_in_turn(pools: DecodePools) -> None:
    a, b = pools.owner(Errors()), pools.owner(Errors())
    gate, started, log = threading.Event(), threading.Event(), list[Any]()
    events = [threading.Event() for _ in range(6)]
    assert admits(a, 2) and admits(b, 1)
    a.submit("text", task(events[0], gate=gate, log=log, name="a0", started=started))  # holds the only worker
    assert started.wait(WAIT)
    for i in range(1, 5):
        a.submit("text", task(events[i], log=log, name=f"a{i}"))
    b.submit("text", task(events[5], log=log, name="b0"))
    gate.set()
    assert all(e.wait(WAIT) for e in events)
    assert [name for name, _ in log][:3] == ["a0", "a1", "b0"]


def test_workers_serve_the_owner_whose_consumer_needs_its_next_task_soonest(pools: DecodePools) -> None:
    a, b = pools.owner(Errors()), pools.owner(Errors())
    gate, started, log = threading.Event(), threading.Event(), list[Any]()
    events = [threading.Event() for _ in range(5)]
    assert admits(a, 2) and admits(b, 2)
    a.submit("text", task(events[0], gate=gate, started=started), due=0.0)  # holds the only worker
    assert started.wait(WAIT)
    a.submit("text", task(events[1], log=log, name="a8"), due=8.0)  # needed once a's consumer has taken 8 of cost
    a.submit("text", task(events[2], log=log, name="a16"), due=16.0)
    b.submit("text", task(events[3], log=log, name="b0"), due=0.0)
    b.submit("text", task(events[4], log=log, name="b12"), due=12.0)
    a.consumed(6.0)  # a's consumer took a micro-batch: a16 is 10 ahead of it now, b12 still 12
    gate.set()
    assert all(e.wait(WAIT) for e in events)
    assert [name for name, _ in log] == ["b0", "a8", "a16", "b12"]


def test_closing_the_pools_stops_the_workers_and_tells_open_owners() -> None:
    before = set(threading.enumerate())
    errors = Errors()
    pools = DecodePools(text_only(shared=1))
    owner = pools.owner(errors)
    pools.close()
    pools.close()
    assert set(threading.enumerate()) - before == set()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert not admits(owner, 1, within=0.3)
    with pytest.raises(RuntimeError, match="closed"):
        pools.owner(Errors())


# -- pipelines sharing one DecodePools and one FieldReader -------------------------------------
@pytest.fixture(scope="module")
def index(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    out = tmp_path_factory.mktemp("pools-shared") / "index"
    build_index([str(p) for p in demo_shards], out, IndexConfig(workers=1), progress=False)
    return SampleIndex(out)


def same_batch(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["__key__"] != b["__key__"] or set(a) != set(b):
        return False
    for modality in ("text", "image", "video", "audio"):
        for name, value in a.get(modality, {}).items():
            other = b[modality][name]
            if not (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other):
                return False
    return a.get("meta") == b.get("meta")


def next_batch(pipeline: Pipeline) -> dict[str, Any]:
    pending = pipeline.next_ready()
    try:
        assert all(slot.failure is None for slot in pending.slots)
        batch = collate([slot.decoded for slot in pending.slots], [slot.sample.key for slot in pending.slots], {})
        return to_torch(batch)  # as Feed.next_batch hands it out
    finally:
        pipeline.release(pending)


def test_pipelines_sharing_pools_and_a_reader_deliver_what_separate_feeds_do(index: SampleIndex) -> None:
    config = FeedConfig(plan=PlanConfig(seed=3, batch_size=4))
    expected = []
    for rank in range(2):
        with Feed(index, config, world_size=2, rank=rank) as feed:
            expected.append([feed.next_batch() for _ in range(5)])
    before = set(threading.enumerate())
    plan = Plan.from_index(index, config.plan)
    engine = DecodeEngine.build(index, config)
    reader, pools = engine.reader, engine.pools
    assert pools is not None
    start = PlanCursor(plan, world_size=2, grad_accum=1).state_dict()
    pipelines = [
        Pipeline(index, plan, config, reader, world_size=2, rank=rank, grad_accum=1, state=start, skip=0, pools=pools)
        for rank in range(2)
    ]
    try:
        got: list[list[dict[str, Any]]] = [[], []]
        for _ in range(3):
            for rank, pipeline in enumerate(pipelines):
                got[rank].append(next_batch(pipeline))
        pipelines[0].close()  # one stream ends: the other goes on, on the same workers
        workers = {
            t for t in threading.enumerate() if t.name.startswith("omnifeed-") and t.name != "omnifeed-scheduler"
        }
        got[1] += [next_batch(pipelines[1]) for _ in range(2)]
        assert workers <= set(threading.enumerate())
    finally:
        for pipeline in pipelines:
            pipeline.close()
        engine.close()
    assert all(same_batch(a, b) for a, b in zip(got[0], expected[0][:3], strict=True))
    assert all(same_batch(a, b) for a, b in zip(got[1], expected[1], strict=True))
    assert set(threading.enumerate()) - before == set()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to move the workers between")
def test_shared_workers_following_the_cpus_decode_one_at_a_time_on_one_cpu_and_more_when_it_has_more() -> None:
    """``shared_workers: cpus`` (a service's producer on its CPU window): as many tasks at once as CPUs the workers
    may run on, read again as a service moves them."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    before, mine = set(threading.enumerate()), os.sched_getaffinity(0)
    config = FeedConfig(
        pools={m: PoolConfig(workers=0, buffer_samples=64) for m in FIELD_MODALITIES}, shared_workers="cpus"
    )
    os.sched_setaffinity(0, cpus[:1])  # this thread, which the workers inherit: a producer placed before its pools
    try:
        pools = DecodePools(config)
    finally:
        os.sched_setaffinity(0, mine)
    with pools:
        workers = set(threading.enumerate()) - before
        assert len(workers) == 1  # shared workers only, one a CPU
        owner = pools.owner(Errors())
        running, most = [0], [0]
        lock = threading.Lock()

        def run_tasks(tasks: int, together: threading.Barrier | None = None) -> int:
            """The most of ``tasks`` that ran at once; ``together``: the first two wait for each other (two workers
            must be taking tasks, or it breaks after ``WAIT``)."""
            most[0] = 0

            def busy(number: int, done: threading.Event) -> int:
                with lock:
                    running[0] += 1
                    most[0] = max(most[0], running[0])
                if together is not None and number < 2:
                    together.wait()
                time.sleep(0.01)
                with lock:
                    running[0] -= 1
                done.set()
                return 1

            assert admits(owner, tasks)
            done = [threading.Event() for _ in range(tasks)]
            for number, event in enumerate(done):
                owner.submit("text", lambda remote, number=number, event=event: busy(number, event))
            assert all(event.wait(WAIT) for event in done)
            owner.release("text", tasks, tasks)
            return most[0]

        def place(on: list[int]) -> None:
            for thread in set(threading.enumerate()) - before:
                os.sched_setaffinity(thread.native_id, on)

        assert run_tasks(8) == 1
        place(cpus)  # a wider window: the worker starts a second one, on the CPUs it has now
        assert run_tasks(8, threading.Barrier(2, timeout=WAIT)) == 2
        assert len(set(threading.enumerate()) - before) == 2
        place(cpus[:1])
        assert run_tasks(8) == 1, "on one CPU the second worker waits"
        place(cpus)  # the working one sees the second CPU before its next task and wakes the other
        assert run_tasks(8, threading.Barrier(2, timeout=WAIT)) == 2
