"""Epochs from slow remote storage, then from the NVMe tier, then from the RAM tier — against DataLoader.

A real HTTP server on loopback serves WebDataset image shards and adds ``--latency`` seconds
to every request (a remote object store's first-byte latency). One run measures, on the
same data and the same decode:

1. ``DataLoader`` (map-style dataset doing the same ranged reads over fsspec HTTP, Pillow
   decode, ``--workers`` workers): every epoch is cold — it has no cache;
2. ``Feed`` cold: no tiers yet, reads through the remote tier's I/O threads;
3. ``Feed`` NVMe-warm: second epoch after the first filled the LMDB tier (no RAM tier);
4. ``Feed`` RAM-warm: second epoch with the RAM tier filled as well;
5. pre-caching throughput: ``omnifeed precache`` of the whole index into an empty NVMe tier
   (in this process with 16 I/O threads, and with ``--workers`` processes) against a plain
   copy of the same fields' byte ranges to local files with 16 threads over the same server.

    .venv/bin/python benchmarks/bench_cache.py [--images 600] [--latency 0.02] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from range_http import RangeServer  # noqa: E402

from omnifeed.cache import CacheConfig, NvmeTierConfig, RamTier, RamTierConfig, RemoteTierConfig  # noqa: E402
from omnifeed.loader import (  # noqa: E402
    DecodeConfig,
    Feed,
    FeedConfig,
    ImageDecodeConfig,
    IndexConfig,
    PlanConfig,
    PoolConfig,
    SampleIndex,
    build_index,
    make_decoder,
)
from omnifeed.loader.feed._pipeline import fields_to_decode  # noqa: E402
from omnifeed.tools._bench_dataset import write_images  # noqa: E402
from omnifeed.tools._precache import PrecacheJob  # noqa: E402
from omnifeed.tools._precache_run import precache_local  # noqa: E402

_DECODE = DecodeConfig(image=ImageDecodeConfig(resize="short_side", size=224, crop="center"))


class RangedImages(torch.utils.data.Dataset):
    """The DataLoader side: one fsspec HTTP ranged read and one decode per sample."""

    def __init__(self, index: SampleIndex) -> None:
        self.locations = []
        for sample in index.samples(list(range(index.num_samples))):
            field = next(f for f in sample.fields if f.modality == "image")
            self.locations.append((sample.shard.url, field.offset, field.size, sample.key))
        self.decode = make_decoder("image", _DECODE)

    def __len__(self) -> int:
        return len(self.locations)

    def __getitem__(self, i: int) -> torch.Tensor:
        url, offset, size, key = self.locations[i]
        fs, path = fsspec.core.url_to_fs(url)
        return torch.from_numpy(
            self.decode(fs.cat_file(path, start=offset, end=offset + size), key)  # type: ignore[arg-type]
        )


def _serve(root: Path, delay: Any, ready: Any) -> None:
    """The HTTP server in its own process, so its CPU is not the loaders' (the delay is shared memory)."""
    with RangeServer(root).running() as server:
        ready.put(server.url)
        while True:
            server.delay_s = delay.value
            time.sleep(0.01)


def dataloader_epoch(index: SampleIndex, workers: int, batch_size: int) -> float:
    loader = torch.utils.data.DataLoader(
        RangedImages(index), batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=False
    )
    started = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    return count / (time.perf_counter() - started)


def feed_epoch(feed: Feed) -> float:
    started = time.perf_counter()
    count = sum(len(batch["__key__"]) for batch in iter(feed))
    return count / (time.perf_counter() - started)


def plain_copy(index: SampleIndex, out: Path, threads: int) -> float:
    """Bytes/s of fetching the byte range of every field precache stores and writing it to a local file."""
    out.mkdir()
    jobs = []
    for sample in index.samples(list(range(index.num_samples))):
        for _, field in fields_to_decode(sample):  # the same fields precache fetches: the image and the meta
            jobs.append((sample.shard.url, field.offset, field.size, out / f"{sample.key}.{field.name}"))

    def copy(job: tuple[str, int, int, Path]) -> int:
        url, offset, size, target = job
        fs, path = fsspec.core.url_to_fs(url)
        target.write_bytes(fs.cat_file(path, start=offset, end=offset + size))
        return size

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(copy, jobs))
    return total / (time.perf_counter() - started)


