"""The service's memory over a long run: what its RSS is made of, epoch after epoch, against its budgets.

    python benchmarks/bench_service_memory.py [--epochs 30] [--samples 240] [--batch-size 8]
                                             [--origin http|local] [--latency-ms 0] [--ram-mib 0]
                                             [--prefetch-batches 2] [--settle-s 1.0]
                                             [--env NAME=VALUE ...] [--malloc-stats] [--quick]

1. The dataset: the built-in demo generator (``omnifeed.tools._demo_data``: images, text,
   video, audio) as ``--samples`` samples in WebDataset shards on local disk (cached under
   ``benchmarks/_work/service-memory``, ``--work``), read over HTTP from
   ``omnifeed.tools._chaos_storage.RangeServer`` in this process (``--origin http``, the
   default, as ``omnifeed chaos`` reads it: through the remote tier and its I/O threads, no
   faults, ``--latency-ms`` per request) or from local disk (``--origin local``: read by the
   decode workers themselves).
2. The service: ``omnifeed serve --config`` in its own process, with the config of the chaos
   soak (``omnifeed chaos``): 2 prefetched batches per stream, audio decoded in one worker
   process, default pools otherwise; a RAM cache tier of ``--ram-mib`` MiB (0: none). Extra
   environment for the service with ``--env`` (``MALLOC_ARENA_MAX=2``, say).
3. One ``FeedClient`` iterates ``--epochs`` epochs, dropping each batch. After each epoch
   (and ``--settle-s`` for the service to refill its prefetch) it samples the service
   process: ``/proc/PID/status`` (``RssAnon``, ``RssShmem``, ``RssFile``: anonymous memory is
   the heap, Python objects, decoder buffers; shared memory is the batch segments (memfd)
   and the RAM tier; file is code, libraries and the memory-mapped index), open descriptors,
   threads, the RSS of its child processes (decode worker processes, fork server), and its
   metrics (segment bytes, decoded samples ready per modality, RAM tier used bytes).

Reported: the samples; the configured budgets (RAM tier capacity, batch segments
``(prefetch_batches + 2 + 2) × segment size`` per stream, ``Σ pools.*.buffer_bytes``); the
growth of each component from epoch ``--baseline`` to the last (MiB per epoch, a least-squares
slope over those epochs, and the difference); the overhead: anonymous RSS after the last epoch
minus the decoded samples held in the ready buffers. Diagnostics: ``--malloc-stats`` (glibc's
``mallinfo2()`` and the count of full garbage collections, sampled inside the service),
``--trim-every-s`` / ``--gc-every-s`` (call ``malloc_trim(0)`` / ``gc.collect()`` in the service
periodically, to see what they would win). Prints one JSON object and writes it to
``benchmarks/results-service-memory.json`` (``--out``). ``--quick``: 48 samples, 4 epochs,
nothing written unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from omnifeed.loader import FeedConfig, IndexConfig, build_index
from omnifeed.loader.service._protocol import request_metrics, wait_until_serving
from omnifeed.tools._demo_data import DemoDatasetSpec, write_webdataset
from omnifeed.trainer_adapter import FeedClient

_HERE = Path(__file__).resolve().parent
# Diagnostics (--malloc-stats, --trim-every-s): the service started through this wrapper writes glibc's
# mallinfo2() (all arenas: bytes in use, free bytes kept, mmapped) and the count of full (generation 2)
# garbage collections to a file every 0.25 s; it calls malloc_trim(0) every TRIM seconds and gc.collect()
# every GC seconds when they are > 0.
_WRAPPER = """
import ctypes, gc, json, os, sys, threading, time
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
path, trim, collect = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
def watch():
    trimmed = collected = time.monotonic()
    while True:
        time.sleep(0.25)
        if collect > 0 and time.monotonic() - collected >= collect:
            gc.collect()
            collected = time.monotonic()
        if trim > 0 and time.monotonic() - trimmed >= trim:
            libc.malloc_trim(0)
            trimmed = time.monotonic()
        info = libc.mallinfo2()
        with open(path + ".tmp", "w") as out:
            json.dump({**{n: getattr(info, n) for n, _ in Info._fields_},
                       "gc_full": gc.get_stats()[2]["collections"]}, out)
        os.replace(path + ".tmp", path)
threading.Thread(target=watch, daemon=True).start()
sys.argv = ["omnifeed"] + sys.argv[4:]
from omnifeed.tools._cli import main
raise SystemExit(main())
"""
_MIB = 2**20
_STATUS = ("VmRSS", "RssAnon", "RssShmem", "RssFile", "VmHWM", "Threads")


def dataset(work: Path, samples: int, shards: int) -> tuple[Path, list[Path]]:
    """The demo dataset's shards and their local index (built once per (samples, shards) under ``work``)."""
    out = work / f"demo-{samples}-{shards}"
    index = out / "index"
    shards_dir = out / "shards"
    if index.exists() and any(index.iterdir()):
        return index, sorted(shards_dir.glob("*.tar"))
    shutil.rmtree(out, ignore_errors=True)
    paths = write_webdataset(shards_dir, DemoDatasetSpec(num_samples=samples, num_shards=shards, seed=0))
    report = build_index([str(p) for p in paths], index, IndexConfig(workers=1), progress=False)
    if report.errors:
        raise RuntimeError(f"indexing failed: {report.errors[0]}")
    return index, paths


