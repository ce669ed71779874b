"""Production per core for data-parallel ranks: one node service against a feed in each rank (issue 29, item 2).

    python benchmarks/bench_service_production.py [--samples 1024] [--batch 8] [--epochs 3] [--rounds 3]
                                                  [--compute-ms 0] [--work DIR] [--out FILE.json]
                                                  [--feed JSON] [--service-feed JSON] [--service-config JSON]
                                                  [--instrument MOD:NAME ...] [--rank-instrument MOD:NAME ...]

The data: the demo generator's four-modality mix (`omnifeed.tools._demo_data`: images with
captions, text, short H.264 clips, FLAC audio, JSON meta; images 160–640 px as `omnifeed bench`'s
mixed set), four WebDataset shards, indexed once (cached in ``--work``). The plan: length-bucketed
micro-batches in budget mode at the budget `omnifeed plan --suggest-budget BATCH` prints (micro-batches
of BATCH samples on average). Every loader uses the default `FeedConfig` pools and decoders (``--feed``).

Two layouts of two data-parallel ranks (world size 2), each rank a process of its own that builds its
loader (torch imported, as a trainer has it), says ready, waits for "go", takes ``--epochs`` epochs and drops
each batch (no compute unless ``--compute-ms``):

- ``feeds``: a `Feed` in each rank process (rank r of 2), its own decode workers;
- ``service``: one `FeedService` in a process of its own (started and idle before the ranks connect)
  and a `FeedClient` in each rank process;
- ``services`` (only when asked for): a `FeedService` per rank, each serving one rank's `FeedClient`: what a
  node service would make with an interpreter per rank, the bound of decoding in several processes.

Measured per run over the epochs after the first (the read-ahead is full at both ends of that window,
so whatever a loader decodes ahead cancels out): samples/s (the sum of the ranks' rates), and CPU: each
rank process's own, plus the service process's from when both ranks are past the first epoch until
both are done (psutil ``cpu_times``, user + system, its decode processes included). *Production per
core* is samples per CPU second over the whole run. ``--compute-ms``: each rank sleeps that long after
each batch (a step's compute on an accelerator: no CPU of the node's); *waited* is the share of the
ranks' time spent waiting for a batch, *stalls* the batches waited for over 10 ms (the target with compute
covering production: none). The service and the feeds also report their CPU per thread group (decode
pools per modality, stream producers, connection threads, I/O, scheduler; every thread of the service's
producer processes as ``omnifeed-producer``, since /proc does not know their names), read from ``/proc``
by thread id, so the table says where each side's CPU went, and how the decode threads spent their time
(``/proc`` schedstat): *running*, *waiting for a core* (runnable, no core free), *asleep*
(no work, or waiting for a lock: the interpreter lock among them); ``--instrument`` adds up the
service's CPU inside named functions (``time.thread_time``, no profiler), ``--rank-instrument`` each rank
process's (its whole run, warm-up epoch included). ``--feed`` (`FeedConfig`
fields) sets every layout's decode workers; ``--service-feed`` (`FeedConfig`) and ``--service-config``
(`ServiceConfig` fields) change the service only (A/B runs). Rounds alternate the order; medians.
Writes ``--out`` (JSON) and prints a table with the service's ratios to the feeds.

    python benchmarks/bench_service_production.py --child SPEC_JSON   (a rank or the service; the parent runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

RESULTS = Path(__file__).with_name("results-service-production.json")
LAYOUTS = ("feeds", "service", "services")
RANKS = 2
# omnifeed-{group}-{i}: decode threads; omnifeed-producer: every thread of the service's producer processes, whose
# threads /proc cannot name (their decode threads, pipeline and the idle helpers alike)
DECODE_GROUPS = ("text", "image", "video", "audio", "meta", "shared", "producer")
STALL_S = 0.010  # a wait for a batch longer than this is a stall (shorter ones: the client's own work, scheduling)


# -- data and config --------------------------------------------------------------------------
def prepare(work: Path, samples: int, batch: int) -> dict[str, Any]:
    """The mixed data set's index (generated once into ``work``) and the plan budget for ``batch`` samples."""
    from omnifeed.bucketing import BucketingConfig
    from omnifeed.loader import IndexConfig, PlanConfig, SampleIndex, build_index
    from omnifeed.loader.plan import Plan, suggest_budget
    from omnifeed.tools._demo_data import DemoDatasetSpec, write_webdataset

    root = work / f"mixed-{samples}"
    index_dir = root / "index"
    if not (index_dir / "manifest.json").exists():
        shards = write_webdataset(
            root / "shards", DemoDatasetSpec(num_samples=samples, num_shards=4, image_px=(160, 640))
        )
        build_index([str(p) for p in shards], index_dir, IndexConfig(workers=1), progress=False)
    index = SampleIndex(index_dir)
    placeholder = PlanConfig(seed=0, bucketing=BucketingConfig(mode="budget", budget=1.0, overlong="alone"))
    suggestion = suggest_budget(Plan.from_index(index, placeholder), batch)
    return {"index": str(index_dir), "budget": suggestion["suggested_budget"], "suggestion": suggestion}


