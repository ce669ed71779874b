"""Decoded arrays through a worker's shared scratch area: headers on the pipe, memory reused only once no array uses it,
nothing left behind by kill -9 of the parent or of a worker."""

from __future__ import annotations

import gc
import os
import signal
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import psutil
import pytest
from orphans import kill_parent_and_reap

from omnifeed.loader.decode._scratch import ScratchArena, WorkerScratch
from omnifeed.loader.decode._worker_procs import WorkerProcesses


def filled(value: int, size: int) -> np.ndarray:
    return np.full(size, value, dtype=np.uint8)


def text_like(size: int) -> tuple[str, np.ndarray]:
    return "words", np.arange(size, dtype=np.int64)


def not_an_array() -> bytes:
    return b"raw"


@pytest.fixture()
def procs():  # type: ignore[no-untyped-def]
    pool = WorkerProcesses(1, get_context("forkserver"), "test-scratch", scratch_bytes=1 << 20)
    yield pool
    pool.close()


def arena_of(pool: WorkerProcesses) -> ScratchArena:
    (worker,) = pool._idle  # noqa: SLF001  the test looks inside
    assert worker.scratch is not None
    return worker.scratch


def in_arena(array: np.ndarray, arena: ScratchArena) -> bool:
    return np.shares_memory(array, np.frombuffer(arena.buffer, dtype=np.uint8))


def test_the_allocator_frees_a_range_only_when_no_view_of_it_remains() -> None:
    arena = ScratchArena(1 << 16)
    worker = WorkerScratch(arena.buffer)
    block = arena.reserve()
    assert block is not None
    value = ("s", np.arange(10, dtype=np.int32), np.ones((2, 3), np.float32))
    skeleton, specs = worker.place(value, block)  # type: ignore[misc]
    text, first, second = arena.adopt(block, skeleton, specs)
    assert text == "s" and first.tolist() == list(range(10)) and second.tolist() == [[1.0] * 3] * 2
    assert type(first) is np.ndarray and first.flags.writeable
    slice_of_first = first[3:][::2]
    del first
    gc.collect()
    assert arena.free_bytes() < arena.size  # the slice keeps its range
    del slice_of_first, second
    gc.collect()
    assert arena.free_bytes() == arena.size  # all ranges back, coalesced into one block
    assert arena.reserve() == (0, arena.size)


def test_a_value_that_does_not_fit_its_block_is_refused_and_the_block_returned() -> None:
    arena = ScratchArena(4096)
    block = arena.reserve()
    assert block is not None
    assert WorkerScratch(arena.buffer).place(np.zeros(8192, np.uint8), block) is None
    arena.cancel(block)
    assert arena.free_bytes() == arena.size


def test_results_come_back_as_views_of_the_workers_scratch_area(procs: WorkerProcesses) -> None:
    first = procs.run(filled, 1, 100_000)
    arena = arena_of(procs)
    assert in_arena(first, arena) and arena.fallbacks == 0
    second = procs.run(filled, 2, 100_000)  # while the first is held: another range
    assert in_arena(second, arena) and not np.shares_memory(first, second)
    assert (first == 1).all() and (second == 2).all()
    text, tokens = procs.run(text_like, 5)
    assert text == "words" and tokens.tolist() == [0, 1, 2, 3, 4] and in_arena(tokens, arena)
    assert procs.run(not_an_array) == b"raw"
    del first, second, tokens
    gc.collect()
    assert arena.free_bytes() == arena.size


def test_a_held_range_is_never_written_again_until_released(procs: WorkerProcesses) -> None:
    held = [procs.run(filled, i, 200_000) for i in range(4)]  # 800 kB of the 1 MiB area
    for _ in range(20):  # the area's rest turns over many times; the held arrays keep their values
        procs.run(filled, 99, 100_000)
    assert [int(a[0]) for a in held] == [0, 1, 2, 3] and all((a == a[0]).all() for a in held)


def test_a_result_larger_than_the_free_area_comes_through_the_pipe(procs: WorkerProcesses) -> None:
    big = procs.run(filled, 7, 3 << 20)
    arena = arena_of(procs)
    assert (big == 7).all() and not in_arena(big, arena) and arena.fallbacks == 1
    assert arena.free_bytes() == arena.size


def test_views_outlive_a_killed_worker_and_the_next_call_gets_a_new_one(procs: WorkerProcesses) -> None:
    kept = procs.run(filled, 3, 100_000)
    pid = procs._idle[0].process.pid  # noqa: SLF001
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(30)
    again = procs.run(filled, 4, 100_000)
    assert (kept == 3).all() and (again == 4).all() and procs.restarts == 1


_PARENT = """
import os, sys, time
from multiprocessing import get_context
from omnifeed.loader.decode._worker_procs import WorkerProcesses
import numpy as np
if __name__ == "__main__":
    pool = WorkerProcesses(2, get_context("forkserver"), "scratch-orphan-test", scratch_bytes=64 << 20)
    held = [pool.run(np.ones, 1 << 20, np.uint8) for _ in range(4)]  # workers run importable functions only
    print("ready", flush=True)
    time.sleep(300)
"""


def named_segments(before: set[str], pid: int) -> list[str]:
    """New /dev/shm entries that could be the parent's (other test sessions may add their own meanwhile)."""
    return [n for n in set(os.listdir("/dev/shm")) - before if "omnifeed-decode" in n or str(pid) in n]


def test_kill_9_of_the_parent_leaves_no_worker_and_no_shared_memory(tmp_path: Path) -> None:
    shm_before = set(os.listdir("/dev/shm"))

    def up(parent: psutil.Process, children: list[psutil.Process]) -> None:
        maps = [open(f"/proc/{p.pid}/maps").read() for p in [parent, *children]]
        assert sum("omnifeed-decode" in m for m in maps) >= 2  # the parent and a worker map an area
        assert not named_segments(shm_before, parent.pid)  # never named: nothing there to leak

    pid = kill_parent_and_reap(tmp_path, _PARENT, up)
    assert not named_segments(shm_before, pid)  # and the areas' last mappings died with the processes
