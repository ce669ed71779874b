"""Index build per core, locally and with `omnifeed index --ray` on a local multi-node Ray cluster.

    python benchmarks/bench_index_ray.py [--samples 24000] [--shards 48] [--mixed-samples 480] [--nodes 2]
        [--write-rows 1000000] [--out FILE]

Real media written with the tools users use (WebDataset ``TarWriter``):

- ``image_caption``: JPEG (192–640 px sides, a pool of distinct pictures cycled) + caption
  ``txt`` + ``json``, the shape of a LAION-style web dataset;
- ``mixed``: the demo generator's shards (JPEG/PNG, text, H.264 MP4, FLAC).

Each dataset is indexed through the real CLI (``python -m omnifeed.tools index``) in a
subprocess: ``--workers 1``, ``--workers 2``, then ``--ray ADDRESS`` against a
``ray.cluster_utils.Cluster`` started here (head + ``--nodes - 1`` worker nodes, 1 CPU each:
simulated nodes sharing this machine's cores). CPU is the user+system time of every process
of the run's tree (the CLI, its pool or Ray's workers and daemons), sampled from ``/proc``.
The Ray-built index must equal the local one (fingerprint, manifest, partitions). A cProfile
of one shard's scan says where a sample's CPU goes; ``bench_index.build`` times the stage that
stays on the one driver machine (partition, sort, write) on ``--write-rows`` generated rows.
Prints one JSON object (``--out`` also writes it); the projection to 10⁹ samples is arithmetic
on the measured rates.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

HERE = Path(__file__).resolve().parent
PROJECT_CORES = (64, 512, 4096)
TARGET_SAMPLES = 10**9
_WORDS = (
    "a photo of the red blue green small large old new dog cat house tree street city river "
    "mountain person car bike sunset beach food table window light night morning woman man child"
).split()


def write_image_caption(out: Path, samples: int, shards: int, pool: int = 96) -> list[Path]:
    """WebDataset shards of JPEG + caption + json; ``pool`` distinct pictures cycled (bytes are what the scan reads)."""
    import webdataset

    from omnifeed.tools._demo_data import encode_image

    rng = np.random.default_rng(0)
    sides = rng.integers(192, 641, size=(pool, 2))
    jpegs = [encode_image(int(w), int(h), "jpg", seed=i) for i, (w, h) in enumerate(sides)]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        path = out / f"shard-{s:05d}.tar"
        with open(path, "wb") as f, webdataset.TarWriter(f, encoder=False) as tw:
            for i in range(s * samples // shards, (s + 1) * samples // shards):
                words = rng.choice(_WORDS, int(rng.integers(5, 40)))
                meta = {"width": int(sides[i % pool][0]), "height": int(sides[i % pool][1]), "i": i}
                tw.write(
                    {
                        "__key__": f"img-{i:09d}",
                        "jpg": jpegs[i % pool],
                        "txt": " ".join(words).encode(),
                        "json": json.dumps(meta).encode(),
                    }
                )
        paths.append(path)
    return paths


def write_mixed(out: Path, samples: int) -> list[Path]:
    """The demo generator's WebDataset shards: images, text, H.264 clips, FLAC audio."""
    from omnifeed.tools._demo_data import DemoDatasetSpec, write_webdataset

    return write_webdataset(out, DemoDatasetSpec(num_samples=samples, num_shards=max(2, samples // 120)))


class TreeCpu:
    """User+system CPU seconds of this process's descendants, sampled every ``period`` s while running.

    Each process gets a role when first seen: ``driver`` (the CLI), ``pool`` (the CLI's own
    children: the local scan pool), ``ray_worker`` (a ``ray::`` process) or ``ray_daemon``.
    """

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.driver = -1
        self.base = {key: cpu for key, (cpu, _) in self._sample().items()}
        self.last: dict[tuple[int, float], tuple[float, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _role(self, p: psutil.Process, before: str | None) -> str:
        if before in ("driver", "pool", "ray_worker"):
            return before  # a worker's command line empties as it exits
        if p.pid == self.driver:
            return "driver"
        if any(a.pid == self.driver for a in p.parents()):
            return "pool"
        cmd = " ".join(p.cmdline()[:2])
        if not cmd and before:
            return before
        agent = "DashboardAgent" in cmd or "RuntimeEnvAgent" in cmd
        return "ray_worker" if "default_worker.py" in cmd or (cmd.startswith("ray::") and not agent) else "ray_daemon"

    def _sample(self) -> dict[tuple[int, float], tuple[float, str]]:
        seen = {}
        last = getattr(self, "last", {})
        for p in psutil.Process().children(recursive=True):
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    key = (p.pid, p.create_time())
                    role = self._role(p, last[key][1] if key in last else None)
                    seen[key] = (t.user + t.system, role)  # not children_*: every descendant is counted itself
            except psutil.Error:
                continue
        return seen

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.last.update(self._sample())

    def start(self, driver: int) -> None:
        """Start sampling, ``driver`` being the CLI's pid."""
        self.driver = driver
        self._thread.start()

    def stop(self) -> dict[str, float]:
        """Stop; CPU seconds spent during the window by role."""
        self._stop.set()
        self._thread.join()
        self.last.update(self._sample())
        out = {"driver": 0.0, "pool": 0.0, "ray_worker": 0.0, "ray_daemon": 0.0}
        for key, (cpu, role) in self.last.items():
            out[role] += max(0.0, cpu - self.base.get(key, 0.0))
        return {k: round(v, 3) for k, v in out.items()}


def run_cli(sources: list[Path], out: Path, extra: list[str], samples: int, cores: int) -> dict:
    """One ``omnifeed index`` through the CLI in a subprocess: wall time, CPU by role, the summary."""
    cmd = [sys.executable, "-m", "omnifeed.tools", "index", *map(str, sources), "--out", str(out)]
    cmd += ["--partitions", "4", "--json", "--no-progress", *extra]
    cpu = TreeCpu()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cpu.start(proc.pid)
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - start
    roles = cpu.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"omnifeed index {' '.join(extra)} exited {proc.returncode}: {stderr[-2000:]}")
    work = roles["driver"] + roles["pool"] + roles["ray_worker"]
    summary = json.loads(stdout.strip().splitlines()[-1])
    return {
        "command": "omnifeed index SOURCES --out OUT --partitions 4 --json --no-progress " + " ".join(extra),
        "samples": summary["samples"],
        "fingerprint": summary["fingerprint"],
        "cores": cores,
        "seconds": round(seconds, 2),
        "samples_per_s": round(samples / seconds, 1),
        "samples_per_s_per_core": round(samples / seconds / cores, 1),
        "cpu_s": roles,
        "cpu_ms_per_sample": round(1000 * work / samples, 3),
        "cpu_ms_per_sample_with_ray_daemons": round(1000 * sum(roles.values()) / samples, 3),
    }


def index_differences(a: Path, b: Path) -> list[str]:
    """Files of two index folders that differ (the manifest compared without ``config.workers``)."""

    def manifest(folder: Path) -> dict:
        m = json.loads((folder / "manifest.json").read_text())
        m["config"].pop("workers", None)
        return m

    names = sorted({p.name for p in a.iterdir() if p.is_file()} | {p.name for p in b.iterdir() if p.is_file()})
    return [
        n
        for n in names
        if not ((a / n).exists() and (b / n).exists())
        or (manifest(a) != manifest(b) if n == "manifest.json" else (a / n).read_bytes() != (b / n).read_bytes())
    ]


_GROUPS = {  # where a sample's scan CPU goes: profiled functions' own time, grouped by where they live
    "tar_headers (tarfile)": ("tarfile.py",),
    "image_probe (Pillow header)": ("PIL/",),
    "video_audio_probe (PyAV)": ("av/", "av.container", "av.stream", "av.format"),
    "digest (xxhash)": ("xxh",),
    "text_tokens": ("_tokenizers.py", "re.Pattern", "probe_text"),
    "rows (dataclasses.asdict, Arrow)": ("dataclasses.py", "copy.py", "_rows_of", "pyarrow"),
}


def scan_steady(shards: list[Path]) -> dict:
    """CPU per sample of the scan itself (``scan_job``, what a pool worker or Ray task runs per shard), warm, in
    this process; then a cProfile of one shard: the share of that CPU by group."""
    from omnifeed.loader import IndexConfig
    from omnifeed.loader.index._scan_pool import scan_job
    from omnifeed.loader.index._sources import expand_sources

    specs = expand_sources([str(s) for s in shards])
    scan_job((0, specs[0], IndexConfig()))  # imports, first-touch of the codecs
    cpu0, samples = time.process_time(), 0
    for i, spec in enumerate(specs):
        samples += scan_job((i, spec, IndexConfig()))[1].num_rows
    cpu = time.process_time() - cpu0
    prof = cProfile.Profile()
    prof.enable()
    scan_job((0, specs[0], IndexConfig()))
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    total = stats.total_tt  # type: ignore[attr-defined]
    groups = dict.fromkeys(_GROUPS, 0.0)
    for (file, _, func), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        for name, marks in _GROUPS.items():
            if any(m in f"{file}:{func}" for m in marks):
                groups[name] += tottime
                break
    share = {k: round(v / total, 3) for k, v in groups.items()}
    share["rest (reads, sample assembly)"] = round(1 - sum(share.values()), 3)
    return {
        "samples": samples,
        "cpu_ms_per_sample": round(1000 * cpu / samples, 3),
        "samples_per_s_per_core": round(samples / cpu, 1),
        "profile_share_of_scan_cpu": share,
    }


def bench_dataset(name: str, sources: list[Path], samples: int, work: Path, address: str | None, nodes: int) -> dict:
    """Local builds with 1 and 2 workers, then ``--ray`` on the cluster (the whole set and its first quarter: the
    driver's CPU per sample is the difference); checks the Ray-built index equals the local one."""
    mb = sum(p.stat().st_size for p in sources) / 2**20
    result: dict = {"samples": samples, "shards": len(sources), "mb": round(mb, 1)}
    for workers in (1, 2):
        result[f"local_workers_{workers}"] = run_cli(
            sources, work / f"{name}-w{workers}", ["--workers", str(workers)], samples, workers
        )
    if address is not None:
        result["ray_nodes"] = nodes
        ray_run = run_cli(sources, work / f"{name}-ray", ["--ray", address], samples, nodes)
        ray_run["files_differing_from_local"] = index_differences(work / f"{name}-ray", work / f"{name}-w1")
        ray_run["same_fingerprint"] = ray_run["fingerprint"] == result["local_workers_1"]["fingerprint"]
        result["ray"] = ray_run
        if len(sources) >= 4 and samples >= 4000:  # below that, fixed start-up costs swamp the difference
            quarter = sources[: len(sources) // 4]
            part = run_cli(
                quarter, work / f"{name}-ray-q", ["--ray", address], samples * len(quarter) // len(sources), nodes
            )
            result["ray_first_quarter"] = part
            extra = ray_run["samples"] - part["samples"]
            driver = ray_run["cpu_s"]["driver"] - part["cpu_s"]["driver"]
            workers = ray_run["cpu_s"]["ray_worker"] - part["cpu_s"]["ray_worker"]
            result["ray_marginal"] = {
                "between_samples": [part["samples"], ray_run["samples"]],
                "driver_cpu_ms_per_sample": round(1000 * driver / extra, 4),
                "ray_worker_cpu_ms_per_sample": round(1000 * workers / extra, 4),
            }
    result["scan_in_process"] = scan_steady(sources[: max(2, len(sources) // 4)])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=24000, help="image+caption samples")
    parser.add_argument("--shards", type=int, default=48, help="image+caption shards")
    parser.add_argument("--mixed-samples", type=int, default=480, help="demo samples with video/audio (0: skip)")
    parser.add_argument("--nodes", type=int, default=2, help="simulated Ray nodes of 1 CPU (0: skip --ray)")
    parser.add_argument(
        "--write-rows", type=int, default=1_000_000, help="rows for the driver's partition/sort/write stage (0: skip)"
    )
    parser.add_argument("--work", type=Path, default=HERE / "_work" / "index_ray")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    report: dict = {"machine": {"cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in os.getloadavg()]}}
    start = time.perf_counter()
    datasets = {"image_caption": (write_image_caption(args.work / "ic", args.samples, args.shards), args.samples)}
    if args.mixed_samples:
        datasets["mixed"] = (write_mixed(args.work / "mixed", args.mixed_samples), args.mixed_samples)
    report["generate_seconds"] = round(time.perf_counter() - start, 1)
    cluster = None
    try:
        address = None
        if args.nodes:
            from ray.cluster_utils import Cluster

            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
            for _ in range(args.nodes - 1):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            address = cluster.address
        for name, (sources, samples) in datasets.items():
            report[name] = bench_dataset(name, sources, samples, args.work, address, args.nodes)
        if args.write_rows:
            sys.path.insert(0, str(HERE))
            from bench_index import build  # the write stage of `omnifeed index`, as bench_index.py measures it

            report["driver_write"] = build(args.write_rows, args.work / "write")
    finally:
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(args.work, ignore_errors=True)
    report["machine"]["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    ic = report["image_caption"]
    steady = ic["scan_in_process"]["samples_per_s_per_core"]
    end_to_end = ic.get("ray", ic["local_workers_2"])
    driver_ms = ic.get("ray_marginal", {}).get("driver_cpu_ms_per_sample")
    write = report.get("driver_write")
    report["projection_1e9"] = {
        "basis": "image_caption: scan CPU per sample in a warm worker (scan_in_process); a projection, not a run",
        "per_core_samples_per_s": steady,
        "end_to_end_per_core_samples_per_s": end_to_end["samples_per_s_per_core"],
        "driver_cpu_ms_per_sample": driver_ms,
        "driver_write_hours": None if not write else round(TARGET_SAMPLES / write["rows_per_s"] / 3600, 2),
        "rows": [
            {
                "cores": cores,
                "scan_hours": round(TARGET_SAMPLES / (steady * cores) / 3600, 2),
                "scan_hours_at_end_to_end_rate": round(
                    TARGET_SAMPLES / (end_to_end["samples_per_s_per_core"] * cores) / 3600, 2
                ),
            }
            for cores in PROJECT_CORES
        ],
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