def precache_rate(index_dir: Path, cache_dir: Path, workers: int) -> dict[str, Any]:
    """Bytes/s of `omnifeed precache` (local processes) filling an empty NVMe tier from the same server."""
    index = SampleIndex(index_dir)
    job = PrecacheJob(
        index=str(index_dir),
        nvme=NvmeTierConfig(path=str(cache_dir), capacity_bytes=8 * 2**30),
        remote=RemoteTierConfig(io_threads=16),
    )
    report = precache_local(job, list(range(len(index.manifest["partitions"]))), workers=workers, progress=False)
    counts = report.counts
    return {
        "bytes_per_s": counts.fetched_bytes / report.seconds,
        "seconds": report.seconds,
        "cached": counts.cached,
        "failed": counts.failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds added to every HTTP request")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results-cache.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="omnifeed-bench-cache-"))
    ram_name = f"bench-{uuid.uuid4().hex[:10]}"
    try:
        shards = write_images(work / "shards", args.images)
        context = multiprocessing.get_context("fork")
        delay, ready = context.Value("d", 0.0), context.Queue()
        server = context.Process(target=_serve, args=(work / "shards", delay, ready), daemon=True)
        server.start()
        try:
            url = ready.get(timeout=60)
            build_index([f"{url}/{p.name}" for p in shards], work / "index", IndexConfig(workers=1), progress=False)
            index = SampleIndex(work / "index")
            nbytes = sum(f.size for s in index.samples(list(range(index.num_samples))) for f in s.fields)
            delay.value = args.latency
            plan = PlanConfig(seed=0, batch_size=args.batch_size)
            pools = {"image": PoolConfig(workers=args.workers)}
            remote = RemoteTierConfig(io_threads=16)
            results: dict[str, Any] = {
                "images": index.num_samples,
                "dataset_bytes": nbytes,
                "latency_s": args.latency,
                "workers": args.workers,
            }

            results["dataloader_cold"] = dataloader_epoch(index, args.workers, args.batch_size)
            cold = FeedConfig(
                plan=plan, decode=_DECODE, pools=pools, shared_workers=0, cache=CacheConfig(remote=remote)
            )
            with Feed(index, cold) as feed:
                results["feed_cold"] = feed_epoch(feed)
            nvme = NvmeTierConfig(path=str(work / "nvme"), capacity_bytes=4 * 2**30)
            with Feed(index, cold.model_copy(update={"cache": CacheConfig(remote=remote, nvme=nvme)})) as feed:
                results["feed_filling_nvme"] = feed_epoch(feed)
                results["feed_nvme_warm"] = feed_epoch(feed)
            ram = RamTierConfig(name=ram_name, capacity_bytes=2 * 2**30)
            with Feed(index, cold.model_copy(update={"cache": CacheConfig(remote=remote, nvme=nvme, ram=ram)})) as feed:
                results["feed_filling_ram"] = feed_epoch(feed)
                results["feed_ram_warm"] = feed_epoch(feed)
                results["tiers_after_ram_warm"] = {
                    k: {n: v[n] for n in ("hits", "misses", "bytes_hit")}
                    for k, v in feed.metrics()["cache"].items()
                    if k in ("ram", "nvme")
                }

            results["plain_copy_bytes_per_s"] = plain_copy(index, work / "copy", threads=16)
            # like for like with the plain copy: one process, 16 reads in flight; then with worker processes
            results["precache"] = precache_rate(work / "index", work / "precache-nvme", 1)
            results["precache_workers"] = precache_rate(work / "index", work / "precache-nvme-2", args.workers)
        finally:
            server.kill()
        base = results["dataloader_cold"]
        results["ratios_to_dataloader"] = {
            k: results[k] / base for k in ("feed_cold", "feed_nvme_warm", "feed_ram_warm")
        }
        results["precache_to_plain_copy"] = results["precache"]["bytes_per_s"] / results["plain_copy_bytes_per_s"]
        print(json.dumps(results, indent=2))
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        RamTier.remove(ram_name)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
