"""The service's batch hand-off (service → `FeedClient`) against torch's DataLoader (worker → main process), in one run.

    python benchmarks/bench_handoff.py [--sizes-mb 10 150] [--tensors 3] [--gb-per-run 4] [--warmup 12] [--rounds 3]
                                       [--no-dataloader] [--quick]

For each batch size and tensor count (image batches: uint8 ``[n, 3, 224, 224]`` with ``n`` the
images that make the size, plus the feed format's ``sizes``/``index`` int64 side tensors,
``__key__``, ``__info__``; ``--tensors T`` above 3 adds ``T - 3`` int meta fields, each an int64
``[n]`` tensor of the batch):

1. ``service``: a real `FeedService` in its own process (multiprocessing ``spawn``) over a
   generated image index (one tiny JPEG repeated, 16 batches of the largest size; plan:
   ``batch_size=n``, ``drop_last``, permutation shuffle). Decoding is taken out of the
   picture: in the service process ``Feed.take`` is replaced by `premade_take`, which deals
   the micro-batch the way the feed's pipeline does (a `PlanCursor` from the feed's position,
   the micro-batch's real keys from a table read once, ``__info__`` and delivery record, the
   position moved past it) and returns ``n`` pre-decoded 3×224×224 pictures, the same ones
   every time. Calling the real ``_take`` on a tiny dataset and swapping its samples was the
   other option; it would decode real images in the service's pools, on the same two cores,
   for nothing. The service then collates each batch into a shared-memory segment and hands
   it over for real; the client (`omnifeed.trainer_adapter.FeedClient`) runs in this process.
2. ``dataloader``: `torch.utils.data.DataLoader`, 2 workers, ``batch_size=None``, over a
   dataset whose ``__getitem__`` collates the same pictures with the same `collate` into fresh
   torch shared memory (``UntypedStorage._new_shared``, what torch's ``default_collate`` does in
   a worker): one copy per batch, as in the service. (Returning one pre-made batch dict every
   time would not measure a hand-off: pickling moves a tensor's storage into shared memory in
   place, so from the second batch on nothing would be copied; cloning it would copy twice.)
3. ``memcpy``: ``np.copyto`` of a batch's bytes (one thread) into already-faulted buffers
   (rotating over 256 MB, as the service's segments rotate: to memory, not to the cache);
   ``stack``: the service's collate copy alone (``np.stack`` of the ``n`` pictures into the same
   buffers), the service's floor.

The consumer (this process) takes ``warmup`` batches, then ``N`` batches (``--gb-per-run`` of
tensor bytes), touching one byte of each and dropping it before the next, as a training loop
does. Measured: GB/s over the ``N`` batches (wall clock); the trainer process's CPU per batch,
over the whole loop (``time.process_time``: every thread of this process, the drop included),
and inside ``next()`` only (process and thread time); CPU of the producer side per batch (the
service process, or the DataLoader's workers, via psutil; the service produces a few batches
ahead, so its figure is approximate). Rounds alternate the loaders; medians over rounds, ratios
against the DataLoader. Prints a table; writes ``benchmarks/results-handoff.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.utils.data as tud
import webdataset

from omnifeed.loader import FeedConfig, IndexConfig, PlanConfig, SampleIndex, build_index
from omnifeed.loader.feed import FeedPosition
from omnifeed.loader.feed._collate import collate
from omnifeed.loader.feed._feed import Feed, Taken
from omnifeed.loader.feed._torch_batch import to_torch
from omnifeed.loader.plan._audit import delivery_record
from omnifeed.loader.plan._cursor import PlanCursor
from omnifeed.loader.service._config import ServiceConfig
from omnifeed.loader.service._server import FeedService
from omnifeed.tools._demo_data import encode_image
from omnifeed.trainer_adapter import FeedClient

RESULTS = Path(__file__).with_name("results-handoff.json")
PICTURE = (3, 224, 224)
PICTURE_BYTES = math.prod(PICTURE)
BATCHES_PER_EPOCH = 16  # of the largest batches: the plan computes an epoch's order once per epoch


# -- the data --------------------------------------------------------------------------------
def pictures(n: int, seed: int = 0, tensors: int = 3) -> list[dict[str, Any]]:
    """``n`` decoded image samples (feed format: ``{"image": uint8 [3, 224, 224]}``), distinct memory each; with
    ``tensors - 3`` int meta fields (each a tensor of the collated batch)."""
    block = np.random.default_rng(seed).integers(0, 256, (n, *PICTURE), dtype=np.uint8)
    meta = {f"field{j:02d}": j for j in range(max(0, tensors - 3))}
    return [{"image": block[i], "meta": dict(meta)} if meta else {"image": block[i]} for i in range(n)]


def write_index(work: Path, count: int) -> Path:
    """An index of ``count`` image samples (one tiny JPEG repeated: nothing is decoded here)."""
    jpeg = encode_image(224, 224, "jpg", seed=0)
    shard = work / "shard-0000.tar"
    with open(shard, "wb") as f, webdataset.TarWriter(f, encoder=False) as tar:
        for i in range(count):
            tar.write({"__key__": f"img-{i:06d}", "jpg": jpeg})
    build_index([str(shard)], work / "index", IndexConfig(workers=1), progress=False)
    return work / "index"


def batch_bytes(batch: dict[str, Any]) -> int:
    """Tensor bytes of a batch in the feed's format."""
    return sum(t.numel() * t.element_size() for m in ("image",) for t in batch[m].values())