def http_index(shards: list[Path], out: Path, server: Any) -> Path:
    """An index of the same shards over ``server``'s http:// URLs (every read goes through the remote tier)."""
    report = build_index([f"{server.url}/{p.name}" for p in shards], out, IndexConfig(workers=1), progress=False)
    if report.errors:
        raise RuntimeError(f"indexing failed: {report.errors[0]}")
    return out


def service_config(
    index: Path, socket_path: Path, *, batch_size: int, prefetch_batches: int, ram_mib: int, ram_name: str
) -> dict[str, Any]:
    """The chaos soak's service config (no audit log, no HTTP origin), with an optional RAM tier."""
    feed: dict[str, Any] = {
        "plan": {"seed": 0, "batch_size": batch_size},
        "pools": {"audio": {"workers": 2, "processes": 1, "buffer_samples": 64}},
    }
    if ram_mib:
        feed["cache"] = {"ram": {"name": ram_name, "capacity_bytes": ram_mib * _MIB}}
    return {
        "index": str(index),
        "socket": str(socket_path),
        "prefetch_batches": prefetch_batches,
        "stream_idle_s": 30.0,
        "feed": feed,
    }


def budgets(config: dict[str, Any]) -> dict[str, Any]:
    """What the config bounds, in bytes (segment size is measured: it follows the largest batch)."""
    feed = FeedConfig(**config["feed"])
    pools = {m: feed.pool(m).buffer_bytes for m in ("text", "image", "video", "audio", "meta")}
    ram = feed.cache.ram.capacity_bytes if feed.cache.ram is not None else 0
    return {
        "ram_tier_bytes": ram,
        "segments_per_stream": config["prefetch_batches"] + 2 * 1 + 2,
        "pool_buffer_bytes": pools,
        "pool_buffer_bytes_total": sum(pools.values()),
    }


