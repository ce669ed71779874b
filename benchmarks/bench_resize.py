"""Reconfiguration time inside the service: resize request → first batch at the new size, over a 1M-sample index.

    python benchmarks/bench_resize.py [--rows 1000000] [--batch-size 32] [--deep 0.75] [--steps 4] [--settle-s 1.0]
                                      [--py-spy DIR] [--quick]

1. The index: ``--rows`` samples (image + caption) whose field locations all point at real
   bytes: one local tar of 8 small JPEGs (256×192) and captions, indexed once with
   ``build_index``; its 8 rows are then repeated (new keys, the same members' offsets and
   sizes) and written with ``write_index_from_tables`` (``omnifeed.tools._synthetic_index``). Cached under
   ``benchmarks/_work/resize-cache`` (``--work``). Checked: ``SampleIndex.num_samples`` and one
   in-process ``Feed`` batch (every image decoded, every caption read, none replaced).
2. The service: ``omnifeed serve --config`` in its own process (plan: seed 0, fixed batches of
   ``--batch-size``, permutation shuffle; default decode: short side 224, so 224×299 here;
   4 prefetched batches per stream).
3. The clients: ``FeedClient`` threads of this process. Four ranks take ``--steps`` steps in
   lockstep, the service then gets ``--settle-s`` to fill its prefetch (a training step's
   compute), rank 3 says goodbye, and ranks 0–2 call ``resize(3, rank)`` together (released by
   a barrier) and take their next batch. Measured per client: ``resize()`` alone (goodbye +
   hello: ``resize_call``) and ``resize()`` → the first batch returned at the new size
   (``total``, the figure against the target). Then ``--steps`` steps at 3, settle, and growth
   to 6: ranks 0–2 ``resize(6, rank)``, ranks 3–5 are new clients that ``load_state_dict`` the
   state of rank 0 (as ``tests/trainer_adapter/test_resize.py`` does); for them ``total`` runs
   from the client's construction. The service's metrics (``resizes``, ``last_resize_s``,
   ``resize_seconds``, ``handed_over``) are read after each change. All of it runs twice, each
   time with a fresh service: from the start of the epoch (``early``) and from a plan position
   ``--deep`` of the way into the epoch (``deep``: a ``PlanCursor`` stepped there at world
   size 4, which costs this process about a second at 1M rows, measured and reported; the
   service itself only loads the state).
4. For comparison, in this process after the service runs: one ``Feed`` (rank 0 of 4) takes
   the same steps, then ``Feed.resize(3, 0)`` + ``next_batch()`` and ``resize(6, 0)`` +
   ``next_batch()``; a joining rank: ``Feed(...)`` + ``load_state_dict`` of the 3-rank state +
   ``next_batch()``. That is one rank with the machine to itself; the service serves all of them.

``--py-spy DIR`` records the service with py-spy during each change (raw collapsed stacks,
every thread; it slows the service down: profile and measure in separate runs).

Prints one JSON object (max and median per phase, in ms; target ≤ 1,000 ms; the machine's
load average before and after, since the machine is shared) and writes it to
``benchmarks/results-resize.json`` (``--out``). ``--quick`` is the smoke test: 20,000 rows,
batches of 8, one step per phase, short pauses, nothing written unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from omnifeed.loader import Feed, FeedConfig, PlanConfig, SampleIndex
from omnifeed.loader.feed import FEED_STATE_FORMAT
from omnifeed.loader.plan._cursor import PlanCursor
from omnifeed.loader.plan._plan import Plan
from omnifeed.loader.service._protocol import request_metrics, wait_until_serving
from omnifeed.tools._synthetic_index import make_index
from omnifeed.trainer_adapter import FeedClient

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results-resize.json"
TARGET_MS = 1000.0
SEED = 0
W0, W1, W2 = 4, 3, 6


@dataclass(frozen=True)
class Setup:
    """What every phase shares: the index, the batch size, the steps and pause before each change."""

    work: Path
    index: Path
    batch_size: int
    steps: int
    settle_s: float

    def feed_config(self) -> FeedConfig:
        return FeedConfig(plan=PlanConfig(seed=SEED, batch_size=self.batch_size))


# -- the index (omnifeed.tools._synthetic_index: 8 real JPEGs, rows repeated) ----------------
def check_index(setup: Setup, rows: int) -> dict[str, Any]:
    """The index holds ``rows`` samples and an in-process feed decodes a whole batch of it."""
    index = SampleIndex(setup.index)
    assert index.num_samples == rows, (index.num_samples, rows)
    started = time.perf_counter()
    with Feed(index, setup.feed_config()) as feed:
        batch = feed.next_batch()
    seconds = time.perf_counter() - started
    n = setup.batch_size
    assert len(batch["__key__"]) == n and not batch["__info__"]["replaced"], batch["__info__"]
    assert tuple(batch["image"]["pixels"].shape[:3]) == (n, 3, 224)  # short side 224 (the default decode)
    assert len(batch["text"]["strings"]) == n
    return {"num_samples": index.num_samples, "first_feed_batch_ms": round(seconds * 1000, 1)}


def deep_state(setup: Setup, fraction: float) -> tuple[dict[str, Any], float]:
    """A feed state at world size ``W0``, ``fraction`` of the way into epoch 0 (a stepped `PlanCursor`), and its cost in
    s."""
    index = SampleIndex(setup.index)
    started = time.perf_counter()
    cursor = PlanCursor(Plan.from_index(index, setup.feed_config().plan), world_size=W0)
    target = int(fraction * index.num_samples) // setup.batch_size
    while cursor.micro_batch < target:
        cursor.next_step()
    return {"format": FEED_STATE_FORMAT, "plan": cursor.state_dict(), "accum_done": 0}, time.perf_counter() - started


# -- the service -----------------------------------------------------------------------------
class Service:
    """``omnifeed serve --config`` in a subprocess, with its socket in a fresh private folder under /tmp."""

    def __init__(self, setup: Setup) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="of-resize-", dir="/tmp"))  # socket paths stay under 108 bytes
        self.address = str(self.folder / "feed.sock")
        config = {
            "index": str(setup.index),
            "socket": self.address,
            "stream_idle_s": 120,
            "feed": {"plan": {"seed": SEED, "batch_size": setup.batch_size}},
        }
        config_path = setup.work / "service.yaml"
        config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.log_path = setup.work / "service.log"
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "omnifeed.tools", "serve", "--config", str(config_path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until_serving(self.address, self.process, 120.0, detail=lambda: f"see {self.log_path}")
        except (RuntimeError, TimeoutError):
            self.close()
            raise

    def metrics(self) -> dict[str, Any]:
        snapshot = request_metrics(self.address)
        return {
            "resizes": snapshot["resizes"],
            "last_resize_ms": round(snapshot["last_resize_s"] * 1000, 1),
            "resize_seconds_total": round(snapshot["resize_seconds"], 4),
            "handed_over": snapshot["handed_over"],
        }

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def profiled(pid: int, out: Path | None) -> Iterator[None]:
    """``py-spy record`` of process ``pid`` (every thread, raw collapsed stacks into ``out``) around the block."""
    if out is None:
        yield
        return
    spy = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("py-spy")),
            "record",
            "--pid",
            str(pid),
            "--threads",
            "--rate",
            "200",
            "--format",
            "raw",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # attached
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


# -- clients ---------------------------------------------------------------------------------
def together(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run ``jobs`` in threads released at once by a barrier; their results in order (re-raises a failure)."""
    barrier = threading.Barrier(len(jobs))
    results: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001  re-raised below, in the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def lockstep(clients: list[FeedClient], steps: int) -> float:
    """``steps`` training steps, every rank taking its batch at once (and dropping it); the median step in ms."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        together([partial(FeedClient.next_batch, c) for c in clients])
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 1)


def check_first(batch: dict[str, Any], size: int, version: int) -> None:
    """A full batch dealt at topology ``version``."""
    info = batch["__info__"]
    assert len(batch["__key__"]) == size and info["topology_version"] == version, info


def resized(client: FeedClient, world: int, rank: int, size: int, version: int) -> dict[str, float]:
    """``client.resize(world, rank)`` and its first batch: ms to each."""
    started = time.perf_counter()
    client.resize(world, rank)
    asked = time.perf_counter()
    check_first(client.next_batch(), size, version)
    return {"resize_call_ms": (asked - started) * 1000, "total_ms": (time.perf_counter() - started) * 1000}


def stayed(client: FeedClient, world: int, rank: int, size: int, version: int) -> tuple[FeedClient, dict[str, float]]:
    """`resized`, with the client (the shape of `joined`)."""
    return client, resized(client, world, rank, size, version)


def joined(
    address: str, world: int, rank: int, state: dict[str, Any], size: int, version: int
) -> tuple[FeedClient, dict[str, float]]:
    """A new rank: a client, ``load_state_dict(state)`` (a resize) and its first batch: ms to each."""
    started = time.perf_counter()
    client = FeedClient(address, rank=rank, world_size=world)
    client.load_state_dict(state)
    asked = time.perf_counter()
    check_first(client.next_batch(), size, version)
    return client, {"resize_call_ms": (asked - started) * 1000, "total_ms": (time.perf_counter() - started) * 1000}


def summary(per_client: list[dict[str, float]]) -> dict[str, Any]:
    """Max and median over the clients of a change, and each client's figures (ms)."""
    totals, calls = [c["total_ms"] for c in per_client], [c["resize_call_ms"] for c in per_client]
    return {
        "total_max_ms": round(max(totals), 1),
        "total_median_ms": round(statistics.median(totals), 1),
        "resize_call_max_ms": round(max(calls), 1),
        "resize_call_median_ms": round(statistics.median(calls), 1),
        "clients": [{k: round(v, 1) for k, v in c.items()} for c in per_client],
    }