def feed_config(budget: float, overrides: dict[str, Any] | None = None) -> Any:
    """The default feed (pools, decoders) over the budget-mode plan; ``overrides``: other `FeedConfig` fields."""
    from omnifeed.bucketing import BucketingConfig
    from omnifeed.loader import FeedConfig, PlanConfig

    plan = PlanConfig(seed=0, bucketing=BucketingConfig(mode="budget", budget=budget, overlong="alone"))
    return FeedConfig.model_validate({**(overrides or {}), "plan": plan})


# -- CPU per thread group ----------------------------------------------------------------------
def _groups() -> dict[str, str]:
    """This process's threads (their /proc task folders) and their groups (a thread's name without its trailing
    number), and every thread of its producer processes as ``omnifeed-producer``."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    groups = {}
    for tid in os.listdir("/proc/self/task"):
        group = re.sub(r"[-_]\d+$", "", names.get(int(tid), "native"))  # native: a library's own thread
        groups[f"/proc/self/task/{tid}"] = re.sub(r"^ThreadPoolExecutor-\d+", "executor", group)
    me = psutil.Process()
    for child in me.children(recursive=True):
        try:
            if child.ppid() == me.pid:  # the fork server and the resource tracker; producers are the server's
                continue
            for thread in os.listdir(f"/proc/{child.pid}/task"):
                groups[f"/proc/{child.pid}/task/{thread}"] = "omnifeed-producer"
        except (psutil.Error, OSError):
            continue
    return groups


def thread_cpu() -> dict[str, float]:
    """This process's CPU seconds per thread group (a thread's name without its trailing number), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    groups: dict[str, float] = {}
    for task, group in _groups().items():
        try:
            fields = Path(f"{task}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        groups[group] = groups.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return groups


def thread_sched() -> dict[str, list[float]]:
    """Per thread group: [seconds its threads ran, seconds they waited for a core while runnable, threads], from
    /proc schedstat (nanoseconds, unlike stat's clock ticks).

    Over a window of W seconds, a group of n threads was running ran / (n W) of the time, waiting
    for a core waited / (n W), and asleep the rest (no work, or a lock: the interpreter lock among them).
    """
    groups: dict[str, list[float]] = {}
    for task, group in _groups().items():
        try:
            ran, waited = (int(v) / 1e9 for v in Path(f"{task}/schedstat").read_text().split()[:2])
        except (OSError, ValueError):
            continue
        entry = groups.setdefault(group, [0.0, 0.0, 0])
        entry[0], entry[1], entry[2] = entry[0] + ran, entry[1] + waited, entry[2] + 1
    return groups


def _decode_shares(
    before: dict[str, list[float]], after: dict[str, list[float]], window_s: float
) -> dict[str, list[float]]:
    """Per decode thread group, and ``all`` of them: [running, waiting for a core, asleep] as shares of its threads'
    time in the window (`thread_sched` at its two ends)."""
    shares, total = {}, [0.0, 0.0, 0]
    for group, (ran, waited, threads) in after.items():
        if group.startswith("omnifeed-") and group.split("-", 1)[1] in DECODE_GROUPS and threads and window_s > 0:
            prior = before.get(group, [0.0, 0.0, 0])
            ran, waited = ran - prior[0], waited - prior[1]
            shares[group] = [ran / threads / window_s, waited / threads / window_s]
            total = [total[0] + ran, total[1] + waited, total[2] + threads]
    if total[2]:
        shares["all"] = [total[0] / total[2] / window_s, total[1] / total[2] / window_s]
    return {
        group: [round(run, 3), round(queued, 3), round(max(0.0, 1 - run - queued), 3)]
        for group, (run, queued) in shares.items()
    }


def _minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v - before.get(k, 0.0) > 0.0005}


# -- CPU per function (--instrument) ----------------------------------------------------------------
_SPENT: dict[str, list[float]] = {}  # "module:Class.function" -> [thread CPU seconds, calls]