def proc_status(pid: int) -> dict[str, int]:
    """``/proc/PID/status`` memory lines, in bytes (Threads: a count)."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as lines:
        for line in lines:
            name, _, value = line.partition(":")
            if name in _STATUS:
                number = int(value.split()[0])
                found[name] = number if name == "Threads" else number * 1024
    return found


def sample(pid: int, epoch: int, seconds: float, malloc_stats: Path | None = None) -> dict[str, Any]:
    """One reading of the service process (and its children) plus its metrics."""
    status = proc_status(pid)
    malloc: dict[str, float] = {}
    if malloc_stats is not None and malloc_stats.exists():
        info = json.loads(malloc_stats.read_text())
        malloc = {
            "malloc_arena_mib": info["arena"] / _MIB,
            "malloc_used_mib": info["uordblks"] / _MIB,
            "malloc_free_mib": info["fordblks"] / _MIB,
            "malloc_mmap_mib": info["hblkhd"] / _MIB,
            "gc_full": info["gc_full"],
        }
    process = psutil.Process(pid)
    children = 0
    for child in process.children(recursive=True):
        try:
            children += child.memory_info().rss
        except psutil.Error:
            pass
    snapshot = request_metrics(_SOCKET, timeout=30.0)
    buffers = {m: int(b.get("buffer_bytes", 0)) for m, b in snapshot.get("modalities", {}).items()}
    ram = snapshot.get("cache", {}).get("ram") or {}
    return {
        "epoch": epoch,
        "t_s": round(seconds, 1),
        "rss_mib": status["VmRSS"] / _MIB,
        "anon_mib": status["RssAnon"] / _MIB,
        "shmem_mib": status["RssShmem"] / _MIB,
        "file_mib": status["RssFile"] / _MIB,
        "hwm_mib": status["VmHWM"] / _MIB,
        "threads": status["Threads"],
        "fds": process.num_fds(),
        "children": len(process.children(recursive=True)),
        "children_rss_mib": children / _MIB,
        "segment_mib": snapshot["service"]["segment_bytes"] / _MIB,
        "segments": snapshot["service"]["segments"],
        "buffer_mib": sum(buffers.values()) / _MIB,
        "ram_used_mib": ram.get("bytes_used", 0) / _MIB,
        **malloc,
    }


_SOCKET = ""


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    if n < 2:
        return 0.0
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    global _SOCKET
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    index, shards = dataset(work, args.samples, args.shards)
    folder = Path(tempfile.mkdtemp(prefix="of-mem-", dir="/tmp"))
    os.chmod(folder, 0o700)
    server = None
    if args.origin == "http":
        from omnifeed.tools._chaos_storage import RangeServer

        server = RangeServer(shards[0].parent).start()
        index = http_index(shards, folder / "index", server)
        server.delay_s = args.latency_ms / 1000
    _SOCKET = str(folder / "feed.sock")
    ram_name = f"bench-mem-{os.getpid()}"
    config = service_config(
        index,
        Path(_SOCKET),
        batch_size=args.batch_size,
        prefetch_batches=args.prefetch_batches,
        ram_mib=args.ram_mib,
        ram_name=ram_name,
    )
    config_path = folder / "service.yaml"
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    log = open(folder / "service.log", "w+", encoding="utf-8")  # noqa: SIM115
    stats_path = folder / "mallinfo.json" if args.malloc_stats or args.trim_every_s or args.gc_every_s else None
    command = [sys.executable, "-m", "omnifeed.tools", "serve", "--config", str(config_path)]
    if stats_path is not None:
        command = [
            sys.executable,
            "-c",
            _WRAPPER,
            str(stats_path),
            str(args.trim_every_s),
            str(args.gc_every_s),
            "serve",
            "--config",
            str(config_path),
        ]
    service = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        wait_until_serving(_SOCKET, service, 120.0, detail=lambda: f"see {log.name}")
        samples.append(sample(service.pid, -1, time.monotonic() - started, stats_path))
        batches = 0
        with FeedClient(_SOCKET) as client:
            for epoch in range(args.epochs):
                for batch in client:
                    batches += 1
                    del batch
                time.sleep(args.settle_s)
                samples.append(sample(service.pid, epoch, time.monotonic() - started, stats_path))
                if args.verbose:
                    print(
                        json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in samples[-1].items()}),
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        if service.poll() is None:
            service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=60)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
        log.close()
        if server is not None:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)
        for leftover in Path("/dev/shm").glob(f"omnifeed-ram-{ram_name}*"):  # the tier's segment and its lock file
            leftover.unlink(missing_ok=True)
    return summarize(args, config, samples, batches, time.monotonic() - started)


def summarize(
    args: argparse.Namespace, config: dict[str, Any], samples: list[dict[str, Any]], batches: int, seconds: float
) -> dict[str, Any]:
    epochs = [s for s in samples if s["epoch"] >= 0]
    base = next((s for s in epochs if s["epoch"] == args.baseline), epochs[0])
    last = epochs[-1]
    tail = [s for s in epochs if s["epoch"] >= base["epoch"]]
    growth = {}
    for key in ("rss_mib", "anon_mib", "shmem_mib", "file_mib", "children_rss_mib"):
        growth[key] = {
            "from": round(base[key], 1),
            "to": round(last[key], 1),
            "diff": round(last[key] - base[key], 1),
            "max": round(max(s[key] for s in tail), 1),
            "per_epoch": round(slope([(s["epoch"], s[key]) for s in tail]), 2),
        }
    bounds = budgets(config)
    segment = max(s["segment_mib"] for s in epochs)
    return {
        "benchmark": "service_memory",
        "command": " ".join(["python", "benchmarks/bench_service_memory.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "config": {
            "samples": args.samples,
            "shards": args.shards,
            "batch_size": args.batch_size,
            "epochs": args.epochs,
            "origin": args.origin,
            "latency_ms": args.latency_ms,
            "prefetch_batches": args.prefetch_batches,
            "ram_mib": args.ram_mib,
            "env": args.env,
            "trim_every_s": args.trim_every_s,
            "gc_every_s": args.gc_every_s,
            "settle_s": args.settle_s,
        },
        "budgets": {**bounds, "segment_bytes_measured_max_mib": round(segment, 2)},
        "batches": batches,
        "seconds": round(seconds, 1),
        "baseline_epoch": base["epoch"],
        "growth": growth,
        "fds": sorted({s["fds"] for s in epochs}),
        "threads": sorted({s["threads"] for s in epochs}),
        "overhead_anon_mib": round(last["anon_mib"] - last["buffer_mib"], 1),
        "samples": [{k: round(v, 2) if isinstance(v, float) else v for k, v in s.items()} for s in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prefetch-batches", type=int, default=2)
    parser.add_argument(
        "--origin",
        choices=("local", "http"),
        default="http",
        help="read the shards from local disk, or over HTTP (the remote tier, as `omnifeed chaos`)",
    )
    parser.add_argument("--latency-ms", type=float, default=0.0, help="HTTP origin: delay of every request")
    parser.add_argument("--ram-mib", type=int, default=0, help="RAM cache tier capacity (0: no RAM tier)")
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause after each epoch before sampling")
    parser.add_argument("--baseline", type=int, default=4, help="epoch the growth is measured from")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the service's environment")
    parser.add_argument("--malloc-stats", action="store_true", help="diagnostics: sample glibc's mallinfo2()")
    parser.add_argument(
        "--trim-every-s",
        type=float,
        default=0.0,
        help="diagnostics: call malloc_trim(0) in the service every so many seconds (implies --malloc-stats)",
    )
    parser.add_argument(
        "--gc-every-s",
        type=float,
        default=0.0,
        help="diagnostics: call gc.collect() in the service every so many seconds (implies --malloc-stats)",
    )
    parser.add_argument("--work", default=str(_HERE / "_work" / "service-memory"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--verbose", "-v", action="store_true", help="print each sample as it is taken")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.shards, args.epochs, args.baseline = 48, 3, 4, 1
    out = args.out or (None if args.quick else str(_HERE / "results-service-memory.json"))
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