def service_run(setup: Setup, start: dict[str, Any] | None, profile: Path | None = None) -> dict[str, Any]:
    """4 → 3 → 6 ranks through a fresh service, from ``start`` (None: the plan's start).

    ``profile``: a path prefix for ``py-spy`` records of the service during each change (``-shrink.txt``,
    ``-grow.txt``).
    """
    service = Service(setup)
    size, steps = setup.batch_size, setup.steps
    result: dict[str, Any] = {}
    clients: list[FeedClient] = []
    try:
        clients = [FeedClient(service.address, rank=r, world_size=W0) for r in range(W0)]
        if start is not None:
            together([partial(c.load_state_dict, start) for c in clients])
        version = int(clients[0].state_dict()["plan"]["topology_version"])
        result["position"] = {k: clients[0].state_dict()["plan"][k] for k in ("epoch", "step", "micro_batch")}
        result["step_ms_at_4"] = lockstep(clients, steps)
        time.sleep(setup.settle_s)
        with profiled(service.process.pid, profile and profile.with_name(profile.name + "-shrink.txt")):
            clients.pop().close()  # rank 3 leaves at a step boundary
            shrink = together([partial(resized, c, W1, r, size, version + 1) for r, c in enumerate(clients)])
        result["shrink_4_to_3"] = {**summary(shrink), "service": service.metrics()}
        result["step_ms_at_3"] = lockstep(clients, steps)
        time.sleep(setup.settle_s)
        saved = clients[0].state_dict()
        jobs: list[Callable[[], tuple[FeedClient, dict[str, float]]]] = [
            partial(stayed, c, W2, r, size, version + 2) for r, c in enumerate(clients)
        ]
        jobs += [partial(joined, service.address, W2, r, saved, size, version + 2) for r in range(W1, W2)]
        with profiled(service.process.pid, profile and profile.with_name(profile.name + "-grow.txt")):
            grown = together(jobs)
        clients = [c for c, _ in grown]
        result["grow_3_to_6"] = {**summary([t for _, t in grown]), "service": service.metrics()}
        result["step_ms_at_6"] = lockstep(clients, steps)
    finally:
        for client in clients:
            client.close()
        service.close()
    return result