def instrument(targets: list[str]) -> None:
    """Wrap each ``module:qualname`` (``omnifeed.`` implied) to add up the calling thread's CPU (``time.thread_time``)
    inside it: where a process's CPU goes, without a profiler's overhead on every call."""
    import functools
    import importlib

    for target in targets:
        module_name, qualname = target.split(":")
        owner: Any = importlib.import_module(f"omnifeed.{module_name}")
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        spent = _SPENT.setdefault(target, [0.0, 0])

        def wrapped(*args: Any, __original: Any = original, __spent: list[float] = spent, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return __original(*args, **kwargs)
            finally:
                __spent[0] += time.thread_time() - started
                __spent[1] += 1

        setattr(owner, name, functools.wraps(original)(wrapped))


def spent() -> dict[str, list[float]]:
    """CPU seconds and calls per instrumented function so far."""
    return {k: [round(v[0], 4), int(v[1])] for k, v in _SPENT.items()}


# -- children --------------------------------------------------------------------------------
def _cpu() -> float:
    times = psutil.Process().cpu_times()
    return float(times.user + times.system)


def serve(spec: dict[str, Any]) -> None:
    """The service child: a `FeedService` until stdin says ``stop``; ``cpu`` prints its CPU per thread group."""
    from omnifeed.loader.service import FeedService, ServiceConfig

    instrument(spec.get("instrument") or [])

    feed = feed_config(spec["budget"], {**(spec.get("feed") or {}), **(spec.get("service_feed") or {})})
    config = ServiceConfig(index=spec["index"], socket=spec["socket"], feed=feed, **(spec.get("service_config") or {}))
    with FeedService(config):
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() == "cpu":
                workers = sum(sum(c.cpu_times()[:2]) for c in psutil.Process().children(recursive=True))
                print(
                    json.dumps(
                        {
                            "cpu_s": _cpu() + workers,
                            "threads": thread_cpu(),
                            "sched": thread_sched(),
                            "at": time.perf_counter(),
                            "spent": spent(),
                        }
                    ),
                    flush=True,
                )
            elif line.strip() == "stop":
                break


def _loader(spec: dict[str, Any]) -> Any:
    if spec["layout"] == "feeds":
        from omnifeed.loader import Feed, SampleIndex

        config = feed_config(spec["budget"], spec.get("feed"))
        return Feed(SampleIndex(spec["index"]), config, world_size=RANKS, rank=spec["rank"])
    from omnifeed.trainer_adapter import FeedClient

    sockets = spec["sockets"]  # one for the node, or one per rank
    return FeedClient(sockets[spec["rank"] % len(sockets)], rank=spec["rank"], world_size=RANKS)


def _size(batch: dict[str, Any]) -> int:
    return len(batch["__key__"])


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """A rank child: build the loader, say ready, wait for "go", take ``epochs`` epochs; after each epoch a line
    ``epoch K`` (the parent reads the service's CPU then); its rate and CPU over the epochs after the first."""
    import torch  # noqa: F401  a trainer has torch imported before its first batch

    instrument(spec.get("rank_instrument") or [])
    loader = _loader(spec)
    print("ready", flush=True)
    sys.stdin.readline()
    samples = batches = 0
    marks = []  # (time, CPU, per-group CPU, samples, batches, per-group scheduling) at go and after each epoch
    marks.append((time.perf_counter(), _cpu(), thread_cpu(), 0, 0, thread_sched()))
    compute_s, waited, stalls = spec.get("compute_ms", 0.0) / 1000, [0.0], [0]
    for epoch in range(spec["epochs"]):
        batches_of_epoch = iter(loader)
        while True:
            asked = time.perf_counter()
            batch = next(batches_of_epoch, None)
            if batch is None:
                break
            if epoch:  # the trainer's wait for its batch, after the warm-up epoch
                waited[0] += time.perf_counter() - asked
                stalls[0] += time.perf_counter() - asked > STALL_S
            samples, batches = samples + _size(batch), batches + 1
            del batch
            if compute_s:
                time.sleep(compute_s)  # the step's compute: on an accelerator, no CPU of this node's
        marks.append((time.perf_counter(), _cpu(), thread_cpu(), samples, batches, thread_sched()))
        print(f"epoch {epoch}", flush=True)
    loader.close()
    (t0, cpu0, threads0, samples0, batches0, sched0), (t1, cpu1, threads1, samples1, batches1, sched1) = (
        marks[1],
        marks[-1],
    )
    return {
        "rank": spec["rank"],
        "first_epoch_s": round(marks[1][0] - marks[0][0], 3),
        "steady_s": round(t1 - t0, 3),
        "steady_window": [round(t0, 4), round(t1, 4)],  # time.perf_counter: one clock for every process of the host
        "steady_samples": samples1 - samples0,
        "steady_batches": batches1 - batches0,
        "cpu_s": round(cpu1 - cpu0, 3),
        "waited_s": round(waited[0], 3),
        "stalls": stalls[0],
        "threads": _minus(threads1, threads0),
        "decode_shares": _decode_shares(sched0, sched1, t1 - t0),
        "spent": spent(),
    }


# -- the parent ------------------------------------------------------------------------------
_STDERR: dict[int, Any] = {}  # child pid -> the file its stderr goes to (read only when it failed)


def _spawn(spec: dict[str, Any]) -> subprocess.Popen[str]:
    err = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads could fill and stall the child
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
    )
    _STDERR[child.pid] = err
    return child


