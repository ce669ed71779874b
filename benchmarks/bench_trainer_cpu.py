"""Trainer CPU per batch as a trainer sees it: thread CPU around ``next()`` of a `FeedClient` against a running
`omnifeed serve`, and of torch's DataLoader over the same data, in one run.

    python benchmarks/bench_trainer_cpu.py [--photos 4000] [--batches 60] [--step-ms 200] [--quick] [--out FILE]

Two datasets are generated into a temporary folder: ``photos`` (JPEGs of 320×256, batches of 64 decoded to
uint8 ``[64, 3, 224, 224]``: 9.6 MB, 3 tensors) and ``mixed`` (the same pictures with a caption and a class
label, batches of 5: 0.75 MB, 7 tensors and a list of strings; the captions vary in length, so the padded
token tensor changes shape from batch to batch). For each, a real service (``omnifeed serve`` in its own
process, the feed's own decoding) serves a `FeedClient` in this process: ``service`` receives the next batch
ahead on the client's thread (the default, ``receive_ahead=1``), ``service-sync`` on the trainer's thread when
asked (``receive_ahead=0``); ``in-process`` is ``FeedClient.in_process`` on the same feed config without a
service, collating its next batch ahead on the client's thread (``collate_ahead=1``), ``in-process-sync`` collating
in ``next()`` (``collate_ahead=0``); the DataLoader (2 workers, ``batch_size=None``) reads and decodes the same samples
with the same decoders and collate.

The trainer loop is a training loop's: ``batch = next(it)`` while the previous batch is still bound, one
read of a pixel. Two ways: ``step`` sleeps ``--step-ms`` after each batch (a training step: the next
batches are waiting when ``next()`` is called, and this thread's caches are cold, as after a real step),
``wait`` calls ``next()`` at once (the trainer waits for the loader). Measured: ``time.thread_time()``
around ``next()`` (this thread's CPU, user and system: what the trainer's main thread pays), median and
90th percentile over the batches after a warm-up; and the whole trainer process's CPU per batch over the
loop (every thread: the client's receiving thread, the DataLoader's own). Writes
``benchmarks/results-trainer-cpu.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.utils.data as tud
import yaml

from omnifeed.loader import IndexConfig, SampleIndex, build_index, read_field
from omnifeed.loader.service import ServiceConfig, wait_until_serving
from omnifeed.tools._bench_spec import SampleDecoder, collate_samples, decode_config
from omnifeed.tools._demo_data import encode_image
from omnifeed.trainer_adapter import FeedClient

RESULTS = Path(__file__).with_name("results-trainer-cpu.json")
BATCH = {"photos": 64, "mixed": 5}


def write_dataset(work: Path, kind: str, count: int) -> Path:
    """An index of ``count`` samples: 16 distinct JPEGs in turn; ``mixed`` adds a caption (3–40 words) and a label."""
    pictures = [encode_image(320, 256, "jpg", seed=s) for s in range(16)]
    with tarfile.open(work / f"{kind}.tar", "w") as tar:
        for i in range(count):
            fields = {"jpg": pictures[i % 16]}
            if kind == "mixed":
                fields["txt"] = " ".join(f"word{j}" for j in range(3 + (i * 7) % 38)).encode()
                fields["cls"] = str(i % 10).encode()
            for name, data in fields.items():
                info = tarfile.TarInfo(f"s{i:06d}.{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    build_index([str(work / f"{kind}.tar")], work / f"index-{kind}", IndexConfig(workers=1), progress=False)
    return work / f"index-{kind}"


def trainer_loop(batches: Iterator[dict[str, Any]], count: int, warmup: int, step_s: float) -> dict[str, float]:
    """Thread CPU (ms) around each ``next()`` after ``warmup`` (the previous batch stays bound meanwhile), and the
    CPU of the whole trainer process (every thread: a client's thread receiving ahead too) per batch."""
    times = []
    batch = next(batches)
    process = 0.0
    for i in range(warmup + count):
        if i == warmup:
            process = time.process_time()
        if step_s:
            time.sleep(step_s)
        started = time.thread_time()
        batch = next(batches)
        spent = time.thread_time() - started
        int(batch["image"]["pixels"][0, 0, 0, 0])  # the trainer reads its batch
        if i >= warmup:
            times.append(spent * 1e3)
    return {**summary(times), "process_ms_per_batch": round((time.process_time() - process) * 1e3 / count, 4)}


def epochs(loader: Any) -> Iterator[dict[str, Any]]:
    """The loader's batches, epoch after epoch (``next()`` of each epoch's iterator, as a training loop calls it)."""
    while True:
        yield from loader


def summary(times: list[float]) -> dict[str, float]:
    """Median, 90th percentile and mean, ms."""
    ordered = sorted(times)
    return {
        "median_ms": round(statistics.median(ordered), 4),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
        "mean_ms": round(statistics.mean(ordered), 4),
        "batches": len(ordered),
    }


def run_service(
    work: Path, index: Path, kind: str, loops: Callable[[Iterator[dict[str, Any]]], dict[str, Any]], ahead: int = 1
) -> Any:
    """``loops`` over a `FeedClient` (``receive_ahead=ahead``) of an ``omnifeed serve`` of ``index`` (its own
    process)."""
    sockets = work / "sockets"
    sockets.mkdir(mode=0o700, exist_ok=True)
    socket = str(sockets / f"{kind}.sock")
    config = {
        "index": str(index),
        "socket": socket,
        "feed": {
            "plan": {"batch_size": BATCH[kind], "seed": 1},
            "decode": decode_config("image").model_dump(mode="json", include={"image"}),
        },
    }
    (work / f"{kind}.yaml").write_text(yaml.safe_dump(config))
    serve = [str(Path(sys.executable).with_name("omnifeed")), "serve", "--config", str(work / f"{kind}.yaml")]
    process = subprocess.Popen(serve, stdout=subprocess.DEVNULL)
    try:
        wait_until_serving(socket, process)
        with FeedClient(socket, receive_ahead=ahead) as client:
            return loops(epochs(client))
    finally:
        process.terminate()
        process.wait()


def run_in_process(
    work: Path, index: Path, kind: str, loops: Callable[[Iterator[dict[str, Any]]], dict[str, Any]], ahead: int = 1
) -> Any:
    """``loops`` over ``FeedClient.in_process`` (``collate_ahead=ahead``) of the same feed config, no service."""
    config = ServiceConfig.model_validate(
        {
            "index": str(index),
            "socket": str(work / "unused.sock"),
            "feed": {
                "plan": {"batch_size": BATCH[kind], "seed": 1},
                "decode": decode_config("image").model_dump(mode="json", include={"image"}),
            },
        }
    )
    with FeedClient.in_process(config, collate_ahead=ahead) as client:
        return loops(epochs(client))


class BatchDataset(tud.Dataset[dict[str, Any]]):
    """Micro-batch ``i`` of the index in order: its samples read and decoded as the feed does, collated."""

    def __init__(self, index: Path, batch: int) -> None:
        self.path, self.batch = index, batch
        self.count = SampleIndex(index).num_samples // batch
        self.index: SampleIndex | None = None
        self.decode: SampleDecoder | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.index is None or self.decode is None:  # opened in the worker
            self.index, self.decode = SampleIndex(self.path), SampleDecoder(decode_config("image"))
        samples = []
        for sample in self.index.samples(range(i * self.batch, (i + 1) * self.batch)):
            fields = {f.name: read_field(sample.shard, f) for f in sample.fields}
            samples.append((sample.key, self.decode(fields, sample.key)))
        return collate_samples(samples)


def run_dataloader(index: Path, kind: str, loops: Callable[[Iterator[dict[str, Any]]], dict[str, Any]]) -> Any:
    """``loops`` over torch's DataLoader (2 workers) of the same batches, repeated as epochs."""
    loader = tud.DataLoader(BatchDataset(index, BATCH[kind]), batch_size=None, num_workers=2, persistent_workers=True)
    return loops(epochs(loader))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", type=int, default=4000, help="samples of the photos dataset (mixed: half)")
    parser.add_argument("--batches", type=int, default=60, help="measured batches per loop")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=200.0, help="the 'step' loop's pause after each batch")
    parser.add_argument("--kinds", nargs="+", default=["photos", "mixed"], choices=list(BATCH))
    parser.add_argument("--no-dataloader", action="store_true")
    parser.add_argument(
        "--no-sync", action="store_true", help="skip the clients with receive_ahead=0 and collate_ahead=0"
    )
    parser.add_argument("--quick", action="store_true", help="800 photos, 20 batches")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.photos, args.batches = 800, 20
    torch.set_num_threads(1)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="omnifeed-trainer-cpu-") as tmp:
        work = Path(tmp)
        for kind in args.kinds:
            index = write_dataset(work, kind, args.photos if kind == "photos" else args.photos // 2)

            def loops(batches: Iterator[dict[str, Any]]) -> dict[str, Any]:
                return {
                    "step": trainer_loop(batches, args.batches, args.warmup, args.step_ms / 1e3),
                    "wait": trainer_loop(batches, args.batches, args.warmup, 0.0),
                }

            runners = [("service", lambda: run_service(work, index, kind, loops))]
            if not args.no_sync:  # the same client receiving each batch on the trainer's thread when asked
                runners.append(("service-sync", lambda: run_service(work, index, kind, loops, ahead=0)))
            runners.append(("in-process", lambda: run_in_process(work, index, kind, loops)))
            if not args.no_sync:  # collated on the trainer's thread in next()
                runners.append(("in-process-sync", lambda: run_in_process(work, index, kind, loops, ahead=0)))
            if not args.no_dataloader:
                runners.append(("dataloader", lambda: run_dataloader(index, kind, loops)))
            for loader, run in runners:
                measured = run()
                for mode, figures in measured.items():
                    row = {"data": kind, "loader": loader, "mode": mode, **figures}
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
    print(
        f"{'data':7s} {'mode':5s} {'loader':15s} {'median ms':>10s} {'p90 ms':>8s} {'vs DataLoader':>14s} "
        f"{'process ms/batch':>17s}"
    )
    for row in results["rows"]:
        base = [
            r
            for r in results["rows"]
            if (r["data"], r["mode"], r["loader"]) == (row["data"], row["mode"], "dataloader")
        ]
        ratio = f"{row['median_ms'] / base[0]['median_ms']:.2f}×" if base else "—"
        print(
            f"{row['data']:7s} {row['mode']:5s} {row['loader']:15s} {row['median_ms']:10.3f} {row['p90_ms']:8.3f} "
            f"{ratio:>14s} {row['process_ms_per_batch']:17.3f}"
        )
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