def in_process_run(setup: Setup, start: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0 as an in-process `Feed`: 4 → 3 → 6 by ``Feed.resize`` + ``next_batch``; a joining rank's first batch."""
    config, size = setup.feed_config(), setup.batch_size
    result: dict[str, Any] = {}

    def timed_first(change: Callable[[], None], feed_of: Callable[[], Feed], version: int) -> float:
        started = time.perf_counter()
        change()
        check_first(feed_of().next_batch(), size, version)
        return round((time.perf_counter() - started) * 1000, 1)

    with Feed(setup.index, config, world_size=W0, rank=0) as feed:
        if start is not None:
            feed.load_state_dict(start)
        version = int(feed.state_dict()["plan"]["topology_version"])
        for _ in range(setup.steps):
            feed.next_batch()
        time.sleep(setup.settle_s)
        result["shrink_4_to_3_ms"] = timed_first(lambda: feed.resize(W1, 0), lambda: feed, version + 1)
        for _ in range(setup.steps):
            feed.next_batch()
        time.sleep(setup.settle_s)
        saved = feed.state_dict()
        result["grow_3_to_6_ms"] = timed_first(lambda: feed.resize(W2, 0), lambda: feed, version + 2)
    new: list[Feed] = []

    def join() -> None:
        new.append(Feed(setup.index, config, world_size=W2, rank=W2 - 1))
        new[0].load_state_dict(saved)

    result["joining_rank_ms"] = timed_first(join, lambda: new[0], version + 2)
    new[0].close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--deep", type=float, default=0.75, help="fraction of the epoch for the deep position")
    parser.add_argument("--steps", type=int, default=4, help="lockstep steps before each change")
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause before each change (the service prefetches)")
    parser.add_argument("--work", type=Path, default=HERE / "_work" / "resize-cache")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"JSON output (default {RESULTS.name}; none with --quick)"
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="DIR",
        help="record the service with py-spy during each change (raw stacks into DIR; slows it down)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 20,000 rows, batches of 8, 1 step, short pauses"
    )
    args = parser.parse_args()
    if args.quick:
        args.rows, args.batch_size, args.steps, args.settle_s = 20_000, 8, 1, 0.2
    elif args.out is None:
        args.out = RESULTS
    args.work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    index, built = make_index(args.work, args.rows)
    setup = Setup(args.work, index, args.batch_size, args.steps, args.settle_s)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count()},
        "rows": args.rows,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "settle_s": args.settle_s,
        "target_ms": TARGET_MS,
        "index": {**built, **check_index(setup, args.rows)},
    }
    deep, deep_s = deep_state(setup, args.deep)
    report["deep_position"] = {
        "fraction": args.deep,
        "micro_batch": deep["plan"]["micro_batch"],
        "cursor_stepped_s": round(deep_s, 2),
    }
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    positions = (("early", None), ("deep", deep))
    report["service"] = {
        name: service_run(setup, start, args.py_spy and args.py_spy / name) for name, start in positions
    }
    report["in_process"] = {name: in_process_run(setup, start) for name, start in positions}
    worst = max(report["service"][p][c]["total_max_ms"] for p, _ in positions for c in ("shrink_4_to_3", "grow_3_to_6"))
    report["service_worst_ms"], report["target_met"] = worst, worst <= TARGET_MS
    report["machine"]["load_avg_1m"] = {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
