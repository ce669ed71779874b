"""Decode worker processes under kill -9 (found by `omnifeed chaos`): a retry, never a hang, a lost pool or an
orphan."""

from __future__ import annotations

import gc
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from multiprocessing import get_context
from multiprocessing.connection import Connection

import psutil
import pytest
from orphans import kill_parent_and_reap

from omnifeed.loader.decode._worker_procs import WorkerDied, WorkerProcesses


def payload(size: int) -> bytes:
    return b"x" * size


def die(code: int) -> None:
    os._exit(code)


def fail() -> None:
    raise ValueError("decoder said no")


def fail_reading() -> None:
    raise FileNotFoundError("tokenizer.json")


@pytest.fixture()
def procs():  # type: ignore[no-untyped-def]
    pool = WorkerProcesses(1, get_context("forkserver"), "test-decode")
    yield pool
    pool.close()


def worker_pids(pool: WorkerProcesses) -> list[int]:
    return [w.process.pid for w in pool._idle]  # noqa: SLF001  the test looks inside


def half_a_reply_then_die() -> None:
    """In the worker: start a 1 MiB reply on the pipe, write a little of it, and die (as a kill mid-write does)."""
    conn = next(o for o in gc.get_objects() if isinstance(o, Connection) and not o.closed)
    os.write(conn.fileno(), struct.pack("!i", 1 << 20) + b"x" * 1000)
    os._exit(9)


def test_a_worker_dead_in_the_middle_of_its_reply_costs_a_retry_not_a_hang(procs: WorkerProcesses) -> None:
    started = time.monotonic()
    with pytest.raises(WorkerDied):
        procs.run(half_a_reply_then_die)  # twice: the call fails; ProcessPoolExecutor waits for the rest forever
    assert time.monotonic() - started < 60 and procs.restarts == 2
    assert procs.run(payload, 5) == b"xxxxx"


def test_a_worker_killed_during_a_large_call_costs_a_retry(procs: WorkerProcesses) -> None:
    assert procs.run(payload, 1) == b"x"
    (pid,) = worker_pids(procs)
    threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
    assert len(procs.run(payload, 256 << 20)) == 256 << 20
    assert procs.restarts <= 1


def test_the_pool_keeps_serving_after_a_worker_died_and_errors_come_back_as_raised(procs: WorkerProcesses) -> None:
    with pytest.raises(WorkerDied):
        procs.run(die, 3)  # dies on this call, twice: the call fails, the pool does not
    assert procs.restarts == 2
    with pytest.raises(ValueError, match="decoder said no"):
        procs.run(fail)
    assert procs.run(payload, 3) == b"xxx"


def test_an_os_error_of_the_function_comes_back_raised_and_the_worker_lives(procs: WorkerProcesses) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):  # not the pipe's own EOF or OSError
        procs.run(fail_reading)
    assert procs.restarts == 0


_PARENT = """
import sys, time
from multiprocessing import get_context
from multiprocessing.connection import Connection
from omnifeed.loader.decode._worker_procs import WorkerProcesses
def idle() -> int:
    return 1
if __name__ == "__main__":
    pool = WorkerProcesses(2, get_context("forkserver"), "orphan-test")
    import threading
    threads = [threading.Thread(target=pool.run, args=(time.sleep, 0.5)) for _ in range(2)]
    [t.start() for t in threads]; [t.join() for t in threads]
    print("ready", flush=True)
    time.sleep(300)
"""


def test_workers_exit_when_their_parent_is_killed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def up(parent: psutil.Process, children: list[psutil.Process]) -> None:
        assert len(children) >= 3  # fork server, resource tracker, two workers

    kill_parent_and_reap(tmp_path, _PARENT, up)


_SCRIPT_WITH_SIDE_EFFECTS = """
import os, sys
from multiprocessing import get_context
from omnifeed.loader.decode._worker_procs import WorkerProcesses
with open(sys.argv[1], "a") as runs:  # top level, no main guard: what a training script's imports and setup do
    runs.write(f"{os.getpid()}\\n")
if __name__ == "__main__":
    pool = WorkerProcesses(2, get_context("forkserver"), "main-test")
    print(pool.run(os.getpid) != os.getpid(), flush=True)
    pool.close()
"""


def test_decode_workers_do_not_run_the_trainers_script_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A worker runs omnifeed's decode functions only: the script's top level (torch, the model) runs once, in the
    trainer."""
    script, runs = tmp_path / "train.py", tmp_path / "runs.txt"
    script.write_text(_SCRIPT_WITH_SIDE_EFFECTS)
    done = subprocess.run([sys.executable, str(script), str(runs)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
    if sys.version_info < (3, 14):
        assert len(runs.read_text().split()) == 1
