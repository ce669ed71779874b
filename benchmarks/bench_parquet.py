"""Parquet and Arrow random access against tar shards: one Feed epoch over the same JPEGs in each layout (issue 28).

    python benchmarks/bench_parquet.py [--images 1600] [--rounds 3] [--quick] [--work DIR]

The same ``--images`` JPEGs (about 100 KB each, noise over gradients; an int label) are
written four ways, each by its own tool with that tool's defaults (no row-group or page size
chosen here):

1. ``tar``: WebDataset shards, ``webdataset.ShardWriter`` defaults (``jpg``, ``cls``);
2. ``parquet_pyarrow``: ``pyarrow.parquet.write_table`` defaults (one row group; the first
   1,024 images of the column in its dictionary page, the rest in pages of up to 1,024);
3. ``parquet_datasets``: ``datasets.Dataset.to_parquet`` defaults (``Image()`` and ``Value('int64')``);
4. ``arrow_datasets``: ``datasets.Dataset.save_to_disk`` defaults (Arrow IPC stream files).

Each is indexed by ``build_index`` with no config; then one ``Feed`` epoch (batch 32, image
short side 64, centre crop, the default pools) runs over each layout in a fresh process, so
every epoch is a first epoch (no page or file kept from an earlier one), the layouts taking
turns round after round. Reported: each layout's median samples/s over ``--rounds``, its ratio
to tar (``vs_tar``: the median over rounds of its rate over tar's in the same round, which the
load of a shared machine moves less than either; also the ratio of the medians), and what one ``read_field`` of an image
costs (``--cells`` random cells read one by one in a fresh process: mean, median and the first). ``--quick`` (a smoke
test): 64 images, one round. Prints one JSON object.

Run with ``PYTHONPATH`` naming a folder whose ``omnifeed`` is another checkout, it measures that
checkout (the "before" figures of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LAYOUTS = ("tar", "parquet_pyarrow", "parquet_datasets", "arrow_datasets")


def jpeg(i: int) -> bytes:
    """A ~100 KB 352×240 JPEG: coarse noise over a gradient, different for every ``i``."""
    from PIL import Image

    rng = np.random.default_rng(i)
    height, width = 240, 352
    y, x = np.mgrid[0 : height // 2, 0 : width // 2]
    gradient = np.stack([x * 255 // (width // 2), y * 255 // (height // 2), np.full_like(x, (i * 37) % 256)], -1)
    noise = rng.integers(0, 256, (height // 2, width // 2, 3))
    pixels = (0.25 * gradient + 0.75 * noise).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).resize((width, height), Image.NEAREST).save(out, "JPEG", quality=95)
    return out.getvalue()


def write_layouts(work: Path, images: int) -> tuple[dict[str, str], dict[str, object]]:
    """The images in each layout: layout -> source URL for ``build_index``, and what the files look like."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset

    datasets.disable_progress_bars()
    jpegs = [jpeg(i) for i in range(images)]
    labels = [i % 10 for i in range(images)]
    (work / "tar").mkdir(parents=True)
    with webdataset.ShardWriter(str(work / "tar" / "images-%04d.tar"), verbose=0) as sink:
        for i, (data, label) in enumerate(zip(jpegs, labels)):
            sink.write({"__key__": f"img-{i:06d}", "jpg": data, "cls": str(label).encode()})
    pq.write_table(pa.table({"jpg": jpegs, "cls": labels}), work / "pyarrow.parquet")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict(
        {"image": [{"bytes": d, "path": None} for d in jpegs], "label": labels}, features=features
    )
    dataset.to_parquet(str(work / "datasets.parquet"))
    dataset.save_to_disk(str(work / "saved"))
    sources = {
        "tar": str(work / "tar" / "*.tar"),
        "parquet_pyarrow": str(work / "pyarrow.parquet"),
        "parquet_datasets": str(work / "datasets.parquet"),
        "arrow_datasets": str(work / "saved"),
    }
    facts: dict[str, object] = {"mean_jpeg_bytes": round(sum(map(len, jpegs)) / images)}
    for name in ("parquet_pyarrow", "parquet_datasets"):
        meta = pq.ParquetFile(sources[name]).metadata
        facts[f"{name}_row_groups"] = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    return sources, facts