# -- the service side: a feed that deals micro-batches without decoding ----------------------
def premade_take(samples: list[dict[str, Any]], keys: list[str]) -> Callable[[Feed], Taken]:
    """A ``Feed.take`` that deals the next micro-batch like the feed's pipeline, with ``samples`` as its decoded
    samples.

    ``keys``: every sample key of the index, by position (read once: ``SampleIndex.keys`` costs
    ~0.75 ms a call whatever the batch size, index work that is not the hand-off either).
    """

    def take(feed: Feed) -> Taken:
        cursor = getattr(feed, "_bench_cursor", None)
        position = feed.position
        if cursor is None or getattr(feed, "_bench_at", None) is not position:  # restarted: rebuild
            cursor = PlanCursor(feed.plan, world_size=feed.world_size, grad_accum=feed.grad_accum)
            cursor.load_state_dict(position.plan_state)
        step = cursor.next_step()
        accum = position.accum_done
        micro_batch = step.for_rank(feed.rank)[accum]
        taken = [keys[p] for p in micro_batch.positions.tolist()]
        info = {
            "epoch": micro_batch.epoch,
            "step": step.step,
            "micro_batch": micro_batch.index,
            "rank": feed.rank,
            "accum": accum,
            "topology_version": step.topology_version,
            "replaced": [],
        }
        record = {**delivery_record(step, feed.rank, accum, micro_batch, taken), "replaced": []}
        if accum + 1 == feed.grad_accum:
            feed._position = FeedPosition(cursor.state_dict(), checked=True)
        else:  # the rest of the step comes from a cursor at the step's start
            feed._position = FeedPosition(position.plan_state, accum + 1, checked=True)
            cursor = None
        feed._bench_cursor, feed._bench_at = cursor, feed._position  # type: ignore[attr-defined]
        return Taken(samples[: len(taken)], taken, info, record)

    return take


def serve(index: str, socket_path: str, n: int, tensors: int, conn: Connection) -> None:
    """The service process: a `FeedService` whose feeds deal pre-decoded pictures; stops when ``conn`` says so."""
    every = SampleIndex(index)
    keys = every.keys(np.arange(every.num_samples))
    Feed.take = premade_take(pictures(n, tensors=tensors), keys)  # type: ignore[method-assign]
    config = ServiceConfig(
        index=index, socket=socket_path, feed=FeedConfig(plan=PlanConfig(batch_size=n, drop_last=True, seed=0))
    )
    with FeedService(config):
        conn.send("ready")
        conn.recv()


class ServiceProcess:
    """A `FeedService` in a spawned process, for ``n``-picture batches over ``index``."""

    def __init__(self, index: Path, socket_path: str, n: int, tensors: int = 3) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(str(index), socket_path, n, tensors, child), daemon=True)
        self.process.start()
        if not self._conn.poll(120) or self._conn.recv() != "ready":
            self.close()
            raise RuntimeError("the service process did not start")

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send("stop")
            except OSError:
                pass
            self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)


# -- the DataLoader side ----------------------------------------------------------------------
class SharedBatches(tud.Dataset):
    """Item ``i``: the pictures collated (omnifeed's `collate`) into fresh torch shared memory, as a worker's collate
    does."""

    def __init__(self, samples: list[dict[str, Any]], keys: list[str], info: dict[str, Any], length: int) -> None:
        self.samples, self.keys, self.info, self.length = samples, keys, info, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        shared: dict[int, torch.Tensor] = {}

        def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            tensor = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(nbytes, 1)))
            array = tensor.numpy()[:nbytes].view(dtype).reshape(shape)
            shared[array.ctypes.data] = tensor
            return array

        batch = to_torch(collate(self.samples, self.keys, dict(self.info, step=i), alloc))
        return _as_shared(batch, shared)


