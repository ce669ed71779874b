"""CPU of collating the training mix's micro-batches: padding before and now, numpy's huge pages on and off (issue 29).

    python benchmarks/bench_collate.py [--samples 1024] [--rounds 7] [--feed-rounds 2] [--feed-epochs 3]
                                       [--out FILE.json]

The micro-batches are the training scenario's (`omnifeed bench --scenario training`: its four-modality mix, its
decode, its budget-mode plan for batches of 8), taken decoded from a `Feed` once, then collated again and again on
this thread, the ways alternated:

- ``segment``: into memory reused batch after batch, as the service's shared-memory segments are. Before: zeroed
  whole, then the rows; now: the rows, then only the padding zeroed.
- ``feed``: a real `Feed` over the mix (rank 0 of 2, its decode thread running), ``Feed.next_batch`` in a trainer's
  loop (the batch kept through a 20 ms "step", dropped when the next one comes) for ``--feed-epochs`` epochs, with
  numpy's huge-page advice on (numpy's default; ``numpy_hugepages: true``) and off (the feed's default). Thread CPU
  of each ``next_batch`` (collating included; the batch is waiting), median, mean and the worst, over every batch
  after the first.

Measured: ``time.thread_time()`` (user and system CPU of this thread, page faults included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omnifeed.loader.feed import (
    Feed,
    _collate,  # the padding swapped for the way before, to run both in one process
    collate,
)
from omnifeed.tools._bench_training_data import feed_config, write_training_data

Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]


class _Segment:
    """A bump allocator over one buffer reused for every batch, like the service's `SegmentWriter`."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = np.empty(nbytes, dtype=np.uint8)
        self.used = 0

    def reset(self) -> None:
        self.used = 0

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        start = -(-self.used // 64) * 64
        self.used = start + size
        return self.buffer[start : start + size].view(dtype).reshape(shape)


def _pad_stack_zeroed_whole(arrays: Sequence[np.ndarray], alloc: Allocator) -> np.ndarray:
    """The way before (up to 380e81f): the padded array zeroed whole, then every row copied in."""
    shape = tuple(max(a.shape[d] for a in arrays) for d in range(arrays[0].ndim))
    out = alloc((len(arrays), *shape), arrays[0].dtype)
    if all(a.shape == shape for a in arrays):
        np.stack(arrays, out=out)
        return out
    out.fill(0)
    for row, array in enumerate(arrays):
        out[(row,) + tuple(slice(0, s) for s in array.shape)] = array
    return out


def micro_batches(samples: int) -> list[tuple[list[Any], list[str]]]:
    """Every micro-batch of rank 0 of 2 over one epoch of the scenario's mix: (decoded samples, keys)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = write_training_data(Path(tmp), samples, 8)
        taken = []
        with Feed(data.index, feed_config(data.budget["suggested_budget"], 1), world_size=2, rank=0) as feed:
            while feed.epoch == 0:
                batch = feed.take()
                taken.append((list(batch.samples), list(batch.keys)))
        return taken


def cpu_per_batch(batches: Sequence[tuple[list[Any], list[str]]], way: str, segment: _Segment) -> float:
    """Thread CPU milliseconds a micro-batch, collating every batch once the ``way`` given (``memory/when``)."""
    now = _collate._pad_stack
    if way.endswith("/before"):
        _collate._pad_stack = _pad_stack_zeroed_whole  # type: ignore[assignment]
    try:
        started = time.thread_time()
        for samples, keys in batches:
            segment.reset()
            collate(samples, keys, {}, segment.alloc)
        return (time.thread_time() - started) / len(batches) * 1e3
    finally:
        _collate._pad_stack = now


def feed_loop(samples: int, epochs: int, hugepages: bool) -> list[float]:
    """Thread CPU milliseconds of each ``Feed.next_batch`` after the first over ``epochs`` epochs of the mix."""
    with tempfile.TemporaryDirectory() as tmp:
        data = write_training_data(Path(tmp), samples, 8)
        config = feed_config(data.budget["suggested_budget"], 1).model_copy(update={"numpy_hugepages": hugepages})
        with Feed(data.index, config, world_size=2, rank=0) as feed:
            batch = feed.next_batch()
            times = []
            while feed.epoch < epochs:
                time.sleep(0.02)  # the trainer's step, with the batch alive; the next ones decode meanwhile
                started = time.thread_time()
                batch = feed.next_batch()
                times.append((time.thread_time() - started) * 1e3)
            del batch
            return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024, help="samples of the training mix")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the segment comparison")
    parser.add_argument("--feed-rounds", type=int, default=2, help="feed loops of each way, alternated")
    parser.add_argument("--feed-epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    batches = micro_batches(args.samples)
    segment = _Segment(1 << 30)
    segment.buffer.fill(0)  # its pages in memory, as a segment's are after its first batch
    ways = ["segment/before", "segment/now"]
    times: dict[str, list[float]] = {way: [] for way in ways}
    for round_ in range(args.rounds):
        for way in ways if round_ % 2 == 0 else ways[::-1]:
            times[way].append(cpu_per_batch(batches, way, segment))
    del segment
    medians = {way: statistics.median(values) for way, values in times.items()}
    report: dict[str, Any] = {
        "micro_batches": len(batches),
        "segment_ms_per_batch": times,
        "segment_median_ms": medians,
    }
    before, now = medians["segment/before"], medians["segment/now"]
    print(f"segment: before {before:.3f} ms a micro-batch, now {now:.3f} ms ({now / before:.2f}x)")
    loops: dict[str, list[float]] = {"hugepages": [], "no-hugepages": []}
    for round_ in range(args.feed_rounds):
        for way in list(loops) if round_ % 2 == 0 else list(loops)[::-1]:
            loops[way] += feed_loop(args.samples, args.feed_epochs, way == "hugepages")
    report["feed_next_batch_ms"] = loops
    for way, values in loops.items():
        print(
            f"feed, numpy {way:12}: next_batch median {statistics.median(values):.2f} ms,"
            f" mean {statistics.fmean(values):.2f} ms, worst {max(values):.1f} ms ({len(values)} batches)"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
