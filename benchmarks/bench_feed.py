"""The feed against torch.utils.data.DataLoader on the same data and the same decode code, in one run.

    python benchmarks/bench_feed.py [--images 2048] [--workers 2] [--batch-size 64]

1. *decode limit*: the image decode (JPEG → RGB, short side 224, centre crop 224×224) in
   ``--workers`` bare processes, no loader: the most any loader could reach here;
2. ``DataLoader`` (map-style dataset over the index, ``num_workers=--workers``, batches of
   ``--batch-size``) with Pillow decoding at full size then resizing (``draft=False``);
3. ``Feed`` with the same decode code (``draft=False``) in ``--workers`` image threads, in
   ``--workers`` image processes writing into shared memory (``PoolConfig.processes``, the
   default ``shared_memory``), and in processes that pickle their arrays through the pipe
   (``shared_memory=False``, the path before issue 19);
4. ``Feed`` with omnifeed's image path (``draft=True``: JPEG DCT-domain downscaling), threads and processes;
5. ``Feed`` over a mixed four-modality dataset (the demo generator), for per-modality figures:
   the default pools, every modality in threads, and every modality in ``--workers`` processes.

Each runs one epoch; reported: samples/s, CPU seconds per sample, ratio to DataLoader and
to the decode limit. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

from omnifeed.loader import (
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
    read_field,
)
from omnifeed.tools._bench_dataset import write_images
from omnifeed.tools._demo_data import DemoDatasetSpec, write_webdataset

_IMAGE = dict(resize="short_side", size=224, crop="center")


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _measure(name: str, run, samples: int) -> dict:  # noqa: ANN001
    cpu, start = _cpu(), time.perf_counter()
    extra = run() or {}
    seconds = time.perf_counter() - start
    return {
        "name": name,
        "seconds": round(seconds, 3),
        "samples_per_s": round(samples / seconds, 1),
        "cpu_s_per_sample": round((_cpu() - cpu) / samples * 1e3, 3) / 1e3,
        **extra,
    }


def _decode_range(args: tuple[str, list[int], bool]) -> int:
    index_path, positions, draft = args
    index = SampleIndex(index_path)
    decode = make_decoder("image", DecodeConfig(image=ImageDecodeConfig(**_IMAGE, draft=draft)))
    for position in positions:
        sample = index.sample(position)
        jpg = next(f for f in sample.fields if f.name == "jpg")
        decode(read_field(sample.shard, jpg), sample.key)
    return len(positions)


class IndexImages(torch.utils.data.Dataset):
    """A map-style dataset over the index: the DataLoader's side, with the same decode code."""

    def __init__(self, index_path: str, draft: bool) -> None:
        self.index_path, self.draft = index_path, draft
        self.index: SampleIndex | None = None
        self.num_samples = SampleIndex(index_path).num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, position: int) -> torch.Tensor:
        if self.index is None:  # opened in the worker, after fork
            self.index = SampleIndex(self.index_path)
            self.decode = make_decoder("image", DecodeConfig(image=ImageDecodeConfig(**_IMAGE, draft=self.draft)))
        sample = self.index.sample(position)
        jpg = next(f for f in sample.fields if f.name == "jpg")
        return torch.from_numpy(self.decode(read_field(sample.shard, jpg), sample.key))  # type: ignore[arg-type]