def _as_shared(value: Any, shared: dict[int, torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by the same memory as a torch shared tensor (so pickling copies nothing)."""
    if isinstance(value, torch.Tensor):
        return shared[value.data_ptr()][: value.numel() * value.element_size()].view(value.dtype).view(value.shape)
    if isinstance(value, dict):
        return {k: _as_shared(v, shared) for k, v in value.items()}
    return value


# -- measuring ------------------------------------------------------------------------------
def _touch(batch: dict[str, Any]) -> int:
    return int(batch["image"]["pixels"].view(-1)[0])


def _cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def drive(
    next_batch: Callable[[], dict[str, Any]],
    batches: int,
    warmup: int,
    producers: Callable[[], list[int]],
    expected: int,
) -> dict[str, Any]:
    """Take ``warmup`` then ``batches`` batches, touching one byte of each and dropping it; the figures of the
    latter."""
    for _ in range(max(1, warmup)):
        batch = next_batch()
        nbytes = batch_bytes(batch)
        assert _touch(batch) == expected, "the batch does not hold the pictures"
        del batch
    pids = producers()
    producer_cpu = _cpu_of(pids)
    in_next: list[float] = []
    in_next_thread = 0.0
    touched = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        p, t = time.process_time(), time.thread_time()
        batch = next_batch()
        in_next_thread += time.thread_time() - t
        in_next.append(time.process_time() - p)
        touched += _touch(batch)
        del batch
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    producer_cpu = _cpu_of(pids) - producer_cpu
    assert touched == expected * batches, "a batch did not hold the pictures"
    return {
        "gb_per_s": nbytes * batches / wall / 1e9,
        "cpu_ms_per_batch": 1e3 * cpu / batches,
        "next_cpu_ms": 1e3 * sum(in_next) / batches,
        "next_cpu_ms_p50": 1e3 * statistics.median(in_next),
        "next_thread_ms": 1e3 * in_next_thread / batches,
        "producer_cpu_ms_per_batch": 1e3 * producer_cpu / batches,
    }


def run_service(
    client: FeedClient, service: ServiceProcess, batches: int, warmup: int, expected: int
) -> dict[str, Any]:
    pid = service.process.pid
    assert pid is not None
    return drive(client.next_batch, batches, warmup, lambda: [pid], expected)


def run_dataloader(dataset: SharedBatches, workers: int, batches: int, warmup: int, expected: int) -> dict[str, Any]:
    dataset.length = batches + warmup
    iterators = [iter(tud.DataLoader(dataset, batch_size=None, num_workers=workers))]
    try:
        return drive(
            lambda: next(iterators[0]), batches, warmup, lambda: [w.pid for w in iterators[0]._workers], expected
        )  # type: ignore[attr-defined]
    finally:
        iterators.clear()  # the iterator's workers stop when it goes


def run_copies(samples: list[dict[str, Any]], repeats: int) -> dict[str, float]:
    """GB/s of one thread's memcpy of the batch's bytes, and of the collate copy alone (``np.stack`` of the pictures).

    The targets rotate over already-faulted buffers of 256 MB at least, as the service's
    segments do, so that the copy goes to memory, not to the cache.
    """
    arrays = [s["image"] for s in samples]
    source = np.stack(arrays)
    targets = [np.ones_like(source) for _ in range(max(2, math.ceil(256e6 / source.nbytes)))]
    seconds: dict[str, list[float]] = {"memcpy": [], "stack": []}
    for i in range(repeats):
        target = targets[i % len(targets)]
        start = time.perf_counter()
        np.copyto(target, source)
        seconds["memcpy"].append(time.perf_counter() - start)
        target = targets[(i + len(targets) // 2) % len(targets)]
        start = time.perf_counter()
        np.stack(arrays, out=target)
        seconds["stack"].append(time.perf_counter() - start)
    return {name: source.nbytes / statistics.median(s) / 1e9 for name, s in seconds.items()}


# -- the run ----------------------------------------------------------------------------------
def compare(n: int, tensors: int, index: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    samples = pictures(n, tensors=tensors)  # the same pictures as the service's (same seed)
    expected = int(samples[0]["image"].reshape(-1)[0])
    service = ServiceProcess(index, str(work / "sock" / "feed.sock"), n, tensors)
    client = FeedClient(str(work / "sock" / "feed.sock"))
    try:
        first = client.next_batch()
        nbytes = batch_bytes(first)
        dataset = SharedBatches(samples, list(first["__key__"]), dict(first["__info__"]), 0)
        del first
        batches = max(args.min_batches, math.ceil(args.gb_per_run * 1e9 / nbytes))
        rounds: dict[str, list[dict[str, Any]]] = {"service": [], "dataloader": []}
        copies: list[dict[str, float]] = []
        for _ in range(args.rounds):
            rounds["service"].append(run_service(client, service, batches, args.warmup, expected))
            if not args.no_dataloader:
                rounds["dataloader"].append(run_dataloader(dataset, args.workers, batches, args.warmup, expected))
            copies.append(run_copies(samples, max(4, min(batches, 40))))
    finally:
        client.close()
        service.close()
    result: dict[str, Any] = {
        "images": n,
        "tensors": tensors,
        "batch_bytes": nbytes,
        "batches": batches,
        "warmup": args.warmup,
    }
    for name in ("memcpy", "stack"):
        result[name] = {"gb_per_s": statistics.median(c[name] for c in copies), "rounds": [c[name] for c in copies]}
    for name, runs in rounds.items():
        if not runs:
            continue
        result[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        result[name]["rounds_gb_per_s"] = [r["gb_per_s"] for r in runs]
        result[name]["rounds_cpu_ms_per_batch"] = [r["cpu_ms_per_batch"] for r in runs]
    base = result.get("dataloader")
    for name in ("memcpy", "stack", "service", "dataloader"):
        if name in result:
            result[name]["gb_per_s_vs_dataloader"] = result[name]["gb_per_s"] / base["gb_per_s"] if base else math.nan
    if base:
        result["service"]["cpu_vs_dataloader"] = result["service"]["cpu_ms_per_batch"] / base["cpu_ms_per_batch"]
    result["service"]["gb_per_s_vs_memcpy"] = result["service"]["gb_per_s"] / result["memcpy"]["gb_per_s"]
    return result


def table(results: dict[str, Any]) -> str:
    lines = [
        "| batch | what | GB/s | vs DataLoader | trainer CPU ms/batch (loop) | in next(): process / thread ms "
        "| in next(): process ms, median | producer CPU ms/batch |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["sizes"].values():
        label = f"{r['batch_bytes'] / 1e6:.1f} MB ({r['images']} images, {r.get('tensors', 3)} tensors)"
        for name in ("memcpy", "stack", "service", "dataloader"):
            if name not in r:
                continue
            row = r[name]
            if "cpu_ms_per_batch" in row:
                cpu = f"{row['cpu_ms_per_batch']:.3f}"
                inner = f"{row['next_cpu_ms']:.3f} / {row['next_thread_ms']:.3f}"
                median = f"{row['next_cpu_ms_p50']:.3f}"
                producer = f"{row['producer_cpu_ms_per_batch']:.1f}"
            else:
                cpu = inner = median = producer = "—"
            lines.append(
                f"| {label} | {name} | {row['gb_per_s']:.2f} | {row['gb_per_s_vs_dataloader']:.2f} | {cpu} "
                f"| {inner} | {median} | {producer} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[10.0, 150.0], help="batch sizes, MB (1e6 bytes)")
    parser.add_argument(
        "--tensors", type=int, nargs="+", default=[3], help="tensors per batch (3: the image's; more: int meta fields)"
    )
    parser.add_argument("--no-dataloader", action="store_true", help="measure the service hand-off alone")
    parser.add_argument("--gb-per-run", type=float, default=4.0, help="tensor bytes each loader moves per round, GB")
    parser.add_argument("--min-batches", type=int, default=20, help="measured batches per round at least")
    parser.add_argument("--warmup", type=int, default=12, help="batches taken before measuring (segments, workers)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run: 1 MB batches, 1 round")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.sizes_mb, args.gb_per_run, args.min_batches, args.warmup, args.rounds = [1.0], 0.0, 10, 3, 1
    results: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "workers": args.workers,
        "rounds": args.rounds,
        "gb_per_run": args.gb_per_run,
        "sizes": {},
    }
    counts = {mb: math.ceil(mb * 1e6 / PICTURE_BYTES) for mb in args.sizes_mb}
    with tempfile.TemporaryDirectory(prefix="omnifeed-bench-handoff-") as tmp:
        index = write_index(Path(tmp), BATCHES_PER_EPOCH * max(counts.values()))
        for mb, n in counts.items():
            for tensors in args.tensors:
                name = f"{mb:g}" if tensors == 3 else f"{mb:g}x{tensors}"
                (Path(tmp) / name).mkdir()
                results["sizes"][name] = compare(n, tensors, index, Path(tmp) / name, args)
    text = json.dumps(results, indent=1)
    args.out.write_text(text + "\n")
    print(text)
    print(table(results))


if __name__ == "__main__":
    main()
