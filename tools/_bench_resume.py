"""Resume cost side by side: mid-epoch resume at a large position for omnifeed, torchdata and Streaming.

Per loader, two fresh processes (``python -m omnifeed.tools._bench_resume``, one JSON line each):

- ``save``: builds the dataset representation if it is not cached under ``work`` (``build_s``),
  takes a state at position ``fraction × samples`` (rounded down to whole batches) of epoch 0,
  shuffled, with seed 0, and the first batch an uninterrupted run yields after it (``expected``).
- ``resume``: opens the dataset (``open_s``: the process now has the dataset object), reads the
  saved state, then times ``load_state_dict`` + the first batch (``resume_s``) while sampling its
  own resident memory (``peak_rss_mib``; psutil every 2 ms, else the ``ru_maxrss`` high-water mark),
  and checks the batch against ``expected`` (``first_batch_ok``).

What each loader's "first batch" is: omnifeed — the plan cursor's next micro-batch and its sample
keys from the index (plan + index lookup; ``feed_resume_s`` adds a whole ``Feed`` with every image
decoded); torchdata ``StatefulDataLoader`` — the collated batch of a map-style dataset whose item is
its own index; Streaming — the first ``batch_size`` samples of ``StreamingDataset`` (an MDS dataset
of one int column). How each state was had is the row's ``how``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

LOADERS = ("omnifeed", "torchdata", "streaming")
SEED = 0
ITERATE_LIMIT = 2_000  # batches a save phase iterates for real; deeper states are shifted copies of a real one
WRITE_LIMIT_S = 180.0  # the longest the MDS writer may run; the row's samples say how many it wrote
_MIB = 2**20


class Missing(Exception):
    """A loader's library does not import in this interpreter."""


# -- the parent --------------------------------------------------------------------------------
def run_resume_bench(
    work: Path,
    samples: int = 10_000_000,
    fraction: float = 0.5,
    batch_size: int = 64,
    loaders: Sequence[str] = LOADERS,
    python: str | Mapping[str, str] = sys.executable,
    torchdata_workers: Sequence[int] = (0, 2),
    timeout_s: float = 1800.0,
) -> list[dict[str, Any]]:
    """One row per loader (per worker count for torchdata), each measured in fresh subprocesses."""
    rows = []
    for loader in loaders:
        interpreter = python if isinstance(python, str) else python.get(loader, sys.executable)
        for workers in torchdata_workers if loader == "torchdata" else (0,):
            options = {
                "work": work / (loader if not workers else f"{loader}-w{workers}"),
                "samples": samples,
                "fraction": fraction,
                "batch_size": batch_size,
                "workers": workers,
            }
            rows.append(loader_row(loader, interpreter, options, timeout_s))
    return rows


