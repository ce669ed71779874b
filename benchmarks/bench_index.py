"""Index build and index open, measured side by side with the naive alternative.

    python benchmarks/bench_index.py [--rows 1000000] [--open-rows 10000000] [--scan-samples 1920]

1. build: write an index from ``--rows`` generated rows (the partition/sort/write stage of
   ``omnifeed index``; scanning real media is measured separately in 3).
2. open: in a fresh process per case, the private memory (resident minus file-backed pages) and time to open an index
   of ``--open-rows`` rows and touch it (random ``sample()`` lookups, ``keys()`` of a
   micro-batch), for ``SampleIndex`` (memory-mapped Arrow) against reading the same
   Parquet partitions with ``pyarrow.parquet.read_table`` — what a rank does without a
   memory-mapped index. File-backed pages of the mapped index live in the page cache,
   shared by all ranks of the node, and can be dropped under memory pressure.
3. scan: ``build_index`` over the generated demo dataset (real JPEG/PNG/H.264/FLAC headers),
   with 1 and 2 worker processes: samples/s.

Prints one JSON object with every figure; ratios are against the naive open.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

HERE = Path(__file__).resolve().parent


def synthetic_tables(rows: int, shard_rows: int = 10_000):
    """Row tables shaped like a scan of ``rows`` image+caption samples, one per 'shard'."""
    from omnifeed.loader.index._sample_index import LENGTH_COLUMNS, ROW_SCHEMA

    rng = np.random.default_rng(0)
    for shard, start in enumerate(range(0, rows, shard_rows)):
        n = min(shard_rows, rows - start)
        keys = pa.array([f"sample-{i:010d}" for i in range(start, start + n)])
        sizes = rng.integers(2_000, 200_000, size=(n, 2))
        offsets = np.cumsum(sizes.ravel() + 512).reshape(n, 2) - sizes
        names = pa.array(np.tile(["jpg", "txt"], n))
        members = pa.array([f"sample-{i:010d}.{e}" for i in range(start, start + n) for e in ("jpg", "txt")])
        fields = pa.StructArray.from_arrays(
            [
                names,
                pa.array(np.tile(["image", "text"], n)),
                members,
                pa.array(offsets.ravel()),
                pa.array(sizes.ravel()),
            ],
            fields=list(ROW_SCHEMA.field("fields").type.value_type),
        )
        columns = {
            "key": keys,
            "shard": pa.array(np.full(n, shard, np.int32)),
            "shard_row": pa.array(np.arange(n)),
            "row_group": pa.array(np.full(n, -1, np.int32)),
            "row": pa.array(np.full(n, -1, np.int64)),
            "fields": pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32)), fields),
        }
        for name, dtype in LENGTH_COLUMNS.items():
            columns[name] = pa.array(np.zeros(n), dtype)
        columns["text_tokens"] = pa.array(rng.lognormal(3, 1, n).astype(np.int32) + 1)
        columns["image_width"] = pa.array(rng.integers(64, 2048, n).astype(np.int32))
        columns["image_height"] = pa.array(rng.integers(64, 2048, n).astype(np.int32))
        columns["row_digest"] = pa.array(rng.integers(0, 2**63, n).astype(np.uint64))
        yield pa.table(columns, schema=ROW_SCHEMA)


def build(rows: int, out: Path) -> dict:
    """Write a ``rows``-row index; time it."""
    from omnifeed.loader import IndexConfig, ShardSpec
    from omnifeed.loader.index._build import write_index_from_tables

    shards = [ShardSpec(f"s3://bucket/shard-{i:06d}.tar", "tar") for i in range(-(-rows // 10_000))]
    if out.exists():
        shutil.rmtree(out)
    start = time.perf_counter()
    report = write_index_from_tables(synthetic_tables(rows), shards, [0] * len(shards), out, IndexConfig(partitions=16))
    seconds = time.perf_counter() - start
    disk = {s: sum(p.stat().st_size for p in out.glob(f"*.{s}")) for s in ("parquet", "arrow", "npy")}
    return {
        "rows": report.num_samples,
        "seconds": round(seconds, 2),
        "rows_per_s": round(rows / seconds),
        "disk_mb": {k: round(v / 2**20, 1) for k, v in disk.items()},
    }


_OPEN_PROBE = r"""
import json, sys, time, numpy as np
def uss():  # anonymous (private, not file-backed) resident memory
    import psutil; m = psutil.Process().memory_info(); return m.rss - m.shared
import pyarrow as pa, pyarrow.parquet as pq
from omnifeed.loader import SampleIndex
path, how = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(1)
base = uss(); t = time.perf_counter()
if how == "mmap":
    index = SampleIndex(path); n = index.num_samples
    opened = time.perf_counter() - t; after_open = uss()
    for p in rng.integers(0, n, 1000): index.sample(int(p))
    keys = index.keys(rng.integers(0, n, 256))
else:
    import glob
    table = pa.concat_tables([pq.read_table(f) for f in sorted(glob.glob(path + "/part-*.parquet"))])
    n = table.num_rows
    opened = time.perf_counter() - t; after_open = uss()
    for p in rng.integers(0, n, 1000): table.slice(int(p), 1).to_pylist()
    keys = table["key"].take(pa.array(rng.integers(0, n, 256))).to_pylist()
print(json.dumps({"rows": n, "open_s": round(opened, 3), "open_mb": round((after_open - base) / 2**20, 1),
                  "touched_mb": round((uss() - base) / 2**20, 1), "seconds": round(time.perf_counter() - t, 3)}))
"""


def open_cost(path: Path) -> dict:
    """Private memory and time to open and touch the index, memory-mapped vs read from Parquet."""
    results = {}
    for how in ("mmap", "parquet_read"):
        out = subprocess.run(
            [sys.executable, "-c", _OPEN_PROBE, str(path), how], capture_output=True, text=True, check=True
        )
        results[how] = json.loads(out.stdout)
    results["private_memory_ratio_mmap_vs_parquet"] = round(
        results["mmap"]["touched_mb"] / max(results["parquet_read"]["touched_mb"], 0.1), 4
    )
    return results


def scan(samples: int, work: Path) -> dict:
    """``build_index`` over the generated demo dataset with 1 and 2 workers."""
    from omnifeed.loader import IndexConfig, build_index
    from omnifeed.tools._demo_data import DemoDatasetSpec, write_webdataset

    shards = write_webdataset(work / "demo", DemoDatasetSpec(num_samples=samples, num_shards=8))
    mb = sum(p.stat().st_size for p in shards) / 2**20
    result: dict = {"samples": samples, "shards": len(shards), "mb": round(mb, 1)}
    for workers in (1, 2):
        start = time.perf_counter()
        build_index([str(p) for p in shards], work / f"scan-{workers}", IndexConfig(workers=workers), progress=False)
        seconds = time.perf_counter() - start
        result[f"workers_{workers}"] = {
            "seconds": round(seconds, 2),
            "samples_per_s": round(samples / seconds, 1),
            "mb_per_s": round(mb / seconds, 1),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--open-rows", type=int, default=10_000_000)
    parser.add_argument("--scan-samples", type=int, default=1920)
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    report = {"machine": {"cpus": os.cpu_count()}, "build": build(args.rows, args.work / "build")}
    report["open"] = {str(args.rows): open_cost(args.work / "build")}
    if args.open_rows != args.rows:
        report["build_large"] = build(args.open_rows, args.work / "large")
        report["open"][str(args.open_rows)] = open_cost(args.work / "large")
    if args.scan_samples:
        report["scan"] = scan(args.scan_samples, args.work)
    print(json.dumps(report, indent=1))
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
