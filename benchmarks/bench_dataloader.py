"""omnifeed's DataLoader against torch's DataLoader and torchdata's StatefulDataLoader, in one run.

    python benchmarks/bench_dataloader.py [--images 1024] [--items 4096] [--workers 2] [--batch-size 32] [--rounds 3]

The three loaders get the same dataset and the same code, ``shuffle=True``, ``--workers`` worker
processes and batches of ``--batch-size``:

1. ``image``: JPEG files generated at bench time (640×480 and 500×375), read, decoded with Pillow,
   resized to 224×224 and turned into a uint8 CHW tensor: a decode-bound image pipeline;
2. ``handoff``: each of ``--items`` items is a 3×224×224 uint8 tensor copied from memory (no decode),
   so moving batches from the workers to the main process dominates;
3. ``handoff_fields``: each item is a dict of seven small tensors (a 3×64×64 picture, a label, a box,
   ...), so a batch holds many tensors, each of which torch hands over through its own file descriptor.

Rounds alternate the loaders so the machine's noise hits all of them alike. A run is one epoch
without its first batch (worker start-up); reported per loader: the median batches/s over rounds,
CPU seconds per batch (main process and workers) and the ratio to torch's DataLoader. Prints the
results and writes them to ``benchmarks/results-dataloader.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from PIL import Image

from omnifeed.loader import DataLoader
from omnifeed.tools._demo_data import encode_image

RESULTS = Path(__file__).with_name("results-dataloader.json")


class JpegFiles(tud.Dataset):
    """Decode + resize + to tensor: the code every loader runs."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with Image.open(io.BytesIO(self.paths[i].read_bytes())) as image:
            picture = image.convert("RGB").resize((224, 224), Image.BILINEAR)
        return torch.from_numpy(np.array(picture)).permute(2, 0, 1).contiguous(), i % 1000


class Pictures(tud.Dataset):
    """Ready 3×224×224 pictures: no decode, only the hand-off."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.picture = torch.randint(0, 255, (3, 224, 224), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.picture.clone(), i


class Fields(Pictures):
    """Seven small tensors per item."""

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        return {
            "picture": self.picture[:, :64, :64].clone(),
            "label": i % 10,
            "box": torch.rand(4),
            "mask": torch.ones(64, dtype=torch.bool),
            "tokens": torch.arange(32),
            "weight": torch.tensor(1.0),
            "ids": torch.full((8,), i),
        }


def write_jpegs(out: Path, count: int) -> list[Path]:
    paths = []
    for i in range(count):
        width, height = (640, 480) if i % 3 else (500, 375)
        path = out / f"img-{i:06d}.jpg"
        path.write_bytes(encode_image(width, height, "jpg", seed=i))
        paths.append(path)
    return paths


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _epoch(make: Callable[[], Any]) -> tuple[float, float]:
    """Batches/s over one epoch without its first batch, and CPU seconds per batch."""
    loader = make()
    cpu = _cpu()
    iterator = iter(loader)
    next(iterator)
    start, batches = time.perf_counter(), 0
    for _ in iterator:
        batches += 1
    seconds = time.perf_counter() - start
    del iterator
    return batches / seconds, (_cpu() - cpu) / (batches + 1)


def _loaders(workers: int, batch_size: int) -> dict[str, Callable[[Any], Any]]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13

    options = dict(batch_size=batch_size, shuffle=True, num_workers=workers)
    return {
        "torch": lambda dataset: tud.DataLoader(dataset, **options),
        "torchdata": lambda dataset: StatefulDataLoader(dataset, **options),
        "omnifeed": lambda dataset: DataLoader(dataset, **options),
    }


def compare(dataset: tud.Dataset, rounds: int, workers: int, batch_size: int) -> dict[str, Any]:
    loaders = _loaders(workers, batch_size)
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    cpus: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(rounds):
        for name, make in loaders.items():
            rate, cpu = _epoch(lambda make=make: make(dataset))  # type: ignore[misc]
            rates[name].append(rate)
            cpus[name].append(cpu)
    base = statistics.median(rates["torch"])
    return {
        name: {
            "batches_per_s": round(statistics.median(rates[name]), 1),
            "cpu_s_per_batch": round(statistics.median(cpus[name]), 4),
            "vs_torch": round(statistics.median(rates[name]) / base, 3),
            "rounds": [round(r, 1) for r in rates[name]],
        }
        for name in loaders
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1024, help="JPEG files of the image pipeline")
    parser.add_argument("--items", type=int, default=4096, help="items of the hand-off pipelines")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="omnifeed-bench-dataloader-") as tmp:
        paths = write_jpegs(Path(tmp), args.images)
        results = {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "images": args.images,
            "items": args.items,
            "workers": args.workers,
            "batch_size": args.batch_size,
            "rounds": args.rounds,
            "image": compare(JpegFiles(paths), args.rounds, args.workers, args.batch_size),
            "handoff": compare(Pictures(args.items), args.rounds, args.workers, args.batch_size),
            "handoff_fields": compare(Fields(args.items), args.rounds, args.workers, args.batch_size),
        }
    text = json.dumps(results, indent=1)
    RESULTS.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