def _last_error(child: subprocess.Popen[str]) -> str:
    if child.poll() is None:
        child.kill()
    child.wait()
    err = _STDERR[child.pid]
    err.seek(0)
    return (err.read().strip().splitlines() or ["no output"])[-1][:300]


def _expect_ready(child: subprocess.Popen[str]) -> None:
    assert child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        raise RuntimeError(f"a child did not start: {_last_error(child)}")


def _wait_all(events: list[threading.Event], children: list[subprocess.Popen[str]]) -> None:
    """Wait until every event is set; RuntimeError if a child exits first without setting its own."""
    for event, child in zip(events, children):
        while not event.wait(0.5):
            if child.poll() is not None and not event.is_set():
                raise RuntimeError(f"a rank exited early: {_last_error(child)}")


def _say(child: subprocess.Popen[str], line: str) -> None:
    assert child.stdin is not None
    child.stdin.write(line + "\n")
    child.stdin.flush()


def _service_cpu(service: subprocess.Popen[str]) -> dict[str, Any]:
    _say(service, "cpu")
    assert service.stdout is not None
    return dict(json.loads(service.stdout.readline()))


def _summed(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The services' `cpu` snapshots as one: CPU, per-group CPU and scheduling, and instrumented functions added up."""
    total: dict[str, Any] = {"cpu_s": 0.0, "threads": {}, "sched": {}, "spent": {}, "at": snapshots[0]["at"]}
    for snapshot in snapshots:
        total["cpu_s"] += snapshot["cpu_s"]
        for group, seconds in snapshot["threads"].items():
            total["threads"][group] = total["threads"].get(group, 0.0) + seconds
        for group, values in snapshot["sched"].items():
            into = total["sched"].setdefault(group, [0.0, 0.0, 0])
            total["sched"][group] = [a + b for a, b in zip(into, values, strict=True)]
        for name, values in snapshot["spent"].items():
            into = total["spent"].setdefault(name, [0.0, 0])
            total["spent"][name] = [a + b for a, b in zip(into, values, strict=True)]
    return total


def _read_rank(child: subprocess.Popen[str], epochs: int, passed: list[threading.Event], out: list[str]) -> None:
    """Read a rank's lines: set ``passed[k]`` when it reports epoch k done; the rest into ``out``."""
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("epoch "):
            passed[int(line.split()[1])].set()
        else:
            out.append(line)


def run_layout(
    layout: str,
    prepared: dict[str, Any],
    epochs: int,
    work: Path,
    service_feed: dict[str, Any] | None = None,
    instrumented: list[str] | None = None,
    compute_ms: float = 0.0,
    service_config: dict[str, Any] | None = None,
    feed: dict[str, Any] | None = None,
    rank_instrumented: list[str] | None = None,
) -> dict[str, Any]:
    """Two rank processes (and the service or services), one run: rates, CPU, CPU per thread group, over the
    epochs after the first (the read-ahead is full at both ends, so it cancels out)."""
    base = {
        "layout": layout,
        "index": prepared["index"],
        "budget": prepared["budget"],
        "epochs": epochs,
        "compute_ms": compute_ms,
        "feed": feed,
    }
    services: list[subprocess.Popen[str]] = []
    if layout != "feeds":  # service: one for the node; services: one per rank
        base["sockets"] = [
            str(Path(tempfile.mkdtemp(prefix="omnifeed-prod-", dir=work)) / "feed.sock")
            for _ in range(1 if layout == "service" else RANKS)
        ]
        for socket in base["sockets"]:
            services.append(
                _spawn(
                    {
                        **base,
                        "socket": socket,
                        "role": "service",
                        "service_feed": service_feed,
                        "instrument": instrumented,
                        "service_config": service_config,
                    }
                )
            )
            _expect_ready(services[-1])
    ranks = [_spawn({**base, "role": "rank", "rank": r, "rank_instrument": rank_instrumented}) for r in range(RANKS)]
    try:
        for child in ranks:
            _expect_ready(child)
        passed = [[threading.Event() for _ in range(epochs)] for _ in ranks]
        outs: list[list[str]] = [[] for _ in ranks]
        readers = [
            threading.Thread(target=_read_rank, args=(child, epochs, passed[i], outs[i]), daemon=True)
            for i, child in enumerate(ranks)
        ]
        for reader in readers:
            reader.start()
        for child in ranks:
            _say(child, "go")
        served = None
        if services:  # the services' CPU from when both ranks are past epoch 0 to when both are done
            _wait_all([events[0] for events in passed], ranks)
            before = _summed([_service_cpu(service) for service in services])
            _wait_all([events[-1] for events in passed], ranks)
            after = _summed([_service_cpu(service) for service in services])
            served = {
                "cpu_s": round(after["cpu_s"] - before["cpu_s"], 3),
                "threads": _minus(after["threads"], before["threads"]),
                "decode_shares": _decode_shares(before["sched"], after["sched"], after["at"] - before["at"]),
                "spent": {
                    k: [round(v[0] - before["spent"][k][0], 4), v[1] - before["spent"][k][1]]
                    for k, v in after["spent"].items()
                },
            }
        results = []
        for i, child in enumerate(ranks):
            child.wait(timeout=1800)
            readers[i].join()
            lines = [line for line in outs[i] if line.startswith("{")]
            if child.returncode or not lines:
                raise RuntimeError(f"a {layout} rank failed: {_last_error(child)}")
            results.append(json.loads(lines[-1]))
    finally:
        for child in ranks:
            if child.poll() is None:
                child.kill()
                child.wait()
        for service in services:
            if service.poll() is None:
                _say(service, "stop")
            service.wait(timeout=60)
        for socket in base.get("sockets", []):
            shutil.rmtree(Path(socket).parent, ignore_errors=True)
    samples = sum(r["steady_samples"] for r in results)
    batches = sum(r["steady_batches"] for r in results)
    cpu = sum(r["cpu_s"] for r in results) + (served["cpu_s"] if served else 0.0)
    return {
        "layout": layout,
        "samples_per_s": round(sum(r["steady_samples"] / max(r["steady_s"], 1e-9) for r in results), 1),
        "samples": samples,
        "batches": batches,
        "cpu_s": round(cpu, 3),
        "samples_per_cpu_s": round(samples / max(cpu, 1e-9), 1),
        "cpu_ms_per_batch": round(1000 * cpu / max(batches, 1), 2),
        "first_epoch_s": [r["first_epoch_s"] for r in results],
        "stalls": sum(r["stalls"] for r in results),
        "waited_fraction": round(
            sum(r["waited_s"] for r in results) / sum(max(r["steady_s"], 1e-9) for r in results), 3
        ),
        "ranks_cpu_s": [r["cpu_s"] for r in results],
        "ranks_steady_window": [r["steady_window"] for r in results],
        "service": served,
        "rank_threads": [r["threads"] for r in results],
        "rank_decode_shares": [r["decode_shares"] for r in results],
        "rank_spent": [r["spent"] for r in results],
    }


def _decode_threads(result: dict[str, Any]) -> list[float]:
    """[running, waiting for a core, asleep] of the run's decode threads: the service's, or the mean of the feeds'."""
    shares = [result["service"]["decode_shares"]] if result["service"] else result["rank_decode_shares"]
    every = [s["all"] for s in shares if "all" in s] or [[0.0, 0.0, 0.0]]
    return [round(statistics.fmean(s[i] for s in every), 3) for i in range(3)]


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row = dict(runs[0])
    for key in ("samples_per_s", "samples_per_cpu_s", "cpu_ms_per_batch", "cpu_s", "waited_fraction", "stalls"):
        row[key] = round(statistics.median(r[key] for r in runs), 2)
    row["rounds"] = [{k: r[k] for k in ("samples_per_s", "samples_per_cpu_s", "cpu_ms_per_batch")} for r in runs]
    shares = [_decode_threads(r) for r in runs]
    row["decode_threads"] = {
        k: round(statistics.median(s[i] for s in shares), 3) for i, k in enumerate(("running", "queued", "asleep"))
    }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1024, help="Samples in the generated mix.")
    parser.add_argument("--batch", type=float, default=8, help="Samples per micro-batch the budget aims at.")
    parser.add_argument(
        "--epochs", type=int, default=3, help="Epochs each rank takes per run (the first one warms up)."
    )
    parser.add_argument("--rounds", type=int, default=3, help="Rounds, alternating the order of the layouts.")
    parser.add_argument("--layouts", nargs="+", default=["feeds", "service"], choices=LAYOUTS)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "omnifeed-bench-production")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--feed", type=json.loads, default=None, help="JSON: FeedConfig fields for every layout (its decode workers)."
    )
    parser.add_argument(
        "--service-feed", type=json.loads, default=None, help="JSON: FeedConfig fields for the service only (an A/B)."
    )
    parser.add_argument(
        "--instrument", nargs="*", default=[], help="module:qualname (under omnifeed.) whose CPU the service adds up."
    )
    parser.add_argument(
        "--rank-instrument",
        nargs="*",
        default=[],
        help="module:qualname (under omnifeed.) whose CPU each rank process adds up (its whole run).",
    )
    parser.add_argument(
        "--compute-ms", type=float, default=0.0, help="The trainer's compute per batch (a sleep: no CPU); 0: none."
    )
    parser.add_argument(
        "--service-config", type=json.loads, default=None, help="JSON: ServiceConfig fields (an A/B of the service)."
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        if spec["role"] == "service":
            serve(spec)
        else:
            print(json.dumps(run_rank(spec)), flush=True)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    args.work.chmod(0o700)
    prepared = prepare(args.work, args.samples, args.batch)
    print(
        f"budget {prepared['budget']:g} ({prepared['suggestion']['samples_per_micro_batch']} samples per micro-batch)"
    )
    runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in args.layouts}
    for round_ in range(args.rounds):
        order: Iterable[str] = args.layouts if round_ % 2 == 0 else reversed(args.layouts)
        for layout in order:
            result = run_layout(
                layout,
                prepared,
                args.epochs,
                args.work,
                args.service_feed,
                args.instrument,
                args.compute_ms,
                args.service_config,
                args.feed,
                args.rank_instrument,
            )
            runs[layout].append(result)
            decode = _decode_threads(result)
            print(
                f"round {round_} {layout:8} {result['samples_per_s']:7.1f} samples/s  "
                f"{result['samples_per_cpu_s']:6.1f} samples/CPU s  {result['cpu_ms_per_batch']:6.2f} CPU ms/batch  "
                f"decode threads running {decode[0]:.0%}, waiting for a core {decode[1]:.0%}, asleep {decode[2]:.0%}",
                flush=True,
            )
    rows = {layout: _median_row(r) for layout, r in runs.items()}
    for layout in ("service", "services"):
        if "feeds" in rows and layout in rows:
            feeds, served = rows["feeds"], rows[layout]
            served["vs_feeds"] = {
                "samples_per_s": round(served["samples_per_s"] / feeds["samples_per_s"], 3),
                "samples_per_cpu_s": round(served["samples_per_cpu_s"] / feeds["samples_per_cpu_s"], 3),
            }
    print(f"\n{'layout':8} {'samples/s':>10} {'samples/CPU s':>14} {'CPU ms/batch':>13} {'waited':>7} {'stalls':>7}")
    for layout, row in rows.items():
        print(
            f"{layout:8} {row['samples_per_s']:10.1f} {row['samples_per_cpu_s']:14.1f} {row['cpu_ms_per_batch']:13.2f}"
            f" {row['waited_fraction']:7.1%} {row['stalls']:7g}  decode threads {row['decode_threads']}"
        )
    for layout in ("service", "services"):
        if "vs_feeds" in rows.get(layout, {}):
            print(f"{layout} / feeds: {rows[layout]['vs_feeds']}")
    for layout, row in rows.items():
        for rank, spent_here in enumerate(row["rank_spent"]):
            if spent_here:
                print(f"{layout} rank {rank} (CPU s, calls): {spent_here}")
    report = {
        "command": " ".join(["python", "benchmarks/bench_service_production.py", *(argv or sys.argv[1:])]),
        "samples": args.samples,
        "batch": args.batch,
        "epochs": args.epochs,
        "rounds": args.rounds,
        "compute_ms": args.compute_ms,
        "prepared": prepared,
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