def epoch(index_path: str, seed: int) -> dict[str, float]:
    """One Feed epoch over the index (in this process): samples and seconds."""
    from omnifeed.loader import DecodeConfig, Feed, FeedConfig, ImageDecodeConfig, PlanConfig

    config = FeedConfig(
        plan=PlanConfig(seed=seed, batch_size=32),
        decode=DecodeConfig(image=ImageDecodeConfig(resize="short_side", size=64, crop="center")),
    )
    samples, start = 0, time.perf_counter()
    with Feed(index_path, config) as feed:
        for batch in feed:
            samples += len(batch["__key__"])
    return {"samples": samples, "seconds": time.perf_counter() - start}


def cells(index_path: str, count: int) -> dict[str, float]:
    """``read_field`` of the image field of ``count`` random samples (in this process): ms per cell."""
    import random

    from omnifeed.loader import SampleIndex, read_field

    index = SampleIndex(index_path)
    positions = random.Random(0).sample(range(len(index)), min(count, len(index)))
    times = []
    for sample in index.samples(positions):
        image = next(f for f in sample.fields if f.modality == "image")
        start = time.perf_counter()
        read_field(sample.shard, image, row_group=sample.row_group, row=sample.row)
        times.append(time.perf_counter() - start)
    return {
        "cells": len(times),
        "mean_ms": 1e3 * statistics.mean(times),
        "median_ms": 1e3 * statistics.median(times),
        "first_ms": 1e3 * times[0],
    }


def _in_child(*args: str) -> dict[str, float]:
    run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=3600, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=None, help="default 1600 (--quick: 64)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, among: " + ", ".join(LAYOUTS))
    parser.add_argument("--quick", action="store_true", help="a smoke test: 64 images, one round")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--cells", type=int, default=200, help="random image cells read one by one per layout")
    parser.add_argument("--epoch", default=None, help=argparse.SUPPRESS)  # child: one epoch over this index
    parser.add_argument("--read-cells", default=None, help=argparse.SUPPRESS)  # child: --cells reads of this index
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.epoch is not None:
        print(json.dumps(epoch(args.epoch, args.seed)))
        return
    if args.read_cells is not None:
        print(json.dumps(cells(args.read_cells, args.cells)))
        return
    args.images = args.images or (64 if args.quick else 1600)
    args.rounds = args.rounds or (1 if args.quick else 3)
    layouts = [name for name in args.layouts.split(",") if name]
    if "tar" not in layouts or not set(layouts) <= set(LAYOUTS):
        parser.error(f"--layouts must include tar and name only {', '.join(LAYOUTS)}")
    from omnifeed.loader import IndexConfig, build_index

    work = args.work or Path(tempfile.mkdtemp(prefix="omnifeed-bench-parquet-"))
    try:
        started = time.perf_counter()
        sources, facts = write_layouts(work / "data", args.images)
        indexes = {}
        for name in layouts:
            build_index([sources[name]], work / f"index-{name}", IndexConfig(workers=1), progress=False)
            indexes[name] = work / f"index-{name}"
        runs: dict[str, list[float]] = {name: [] for name in layouts}
        for round_ in range(args.rounds):
            for name in layouts:
                result = _in_child("--epoch", str(indexes[name]), "--seed", str(round_))
                if result["samples"] != args.images:
                    raise RuntimeError(f"{name}: the epoch gave {result['samples']} samples, not {args.images}")
                runs[name].append(result["samples"] / result["seconds"])
        reads = {name: _in_child("--read-cells", str(indexes[name]), "--cells", str(args.cells)) for name in layouts}
        tar = statistics.median(runs["tar"])
        report = {
            "images": args.images,
            "rounds": args.rounds,
            **facts,
            "layouts": {
                name: {
                    "samples_per_s": round(statistics.median(rates), 1),
                    "rounds": [round(r, 1) for r in rates],
                    "vs_tar": round(statistics.median(r / t for r, t in zip(rates, runs["tar"])), 3),
                    "vs_tar_of_medians": round(statistics.median(rates) / tar, 3),
                    "cell_read_ms": {k: round(v, 3) for k, v in reads[name].items()},
                }
                for name, rates in runs.items()
            },
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(json.dumps(report, indent=1))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