def loader_row(loader: str, python: str, options: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """The save then the resume phase of one loader, merged into its row."""
    row: dict[str, Any] = {
        "loader": loader,
        "workers": options["workers"],
        "samples": options["samples"],
        "position": None,
        "open_s": None,
        "resume_s": None,
        "peak_rss_mib": None,
        "state_bytes": None,
        "python": python,
    }
    for phase in ("save", "resume"):
        result = child(python, phase, loader, options, timeout_s)
        row.update(result)
        if result["status"] != "ok":
            break
    return row


def child(python: str, phase: str, loader: str, options: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """One phase in a fresh process: its JSON line, or a status saying why there is none."""
    command = [
        python,
        "-m",
        "omnifeed.tools._bench_resume",
        "--phase",
        phase,
        "--loader",
        loader,
        *(f"--{k.replace('_', '-')}={v}" for k, v in options.items()),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return {"status": f"missing: no interpreter {python}"}
    except subprocess.TimeoutExpired:
        return {"status": f"error: {phase} phase ran past {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"error: {phase} phase exited {done.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- measuring ---------------------------------------------------------------------------------
class PeakRss:
    """Resident memory of this process while the block runs: before, peak, and how it was measured."""

    def __init__(self) -> None:
        self.before_mib = self.peak_mib = 0.0
        self.how = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        try:
            import psutil
        except ImportError:
            self.how = "ru_maxrss high-water mark of the process (includes anything before the resume)"
            self.before_mib = _maxrss_mib()
            return self
        process = psutil.Process()
        self.how = "psutil RSS of the resuming process, sampled every 2 ms (workers not included)"
        self.before_mib = self.peak_mib = process.memory_info().rss / _MIB
        self._thread = threading.Thread(target=self._sample, args=(process,), daemon=True)
        self._thread.start()
        return self

    def _sample(self, process: Any) -> None:
        while not self._stop.wait(0.002):
            self.peak_mib = max(self.peak_mib, process.memory_info().rss / _MIB)

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            self.peak_mib = _maxrss_mib()
            return
        self._stop.set()
        self._thread.join()
        import psutil

        self.peak_mib = max(self.peak_mib, psutil.Process().memory_info().rss / _MIB)

    def figures(self) -> dict[str, Any]:
        """The row's memory fields."""
        return {
            "peak_rss_mib": round(self.peak_mib, 1),
            "rss_before_resume_mib": round(self.before_mib, 1),
            "rss_how": self.how,
        }


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def timed_resume(resume: Any) -> tuple[Any, float, PeakRss]:
    """``resume()``'s result, its wall time in s and its memory."""
    with PeakRss() as memory:
        started = time.perf_counter()
        result = resume()
        seconds = time.perf_counter() - started
    return result, seconds, memory


def position_of(options: argparse.Namespace) -> tuple[int, int]:
    """The resume position in samples and in batches: ``fraction × samples``, whole batches."""
    batches = int(options.fraction * options.samples) // options.batch_size
    return batches * options.batch_size, batches


def write_expected(work: Path, expected: list[Any]) -> None:
    """The first batch an uninterrupted run yields after the saved position."""
    (work / "expected.json").write_text(json.dumps(expected), encoding="utf-8")


def read_expected(work: Path) -> list[Any]:
    """What ``write_expected`` wrote."""
    expected: list[Any] = json.loads((work / "expected.json").read_text(encoding="utf-8"))
    return expected


# -- omnifeed ----------------------------------------------------------------------------------
def omnifeed_save(options: argparse.Namespace) -> dict[str, Any]:
    """The index (cached), a plan cursor stepped for real to the position, its feed state and next keys."""
    from omnifeed.loader import SampleIndex
    from omnifeed.loader.feed import FEED_STATE_FORMAT
    from omnifeed.loader.plan import Plan, PlanCursor

    from ._synthetic_index import make_index

    options.work.mkdir(parents=True, exist_ok=True)
    path, built = make_index(options.work, options.samples)
    index = SampleIndex(path)
    position, batches = position_of(options)
    started = time.perf_counter()
    cursor = PlanCursor(Plan.from_index(index, omnifeed_config(options).plan))
    while cursor.micro_batch < batches:
        cursor.next_step()
    state = {"format": FEED_STATE_FORMAT, "plan": cursor.state_dict(), "accum_done": 0}
    stepped_s = time.perf_counter() - started
    (options.work / "state.json").write_text(json.dumps(state), encoding="utf-8")
    write_expected(options.work, [str(k) for k in index.keys(cursor.next_step().micro_batches[0].positions)])
    return {
        "status": "ok",
        "position": position,
        "build_s": built.get("build_s"),
        "built": not built["cached"],
        "how": f"a PlanCursor stepped for real to micro-batch {batches} ({stepped_s:.1f} s); expected: its next step",
    }


def omnifeed_config(options: argparse.Namespace) -> Any:
    """The feed config of both phases: seed 0, permutation shuffle, fixed batches."""
    from omnifeed.loader import FeedConfig, PlanConfig

    return FeedConfig(plan=PlanConfig(seed=SEED, batch_size=options.batch_size, shuffle="permutation"))


def omnifeed_resume(options: argparse.Namespace) -> dict[str, Any]:
    """Open the index and plan; time cursor load + next step + key lookup, then a whole decoding Feed."""
    from omnifeed.loader import Feed, SampleIndex
    from omnifeed.loader.plan import Plan, PlanCursor

    config = omnifeed_config(options)
    started = time.perf_counter()
    index = SampleIndex(options.work / f"index-{options.samples}")
    plan = Plan.from_index(index, config.plan)
    open_s = time.perf_counter() - started
    text = (options.work / "state.json").read_text(encoding="utf-8")
    state = json.loads(text)

    marks: list[float] = []

    def resume() -> list[str]:
        cursor = PlanCursor(plan)
        cursor.load_state_dict(state["plan"])
        marks.append(time.perf_counter())
        positions = cursor.next_step().micro_batches[0].positions
        marks.append(time.perf_counter())
        return [str(k) for k in index.keys(positions)]

    keys, resume_s, memory = timed_resume(resume)
    marks.append(time.perf_counter())
    expected = read_expected(options.work)

    def feed_resume() -> list[str]:
        with Feed(index, config) as feed:
            feed.load_state_dict(state)
            batch = feed.next_batch()
        return [str(k) for k in batch["__key__"]]

    feed_keys, feed_s, feed_memory = timed_resume(feed_resume)
    ok = keys == expected and feed_keys == expected
    return {
        "status": "ok" if ok else "error: the first batch after resume is not the expected one",
        "open_s": round(open_s, 4),
        "resume_s": round(resume_s, 4),
        **memory.figures(),
        "state_bytes": len(text.encode()),
        "first_batch_ok": ok,
        "resume_parts_s": {"next_step": round(marks[1] - marks[0], 4), "keys": round(marks[2] - marks[1], 4)},
        "feed_resume_s": round(feed_s, 4),
        "feed_peak_rss_mib": round(feed_memory.peak_mib, 1),
        "timed": "PlanCursor.load_state_dict + next_step + SampleIndex.keys of its micro-batch; "
        "feed_resume_s: Feed() + load_state_dict + next_batch (batch_size JPEGs read and decoded)",
    }


# -- torchdata StatefulDataLoader --------------------------------------------------------------
def import_torchdata() -> Any:
    """``StatefulDataLoader``, or ``Missing``."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as exc:
        raise Missing(f"torchdata.stateful_dataloader does not import ({exc})") from exc
    return StatefulDataLoader


def indices_dataset(samples: int) -> Any:
    """A map-style dataset of ``samples`` items, item ``i`` being ``tensor(i)``."""
    import torch

    class Indices(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return samples

        def __getitem__(self, i: int) -> Any:
            return torch.tensor(i)

    return Indices()


def torchdata_loader(samples: int, batch_size: int, workers: int, seed: int) -> Any:
    """A shuffled ``StatefulDataLoader`` over ``indices_dataset``, its generator seeded with ``seed``."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(seed)
    return import_torchdata()(
        indices_dataset(samples),
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        generator=generator,
        multiprocessing_context="fork" if workers else None,
    )


def torchdata_state(
    samples: int, batch_size: int, workers: int, batches: int, iterate_limit: int = ITERATE_LIMIT
) -> tuple[dict[str, Any], list[int], str]:
    """The loader's state after ``batches`` batches, the batch an uninterrupted run yields next, and how.

    Up to ``iterate_limit`` batches are iterated for real (the expected batch is then the real
    next one). Deeper, the state is a real one taken after a few batches with its position
    counters moved to ``batches`` (``shift_torchdata_state``), and the expected batch is the
    sampler's permutation (``torch.randperm`` from the state's generator) at the position.
    """
    loader = torchdata_loader(samples, batch_size, workers, SEED)
    iterator = iter(loader)
    real = batches <= iterate_limit
    for _ in range(batches if real else min(3, batches)):
        next(iterator)
    state = loader.state_dict()
    if real:
        expected = [int(i) for i in next(iterator)]
        how = f"iterated for real to batch {batches}; expected: the next batch of that run"
    else:
        state = shift_torchdata_state(state, batches, batch_size, workers)
        expected = permutation_batch(state, samples, batches * batch_size, batch_size, workers)
        how = (
            f"a real state after {min(3, batches)} batches, counters moved to batch {batches} (iterating "
            f"there takes ~1 ms a batch); expected: torch.randperm from the state's generator"
        )
    del iterator
    return state, expected, how


def shift_torchdata_state(state: dict[str, Any], batches: int, batch_size: int, workers: int) -> dict[str, Any]:
    """``state`` with every position counter at ``batches`` batches (the generator state is the epoch's, unchanged)."""
    main = state["_snapshot"]["_main_snapshot"] if workers else state
    main["_sampler_iter_state"]["samples_yielded"] = batches * batch_size
    main["_sampler_iter_state"]["sampler_iter_state"]["yielded"] = batches * batch_size
    main["_sampler_iter_yielded"] = batches
    if workers:
        state["_snapshot"]["_snapshot_step"] = batches
        state["_snapshot"]["_last_yielded_worker_id"] = (batches - 1) % workers
    else:
        state["_num_yielded"] = batches
    return state


def permutation_batch(state: dict[str, Any], samples: int, position: int, batch_size: int, workers: int) -> list[int]:
    """The sampler's epoch permutation (from the state's generator) at ``position``: the uninterrupted batch."""
    import torch

    main = state["_snapshot"]["_main_snapshot"] if workers else state
    generator = torch.Generator()
    generator.set_state(main["_sampler_iter_state"]["sampler_iter_state"]["generator"])
    return [int(i) for i in torch.randperm(samples, generator=generator)[position : position + batch_size]]


def _plain_state(value: Any) -> Any:
    """A state dict with its tensors (the generator's state) as tagged lists, for JSON."""
    import torch

    if isinstance(value, dict):
        return {k: _plain_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_state(v) for v in value]
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    return value


def _saved_size(state: dict[str, Any]) -> int:
    """Bytes of the state as a trainer checkpoints it (``torch.save``)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def _tensor_state(value: Any) -> Any:
    """The inverse of `_plain_state`."""
    import torch

    if isinstance(value, dict):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        return {k: _tensor_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tensor_state(v) for v in value]
    return value


def torchdata_save(options: argparse.Namespace) -> dict[str, Any]:
    """The loader's state at the position (as JSON: nothing here unpickles) and the expected batch."""
    import_torchdata()
    position, batches = position_of(options)
    options.work.mkdir(parents=True, exist_ok=True)
    state, expected, how = torchdata_state(options.samples, options.batch_size, options.workers, batches)
    (options.work / "state.json").write_text(json.dumps(_plain_state(state)), encoding="utf-8")
    write_expected(options.work, expected)
    return {"status": "ok", "position": position, "build_s": 0.0, "how": how}


def torchdata_resume(options: argparse.Namespace) -> dict[str, Any]:
    """A new loader (another seed) + ``load_state_dict`` + the first batch; the sampler fast-forwards."""
    started = time.perf_counter()
    loader = torchdata_loader(options.samples, options.batch_size, options.workers, SEED + 1)
    open_s = time.perf_counter() - started
    path = options.work / "state.json"
    state = _tensor_state(json.loads(path.read_text(encoding="utf-8")))

    def resume() -> list[int]:
        loader.load_state_dict(state)
        iterator = iter(loader)
        batch = [int(i) for i in next(iterator)]
        del iterator
        return batch

    batch, resume_s, memory = timed_resume(resume)
    ok = batch == read_expected(options.work)
    return {
        "status": "ok" if ok else "error: the first batch after resume is not the expected one",
        "open_s": round(open_s, 4),
        "resume_s": round(resume_s, 4),
        **memory.figures(),
        "state_bytes": _saved_size(state),
        "first_batch_ok": ok,
        "timed": "StatefulDataLoader.load_state_dict + iter + next (workers started inside it)",
    }


# -- MosaicML Streaming ------------------------------------------------------------------------
def import_streaming() -> Any:
    """The ``streaming`` module, or ``Missing``."""
    try:
        import streaming
    except ImportError as exc:
        raise Missing(f"streaming does not import ({exc})") from exc
    return streaming


def write_mds(out: Path, samples: int, limit_s: float) -> tuple[int, float]:
    """An MDS dataset of up to ``samples`` one-int samples, written for at most ``limit_s``; count and seconds."""
    streaming = import_streaming()
    done = out / "done.json"
    if done.is_file():
        cached = json.loads(done.read_text(encoding="utf-8"))
        if cached["requested"] == samples:
            return int(cached["samples"]), float(cached["seconds"])
    started = time.perf_counter()
    written = 0
    with streaming.MDSWriter(out=str(out / "mds"), columns={"i": "int64"}, size_limit=1 << 26) as writer:
        while written < samples and (written % 10_000 or time.perf_counter() - started < limit_s):
            writer.write({"i": written})
            written += 1
    seconds = time.perf_counter() - started
    done.write_text(json.dumps({"requested": samples, "samples": written, "seconds": seconds}), encoding="utf-8")
    return written, seconds


def streaming_dataset(options: argparse.Namespace) -> Any:
    """A shuffled ``StreamingDataset`` over the local MDS dataset (no remote), seed 0."""
    return import_streaming().StreamingDataset(
        local=str(options.work / "mds"), shuffle=True, shuffle_seed=SEED, batch_size=options.batch_size
    )


def streaming_expected(dataset: Any, started: Any, position: int, batch_size: int) -> tuple[list[int], str]:
    """The batch the uninterrupted epoch ``started`` yields at ``position``: iterated for real when small,
    else read off the epoch's sample order (what its iterator computes first)."""
    if position <= ITERATE_LIMIT * batch_size:
        taken = [int(sample["i"]) for sample in itertools.islice(started, position + batch_size)]
        return taken[position:], "expected: the uninterrupted epoch iterated for real"
    from streaming.base.batching import generate_work

    world = dataset._parallel_rank_world.detect_workers()
    ids = generate_work(dataset.batching_method, dataset, world, 0, 0).reshape(-1)  # the whole epoch, in order
    return (
        [int(dataset[int(i)]["i"]) for i in ids[position : position + batch_size]],
        "expected: the epoch's sample order (streaming's generate_work from sample 0) at the position",
    )


def streaming_save(options: argparse.Namespace) -> dict[str, Any]:
    """The MDS dataset (cached), the dataset's state at the position mid-epoch, and the expected batch."""
    options.work.mkdir(parents=True, exist_ok=True)
    written, seconds = write_mds(options.work, options.samples, WRITE_LIMIT_S)
    options.samples = written
    position, _ = position_of(options)
    dataset = streaming_dataset(options)
    epoch = iter(dataset)
    first = next(epoch)  # the epoch is under way, as in training: before it, state_dict names epoch -1
    state = dataset.state_dict(position, True)
    expected, how = streaming_expected(dataset, itertools.chain([first], epoch), position, options.batch_size)
    (options.work / "state.json").write_text(json.dumps(state), encoding="utf-8")
    write_expected(options.work, expected)
    return {
        "status": "ok",
        "samples": written,
        "position": position,
        "build_s": round(seconds, 2),
        "how": f"StreamingDataset.state_dict({position}, from_beginning=True) one sample into epoch 0; {how}",
    }


def streaming_resume(options: argparse.Namespace) -> dict[str, Any]:
    """Open the dataset; time ``load_state_dict`` + the first ``batch_size`` samples of the resumed epoch."""
    import_streaming()
    options.samples = json.loads((options.work / "done.json").read_text(encoding="utf-8"))["samples"]
    started = time.perf_counter()
    dataset = streaming_dataset(options)
    open_s = time.perf_counter() - started
    text = (options.work / "state.json").read_text(encoding="utf-8")
    state = json.loads(text)

    def resume() -> list[int]:
        dataset.load_state_dict(state)
        iterator = iter(dataset)
        return [int(next(iterator)["i"]) for _ in range(options.batch_size)]

    batch, resume_s, memory = timed_resume(resume)
    ok = batch == read_expected(options.work)
    return {
        "status": "ok" if ok else "error: the first batch after resume is not the expected one",
        "samples": options.samples,
        "open_s": round(open_s, 4),
        "resume_s": round(resume_s, 4),
        **memory.figures(),
        "state_bytes": len(text.encode()),
        "first_batch_ok": ok,
        "timed": "StreamingDataset.load_state_dict + iter + batch_size samples (no DataLoader, no workers)",
    }


# -- the subprocess ----------------------------------------------------------------------------
PHASES = {
    ("omnifeed", "save"): omnifeed_save,
    ("omnifeed", "resume"): omnifeed_resume,
    ("torchdata", "save"): torchdata_save,
    ("torchdata", "resume"): torchdata_resume,
    ("streaming", "save"): streaming_save,
    ("streaming", "resume"): streaming_resume,
}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The subprocess's options."""
    parser = argparse.ArgumentParser(prog="python -m omnifeed.tools._bench_resume", description=__doc__.split("\n")[0])
    parser.add_argument("--phase", choices=("save", "resume"), required=True)
    parser.add_argument("--loader", choices=LOADERS, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers (torchdata only)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one phase of one loader and print its result as one JSON line."""
    options = parse(argv)
    try:
        result = PHASES[(options.loader, options.phase)](options)
    except Missing as exc:
        result = {"status": f"missing: {exc}"}
    except Exception as exc:  # a loader may fail any way it likes; the row says how
        result = {"status": f"error: {options.phase}: {type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