def image_runs(index_path: str, samples: int, workers: int, batch_size: int) -> list[dict]:
    """Decode limit, DataLoader, Feed (same decode), Feed (draft), on the image dataset."""
    chunks = [list(range(w, samples, workers)) for w in range(workers)]
    results = []
    for draft in (False, True):

        def limit() -> None:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                pool.map(_decode_range, [(index_path, chunk, draft) for chunk in chunks])

        results.append(_measure(f"decode_limit_draft_{draft}", limit, samples))

    def dataloader() -> None:
        loader = torch.utils.data.DataLoader(
            IndexImages(index_path, False),
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(0),
        )
        for _ in loader:
            pass

    results.append(_measure("dataloader", dataloader, samples))

    for processes, shared, draft in (
        (0, True, False),
        (workers, True, False),
        (workers, False, False),
        (0, True, True),
        (workers, True, True),
    ):

        def feed() -> dict:
            config = FeedConfig(
                plan=PlanConfig(seed=0, batch_size=batch_size),
                decode=DecodeConfig(image=ImageDecodeConfig(**_IMAGE, draft=draft)),
                pools={
                    "image": PoolConfig(
                        workers=2 * workers if processes else workers,
                        processes=processes,
                        shared_memory=shared,
                        buffer_samples=4 * batch_size,
                    ),
                    "text": PoolConfig(workers=1),
                    "meta": PoolConfig(workers=0),
                },
                shared_workers=0,
            )
            with Feed(index_path, config) as f:
                for _ in f:
                    pass
                return {"consumer_wait_s": round(f.metrics()["consumer_wait_s"], 3)}

        kind = (f"{processes}_processes" + ("" if shared else "_pipe")) if processes else "threads"
        results.append(_measure(f"feed_{kind}_draft_{draft}", feed, samples))
    return results


def _mixed_pools(kind: str, workers: int) -> tuple[dict[str, PoolConfig], int]:
    if kind == "threads":
        return {m: PoolConfig(workers=1) for m in ("image", "video", "audio", "text")} | {
            "meta": PoolConfig(workers=0)
        }, 1
    if kind == "processes":
        return (
            {m: PoolConfig(workers=2 * workers, processes=workers) for m in ("image", "video", "audio", "text")}
            | {"meta": PoolConfig(workers=0)},
            0,
        )
    return FeedConfig().pools, FeedConfig().shared_workers


def mixed_run(work: Path, samples: int, workers: int) -> dict:
    """The four-modality demo dataset through the feed (default pools, all threads, all processes):
    per-modality decode latency, rates and the consumer's wait."""
    shards = write_webdataset(work / "mixed", DemoDatasetSpec(num_samples=samples, num_shards=4))
    index = build_index([str(p) for p in shards], work / "mixed-index", IndexConfig(workers=1), progress=False)
    runs = {}
    for kind in ("default", "threads", "processes"):
        pools, shared = _mixed_pools(kind, workers)
        with Feed(
            index.path, FeedConfig(plan=PlanConfig(seed=0, batch_size=16), pools=pools, shared_workers=shared)
        ) as feed:
            cpu, start = _cpu(), time.perf_counter()
            for _ in feed:
                pass
            seconds = time.perf_counter() - start
            metrics = feed.metrics()
        runs[kind] = {
            "samples": samples,
            "seconds": round(seconds, 3),
            "samples_per_s": round(samples / seconds, 1),
            "cpu_ms_per_sample": round((_cpu() - cpu) / samples * 1e3, 2),
            "consumer_wait_s": round(metrics["consumer_wait_s"], 3),
            "modalities": {
                m: {"decoded": v["decoded"], "p50_ms": round(v["decode_latency_s"]["p50"] * 1e3, 2)}
                for m, v in metrics["modalities"].items()
            },
        }
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--mixed", type=int, default=480)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="omnifeed-bench-feed-"))
    try:
        shards = write_images(work / "images", args.images)
        index = build_index([str(p) for p in shards], work / "index", IndexConfig(workers=1), progress=False)
        runs = image_runs(str(index.path), args.images, args.workers, args.batch_size)
        by_name = {r["name"]: r for r in runs}
        base, limit = by_name["dataloader"]["samples_per_s"], by_name["decode_limit_draft_False"]["samples_per_s"]
        for r in runs:
            r["vs_dataloader"] = round(r["samples_per_s"] / base, 3)
            r["vs_decode_limit_same_code"] = round(r["samples_per_s"] / limit, 3)
        report = {
            "cpus": os.cpu_count(),
            "images": args.images,
            "workers": args.workers,
            "batch_size": args.batch_size,
            "image": runs,
            "mixed": mixed_run(work, args.mixed, args.workers),
        }
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
